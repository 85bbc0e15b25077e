"""ZeRO-Infinity optimizer states: the fp32 masters and Adam's two moments of
this rank live in an NVMe swap file (swap.py) and the step streams them,
sub-group by sub-group, through a bounded pool of host buffers.

[Note: streaming a step]
A sub-group is whole master slices (one per parameter piece of a bucket's owned
span) up to sub_group_size elements, as DeepSpeed groups whole parameters; its
file region holds three page-aligned parts: master, exp_avg, exp_avg_sq.

    I/O thread(s): read 0 | read 1          | read 2, write 0    | read 3, write 1
    host:                 | update 0, copy  | update 1, copy     | update 2, copy
                            out to params

With pipeline_read the read of sub-group s+1 starts before s is updated; with
pipeline_write the write-back of s runs while s+1 is updated. Sub-group s uses
buffer s % buffer_count, reused once its previous write finished, so host
memory stays at buffer_count regions whatever the model size.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from ..optim import host_adam
from ..sharding import state
from ..sharding.param_group import ZeroBucket, fold_into_master
from .config import AioOptions, OffloadOptions
from .swap import ALIGN, IOPool, SwapFile, Transfer, aligned_empty, round_up

STATE_NAMES = ("exp_avg", "exp_avg_sq")
PARTS = ("master", *STATE_NAMES)  # a sub-group's region, in this order
Member = tuple[int, int]  # (bucket index, index in bucket.master_views)
CopyOut = Callable[[int, int, torch.Tensor], None]  # (bucket index, begin in the owned span, fp32 values)


@dataclass(frozen=True, slots=True)
class SubGroup:
    members: tuple[Member, ...]
    numel: int
    offset: int  # bytes, in the swap file
    part_nbytes: int  # one of the three parts, page-aligned


def plan_sub_groups(numels: list[list[int]], sub_group_size: int) -> list[SubGroup]:
    """Greedy, in bucket order: a slice larger than sub_group_size is a sub-group of its own."""
    groups: list[SubGroup] = []
    members: list[Member] = []
    total = offset = 0

    def close() -> None:
        nonlocal members, total, offset
        if members:
            part = round_up(total * 4)
            groups.append(SubGroup(tuple(members), total, offset, part))
            offset += 3 * part
        members, total = [], 0

    for k, bucket in enumerate(numels):
        for j, numel in enumerate(bucket):
            if members and total + numel > sub_group_size:
                close()
            members.append((k, j))
            total += numel
    close()
    return groups


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """The states streamed are Adam's, updated by host_adam.py."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or \
            any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups):
        raise ValueError(f"zero config: zero_optimization.offload_optimizer.device nvme streams Adam/AdamW states "
                         f"(amsgrad and maximize off); got {type(optimizer).__name__}")


