"""ZeRO-Infinity: a ParamGroup with offload to NVMe: optimizer states
(nvme_states.py) and, at stage 3, the 16-bit parameter shards of non-resident
buckets (ShardSwap) live in swap files.

[Note: swapped parameter shards]
A swapped bucket's `shard` is an empty tensor between uses. start_unshard reads
it into one of offload_param.buffer_count page-aligned buffers and all-gathers
from there; the buffer returns to the pool when the gather finished (unshard or
reshard). When every buffer is in use, the oldest gather is finished first.
The step writes each updated shard back. The first buckets, up to max_in_cpu
elements, keep their shards in memory.
"""
from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from ..checkpoint.format import Deferred, NamedShard
from ..optim import host_adam
from ..sharding import state
from ..sharding.param_group import ZeroBucket, fold_into_master
from ..sharding.policy import ShardingPolicy
from ..sharding.seam import Comm
from .config import AioOptions, OffloadOptions
from .host import HostParamGroup
from .nvme_states import STATE_NAMES, Member, NvmeStates, check_optimizer
from .swap import IOPool, SwapFile, aligned_empty, round_up


class ShardSwap:
    """The swapped 16-bit shards; see [Note: swapped parameter shards]."""

    def __init__(self, buckets: list[ZeroBucket], options: OffloadOptions, aio: AioOptions, *, rank: int) -> None:
        kept, self.offsets, offset = 0, {}, 0
        for bucket in buckets:
            numel = bucket.shard.numel()
            if bucket.span.resident or kept + numel <= options.max_in_cpu:
                kept += 0 if bucket.span.resident else numel
                continue
            if numel > options.buffer_size:
                raise ValueError(f"zero config: zero_optimization.offload_param.buffer_size ({options.buffer_size}) "
                                 f"< a parameter shard of {numel} elements (bucket {bucket.span.index}, rank {rank})")
            self.offsets[bucket.span.index] = offset
            offset += round_up(numel * bucket.shard.element_size())
        self.file = SwapFile(options.nvme_path, f"params-rank{rank}", offset, key="offload_param.nvme_path")
        self.io = IOPool(aio)
        largest = max((round_up(b.shard.nbytes) for b in buckets if b.span.index in self.offsets), default=0)
        self.free = [aligned_empty(largest) for _ in range(min(options.buffer_count, len(self.offsets)))]
        self.in_use: OrderedDict[int, torch.Tensor] = OrderedDict()  # bucket index -> its buffer, oldest first
        self.staged: dict[int, tuple[torch.Tensor, list[int]]] = {}  # bucket -> (shard being updated, elements in)

    def swapped(self, bucket: ZeroBucket) -> bool:
        return bucket.span.index in self.offsets

    def write(self, bucket: ZeroBucket, values: torch.Tensor) -> None:
        """Writes `values` (the whole shard) to the bucket's region."""
        raw = aligned_empty(values.nbytes)
        raw[:values.nbytes].view(values.dtype).copy_(values)
        self.io.write(self.file, self.offsets[bucket.span.index], raw[:round_up(values.nbytes)]).wait()

    def read(self, bucket: ZeroBucket, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The bucket's shard, read into a pool buffer (held until release)."""
        raw = self.free.pop()
        nbytes = numel * dtype.itemsize
        self.io.read(self.file, self.offsets[bucket.span.index], raw[:round_up(nbytes)]).wait()
        self.in_use[bucket.span.index] = raw
        return raw[:nbytes].view(dtype)

    def release(self, bucket: ZeroBucket) -> bool:
        """Returns the bucket's buffer to the pool; False when it held none."""
        raw = self.in_use.pop(bucket.span.index, None)
        if raw is not None:
            self.free.append(raw)
        return raw is not None

    def stage(self, bucket: ZeroBucket, begin: int, values: torch.Tensor) -> None:
        """Collects updated pieces of a swapped shard (the padding stays zero)
        and writes the shard once every parameter slice of it arrived."""
        index = bucket.span.index
        if index not in self.staged:
            self.staged[index] = (torch.zeros(bucket.owned.numel, dtype=bucket.shard.dtype), [0])
        shard, arrived = self.staged[index]
        shard[begin:begin + values.numel()].copy_(values)
        arrived[0] += values.numel()
        if arrived[0] >= sum(end - start for _, start, end in bucket.master_views):
            self.write(bucket, shard)
            del self.staged[index]

    @property
    def disk_nbytes(self) -> int:
        return self.file.nbytes

    def close(self) -> None:
        """Ends the I/O threads and closes the swap file (idempotent)."""
        self.io.close()
        self.file.close()

    @property
    def offload_host_nbytes(self) -> int:
        return sum(b.numel() for b in self.free) + sum(b.numel() for b in self.in_use.values())


class NvmeParamGroup(HostParamGroup):
    """offload_optimizer nvme (states in a swap file) and/or offload_param nvme
    (stage 3 shards in a swap file)."""

    def __init__(self, buckets: list[ZeroBucket], policy: ShardingPolicy, comm: Comm, *,
                 optimizer: torch.optim.Optimizer, aio: AioOptions, sub_group_size: int, **kwargs) -> None:
        # The shards go to their swap file before ParamGroup allocates the gradient
        # buffers: set-up holds one or the other, not both.
        param_options = kwargs.get("param_options")
        self.shards = self._swap_out(buckets, param_options, aio, comm.rank) \
            if param_options is not None and param_options.device == "nvme" and policy.shard_params else None
        super().__init__(buckets, policy, comm, **kwargs)
        self.optimizer = optimizer  # whose state the swapped moments are
        self.aio, self.sub_group_size = aio, sub_group_size
        self.states: NvmeStates | None = None
        self.materialized = False
        if self.options.device == "nvme":
            check_optimizer(optimizer)

    def setup_masters(self) -> list[tuple[int, torch.Tensor]]:
        if self.options.device != "nvme":
            return super().setup_masters()
        numels = [[end - begin for _, begin, end in self.owned_slices(bucket)] for bucket in self.buckets]
        self.states = NvmeStates(self.buckets, numels, self.options, self.aio, sub_group_size=self.sub_group_size,
                                 rank=self.comm.rank)
        out: list[tuple[int, torch.Tensor]] = []
        self.states.write_initial(self._made_masters(out))
        self.place_host_shards()
        return out

    @staticmethod
    def _swap_out(buckets: list[ZeroBucket], options: OffloadOptions, aio: AioOptions, rank: int) -> ShardSwap:
        shards = ShardSwap(buckets, options, aio, rank=rank)
        for bucket in buckets:
            if shards.swapped(bucket):
                shards.write(bucket, bucket.shard)
                bucket.shard = bucket.shard.new_empty(0)  # placeholder()
        return shards

    def setup_master(self, bucket: ZeroBucket) -> list[tuple[int, torch.Tensor]]:
        """A swapped shard is read back for its master (a copy: an fp32 master is its source)."""
        if self.shards is None or not self.shards.swapped(bucket):
            return super().setup_master(bucket)
        placeholder = bucket.shard
        values = self.shards.read(bucket, bucket.span.local_chunk(bucket.rank).numel, placeholder.dtype)
        bucket.shard = values.to(placeholder.device, copy=True)
        self.shards.release(bucket)
        try:
            return super().setup_master(bucket)
        finally:
            bucket.shard = placeholder

    def _made_masters(self, out: list[tuple[int, torch.Tensor]]) -> Iterator[tuple[int, torch.Tensor]]:
        """Each bucket's fp32 master, made when the initial write asks for it (so
        at most a sub-group's buckets are in memory at once). The optimizer's
        parameters, appended to `out`, are leaf tensors that hold memory only
        while bound to a buffer, not views of the master (which keep it alive)."""
        for k, bucket in enumerate(self.buckets):
            pairs = self.setup_master(bucket)
            master, bucket.master = bucket.master, None
            for m, (_, begin, end) in enumerate(bucket.master_views):
                bucket.master_views[m] = (self.states.empty.clone().requires_grad_(), begin, end)
            out.extend((index, leaf) for (index, _), (leaf, _, _) in zip(pairs, bucket.master_views))
            yield k, master

    def offloaded(self, bucket: ZeroBucket) -> bool:
        return self.states is not None or super().offloaded(bucket)

    def disk_nbytes(self) -> int:
        return sum(part.file.nbytes for part in (self.states, self.shards) if part is not None)

    def offload_host_nbytes(self) -> int:
        return super().offload_host_nbytes() + sum(part.offload_host_nbytes for part in (self.states, self.shards)
                                                   if part is not None)

    # ---- stage 3: swapped shards --------------------------------------------------------------
    def start_unshard(self, bucket: ZeroBucket, backward: bool = False) -> None:
        if self.shards is not None and self.shards.swapped(bucket) and bucket.full is None and bucket.gather is None:
            if not self.shards.free:
                self.unshard(self.buckets[next(iter(self.shards.in_use))])
            shard = self.shards.read(bucket, bucket.span.local_chunk(bucket.rank).numel, bucket.shard.dtype)
            bucket.shard = shard.to(self.device)  # a CUDA model: to the device, and the buffer could go now
        super().start_unshard(bucket, backward)

    def unshard(self, bucket: ZeroBucket, backward: bool = False) -> None:
        super().unshard(bucket, backward)
        self._release(bucket)

    def reshard(self, bucket: ZeroBucket) -> None:
        super().reshard(bucket)
        self._release(bucket)

    def _release(self, bucket: ZeroBucket) -> None:
        if self.shards is not None and self.shards.release(bucket):
            bucket.shard = self.placeholder(bucket)

    def adopt_owned_values(self, bucket: ZeroBucket, values: torch.Tensor) -> None:
        """As ParamGroup's, with the master and the shard where they are swapped."""
        with torch.no_grad():
            if self.states is not None and not self.materialized:
                self.states.fold_values(bucket.span.index, values)
            else:
                fold_into_master(bucket.master, values)
            if self.shards is not None and self.shards.swapped(bucket):
                self.shards.write(bucket, values)
            else:
                self.publish_target(bucket).copy_(values)

    # ---- the step ----------------------------------------------------------------------------
    def owned_grads_fp32(self) -> Sequence[torch.Tensor]:
        if self.states is None:
            return super().owned_grads_fp32()
        return Float32Grads([b.owned_grad() for b in self.buckets])

    def step(self, optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor], coef: float,
             copies: host_adam.StepCopies | None = None) -> None:
        if self.states is None:
            super().step(optimizer, grads, coef, copies)
            return
        self.states.step(optimizer, grads.raw, coef, self.copy_out)
        optimizer.zero_grad(set_to_none=True)
        self.finish_publish()
        self.zero_grads()

    def copy_out(self, index: int, begin: int, values: torch.Tensor) -> None:
        """Updated fp32 master values of bucket `index` from `begin` (owned span) into its parameters."""
        bucket = self.buckets[index]
        if self.shards is not None and self.shards.swapped(bucket):
            self.shards.stage(bucket, begin, values)
        else:
            self.publish_target(bucket)[begin:begin + values.numel()].copy_(values)

    def finish_publish(self) -> None:
        """All-gathers resident buckets (swapped shards were written as they completed)."""
        assert self.shards is None or not self.shards.staged, "every swapped shard was written"
        works = [self.comm.all_gather(b.full, b.shard, async_op=True) for b in self.buckets
                 if self.policy.shard_optimizer and b.span.resident]
        for work in works:
            work.wait()

    def host_outputs(self) -> dict[int, torch.Tensor]:
        outputs = super().host_outputs()
        for bucket in self.buckets:
            if self.shards is not None and self.shards.swapped(bucket):
                for view, _, _ in bucket.master_views:
                    outputs.pop(id(view), None)
        return outputs

    def publish_masters(self, published: set[int] = frozenset()) -> None:
        with self._masters_in_memory(write_back=False):
            for index, bucket in enumerate(self.buckets):
                if index not in published:
                    self.copy_out(index, 0, bucket.master)
            self.finish_publish()

    def owned_master(self, bucket: ZeroBucket) -> torch.Tensor:
        """Read from the swap file where the masters are swapped (whole_masters
        then holds one bucket's master, not every one)."""
        if self.states is None or self.materialized:
            return super().owned_master(bucket)
        return self.states.read_master(bucket.span.index)

    @contextlib.contextmanager
    def saved_shards(self) -> Iterator[list[NamedShard]]:
        """Swapped masters and states as Deferred reads: a save holds one
        sub-group of them at a time."""
        if self.states is None or self.materialized:
            with super().saved_shards() as shards:
                yield shards
            return
        with self.states.reading() as read:
            shards = []
            for shard, member in self._named_members():
                for kind in ("master", "step", *STATE_NAMES):  # as materialize() orders them
                    shard.tensors[kind] = Deferred(() if kind == "step" else (shard.numel,), torch.float32,
                                                   functools.partial(read, member, kind))
                shards.append(shard)
            yield shards

    def load_state_dict(self, saved: dict[str, dict[str, object]], *, optimizer_states: bool = True) -> None:
        """As ParamGroup's (state.py's load_state_dict), one swapped sub-group at a time."""
        if self.states is None or self.materialized:
            super().load_state_dict(saved, optimizer_states=optimizer_states)
            return
        self.release_kept()
        by_member = {member: saved[shard.key] for shard, member in self._named_members() if shard.key in saved}
        with torch.no_grad():
            self.states.load(by_member, optimizer_states=optimizer_states, copy_out=self.copy_out)
        self.finish_publish()
        self.zero_grads()

    def _named_members(self) -> list[tuple[NamedShard, Member]]:
        """state.master_slices' shards, each with its member in the swapped sub-groups."""
        member_of = {id(view): (k, j) for k, bucket in enumerate(self.buckets)
                     for j, (view, _, _) in enumerate(bucket.master_views)}
        return [(shard, member_of[id(view)]) for shard, view in state.master_slices(self)]

    def offloaded_states(self) -> contextlib.AbstractContextManager:
        return self._masters_in_memory(write_back=True)

    @contextlib.contextmanager
    def _masters_in_memory(self, *, write_back: bool) -> Iterator[None]:
        """Re-entrant: inside an outer one (a checkpoint calling full_masters) it does nothing."""
        if self.states is None or self.materialized:
            yield
            return
        self.states.materialize(self.optimizer)
        self.materialized = True
        try:
            yield
        finally:
            self.materialized = False
            self.states.release(self.optimizer, write_back=write_back)

    def close(self) -> None:
        """Also ends the swappers' I/O threads and closes their swap files."""
        try:
            for part in (self.states, self.shards):
                if part is not None:
                    part.close()
        finally:
            super().close()


class Float32Grads(Sequence):
    """The owned gradients as fp32, converted one at a time when read (a whole
    fp32 copy of every bucket would cost what NVMe offload saves)."""

    def __init__(self, raw: list[torch.Tensor]) -> None:
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: int) -> torch.Tensor:
        g = self.raw[index]
        return g if g.dtype == torch.float32 else g.float()