class NvmeStates:
    """The swapped masters and states of `buckets` (their master_views are the
    optimizer's parameters; between steps they hold no memory)."""

    def __init__(self, buckets: list[ZeroBucket], numels: list[list[int]], options: OffloadOptions, aio: AioOptions,
                 *, sub_group_size: int, rank: int) -> None:
        """`numels`: each bucket's master slices (the master_views to come)."""
        self.buckets, self.options = buckets, options
        self.sub_groups = plan_sub_groups(numels, sub_group_size)
        last = self.sub_groups[-1] if self.sub_groups else None
        self.file = SwapFile(options.nvme_path, f"optimizer-rank{rank}",
                             last.offset + 3 * last.part_nbytes if last else 0, key="offload_optimizer.nvme_path")
        self.io = IOPool(aio)
        region = max((3 * s.part_nbytes for s in self.sub_groups), default=0)
        self.buffers = [aligned_empty(region) for _ in range(min(options.buffer_count, len(self.sub_groups)))]
        self.writes: list[Transfer | None] = [None] * len(self.buffers)
        self.empty = torch.empty(0)
        self.steps: dict[Member, torch.Tensor] = {}

    @property
    def offload_host_nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def parts(self, index: int) -> list[torch.Tensor]:
        """Sub-group `index`'s master, exp_avg, exp_avg_sq in its buffer."""
        sub = self.sub_groups[index]
        raw = self.buffers[index % len(self.buffers)]
        return [raw[p * sub.part_nbytes:(p + 1) * sub.part_nbytes].view(torch.float32)[:sub.numel] for p in range(3)]

    def slices(self, index: int) -> Iterator[tuple[Member, int, int]]:
        """(member, begin, end) of each member in the sub-group's parts."""
        offset = 0
        for member in self.sub_groups[index].members:
            _, begin, end = self.buckets[member[0]].master_views[member[1]]
            yield member, offset, offset + end - begin
            offset += end - begin

    # ---- I/O -------------------------------------------------------------------------
    def _buffer(self, index: int) -> torch.Tensor:
        slot = index % len(self.buffers)
        if self.writes[slot] is not None:
            self.writes[slot].wait()
            self.writes[slot] = None
        return self.buffers[slot]

    def start_read(self, index: int) -> Transfer:
        sub = self.sub_groups[index]
        return self.io.read(self.file, sub.offset, self._buffer(index)[:3 * sub.part_nbytes])

    def start_write(self, index: int, *, masters_only: bool = False) -> None:
        sub = self.sub_groups[index]
        slot = index % len(self.buffers)
        nbytes = sub.part_nbytes if masters_only else 3 * sub.part_nbytes
        self.writes[slot] = self.io.write(self.file, sub.offset, self.buffers[slot][:nbytes])

    def finish_writes(self) -> None:
        for slot, write in enumerate(self.writes):
            if write is not None:
                write.wait()
                self.writes[slot] = None

    # ---- set-up ------------------------------------------------------------------------
    def write_initial(self, masters: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Writes every bucket's fp32 master (owned span), taken from `masters`
        ((bucket index, master) in bucket order) as the sub-groups need them and
        dropped once written: a sub-group's buckets are held at most. The moments
        start as zeros: written out unless fast_init (then the reserved file's zeros)."""
        held: dict[int, torch.Tensor] = {}
        made = iter(masters)
        for index, sub in enumerate(self.sub_groups):
            while sub.members[-1][0] not in held:
                k, master = next(made)
                held[k] = master
            for k in [k for k in held if k < sub.members[0][0]]:
                del held[k]
            self._buffer(index)
            master, *moments = self.parts(index)
            for (k, j), lo, hi in self.slices(index):
                _, begin, end = self.buckets[k].master_views[j]
                master[lo:hi].copy_(held[k][begin:end])
            for moment in moments:
                moment.zero_()
            self.start_write(index, masters_only=self.options.fast_init)
        for _ in made:  # buckets with nothing to write (no owned slices) are set up all the same
            pass
        self.finish_writes()

    # ---- the step ------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], coef: float, copy_out: CopyOut) -> None:
        """One optimizer step over every sub-group; see [Note: streaming a step]."""
        count = len(self.sub_groups)
        prefetch = self.options.pipeline_read and len(self.buffers) > 1
        read = self.start_read(0) if count else None
        for index in range(count):
            read.wait()
            if prefetch and index + 1 < count:
                read = self.start_read(index + 1)
            views = self.bind(index, optimizer, grads)
            host_adam.adam_step(optimizer, coef, {})
            for ((k, j), _, _), view in zip(self.slices(index), views):
                copy_out(k, self.buckets[k].master_views[j][1], view.detach())
            self.unbind(index, optimizer)
            self.start_write(index)
            if not self.options.pipeline_write or len(self.buffers) == 1:
                self.finish_writes()
            if not prefetch and index + 1 < count:
                read = self.start_read(index + 1)
        self.finish_writes()

    def bind(self, index: int, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Points the sub-group's parameters and states at its buffer and hands
        them their fp32 gradients; returns the parameters."""
        master, exp_avg, exp_avg_sq = self.parts(index)
        views = []
        for member, lo, hi in self.slices(index):
            view, begin, end = self.buckets[member[0]].master_views[member[1]]
            view.data = master[lo:hi]
            state = optimizer.state[view]
            state["step"] = self.steps.setdefault(member, torch.zeros((), dtype=torch.float32))
            state["exp_avg"], state["exp_avg_sq"] = exp_avg[lo:hi], exp_avg_sq[lo:hi]
            if grads is not None:  # a CUDA model's gradient comes to the host here
                view.grad = grads[member[0]][begin:end].to(device="cpu", dtype=torch.float32)
            views.append(view)
        return views

    def unbind(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        for (k, j), _, _ in self.slices(index):
            view = self.buckets[k].master_views[j][0]
            view.grad, view.data = None, self.empty
            state = optimizer.state[view]
            state["exp_avg"] = state["exp_avg_sq"] = self.empty

    def fold_values(self, k: int, values: torch.Tensor) -> None:
        """Read, modify, write: bucket `k`'s swapped master slices take `values`
        (its owned span) where they differ from the master rounded; the moments
        are left as they are. Only the sub-groups holding bucket `k` are read."""
        for index in range(len(self.sub_groups)):
            mine = [(j, lo, hi) for (bucket, j), lo, hi in self.slices(index) if bucket == k]
            if not mine:
                continue
            self.start_read(index).wait()
            master = self.parts(index)[0]
            for j, lo, hi in mine:
                _, begin, end = self.buckets[k].master_views[j]
                fold_into_master(master[lo:hi], values[begin:end])
            self.start_write(index, masters_only=True)
        self.finish_writes()

    # ---- reads, for checkpoints -------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[Member, str], torch.Tensor]]:
        """Yields read(member, kind): the member's swapped "master", "exp_avg" or
        "exp_avg_sq" (a view in a buffer, valid until the next read) or its
        "step". A read loads the member's sub-group unless it was the last one
        loaded, so reads in member order hold one sub-group at a time."""
        where = {member: (index, lo, hi) for index in range(len(self.sub_groups))
                 for member, lo, hi in self.slices(index)}
        loaded: list[int | None] = [None]
        self.finish_writes()

        def read(member: Member, kind: str) -> torch.Tensor:
            if kind == "step":
                return self.steps.setdefault(member, torch.zeros((), dtype=torch.float32))
            index, lo, hi = where[member]
            if loaded[0] != index:
                self.start_read(index).wait()
                loaded[0] = index
            return self.parts(index)[PARTS.index(kind)][lo:hi]
        yield read

    def read_master(self, k: int) -> torch.Tensor:
        """Bucket `k`'s fp32 master (its owned span): from each sub-group holding
        a piece of it, only the pages of those masters are read (a sub-group may
        hold every bucket: sub_group_size defaults to 1e9 elements), into its buffer."""
        bucket = self.buckets[k]
        master = torch.zeros(bucket.owned.numel, dtype=torch.float32)
        self.finish_writes()
        for index, sub in enumerate(self.sub_groups):
            mine = [(j, lo, hi) for (b, j), lo, hi in self.slices(index) if b == k]  # in order: lo grows
            if not mine:
                continue
            first = mine[0][1] * 4 // ALIGN * ALIGN  # bytes into the master part, page-aligned for direct I/O
            pages = self._buffer(index)[first:round_up(mine[-1][2] * 4)]  # where the sub-group's master goes
            self.io.read(self.file, sub.offset + first, pages).wait()
            values, skip = pages.view(torch.float32), first // 4
            for j, lo, hi in mine:
                _, begin, end = bucket.master_views[j]
                master[begin:end].copy_(values[lo - skip:hi - skip])
        return master

    def load(self, saved: dict[Member, dict[str, object]], *, optimizer_states: bool, copy_out: CopyOut) -> None:
        """A checkpoint's values, sub-group by sub-group: each member's saved
        master (a member without one keeps its own) and, with `optimizer_states`,
        its moments and step (what was not saved starts from zero, as the
        optimizer's load_state_dict drops states it is not given); the masters
        go out to the parameters (copy_out) and the sub-group back to the file.
        A saved value is a tensor or a saved range (checkpoint/load.py)."""
        for index in range(len(self.sub_groups)):
            self.start_read(index).wait()
            parts = self.parts(index)
            for member, lo, hi in self.slices(index):
                values = saved.get(member, {})
                if "master" in values:
                    state.fill(parts[0][lo:hi], values["master"])
                if optimizer_states:
                    for part, name in zip(parts[1:], STATE_NAMES):
                        state.fill(part[lo:hi], values[name]) if name in values else part[lo:hi].zero_()
                    step = torch.zeros((), dtype=torch.float32)
                    self.steps[member] = state.fill(step, values["step"]) if "step" in values else step
                k, j = member
                copy_out(k, self.buckets[k].master_views[j][1], parts[0][lo:hi])
            self.start_write(index)
        self.finish_writes()

    # ---- ordinary tensors, for checkpoints -------------------------------------------------
    def materialize(self, optimizer: torch.optim.Optimizer) -> None:
        """Every bucket's master and the states as in-memory tensors (views of
        the masters are the parameters again)."""
        for bucket in self.buckets:
            bucket.master = torch.empty(bucket.owned.numel, dtype=torch.float32)
        for index in range(len(self.sub_groups)):
            self.start_read(index).wait()
            master, exp_avg, exp_avg_sq = self.parts(index)
            for member, lo, hi in self.slices(index):
                bucket = self.buckets[member[0]]
                view, begin, end = bucket.master_views[member[1]]
                bucket.master[begin:end].copy_(master[lo:hi])
                view.data = bucket.master[begin:end]
                optimizer.state[view] = {"step": self.steps.setdefault(member, torch.zeros((), dtype=torch.float32)),
                                         "exp_avg": exp_avg[lo:hi].clone(), "exp_avg_sq": exp_avg_sq[lo:hi].clone()}

    def release(self, optimizer: torch.optim.Optimizer, *, write_back: bool) -> None:
        """Undoes materialize(), writing masters and states back first when asked."""
        for index in range(len(self.sub_groups)):
            self._buffer(index)
            parts = self.parts(index)
            for member, lo, hi in self.slices(index):
                view = self.buckets[member[0]].master_views[member[1]][0]
                state = optimizer.state[view]
                if write_back:
                    parts[0][lo:hi].copy_(view.detach())
                    for part, name in zip(parts[1:], STATE_NAMES):
                        part[lo:hi].copy_(state[name]) if name in state else part[lo:hi].zero_()
                    step = state.get("step", torch.zeros(()))
                    self.steps[member] = torch.as_tensor(step, dtype=torch.float32).clone()
                state["step"] = self.steps.setdefault(member, torch.zeros((), dtype=torch.float32))
                state["exp_avg"] = state["exp_avg_sq"] = self.empty
                view.data = self.empty
            if write_back:
                self.start_write(index)
        self.finish_writes()
        for bucket in self.buckets:
            bucket.master = None

    def close(self) -> None:
        """Ends the I/O threads and closes the swap file (idempotent)."""
        self.io.close()
        self.file.close()
