"""BucketScheduler: reduces the gradients of flat buffers bucket by bucket
while backward is still running, and reports how much of it was hidden.

[Note: bucket launch order]
Ranks must issue the same collectives in the same order. A bucket is launched
when all its parameters are marked ready *and* every bucket before it in the
launch order has been launched; the launch order is fixed for all ranks by the
layout (expected ready order), never by the order gradients happen to arrive.

Timeline of one step (CPU; on CUDA the comm thread is a comm stream):

    backward: |grads of bucket 0|grads of bucket 1|grads of bucket 2| finish(): wait
    comm:                       |   bucket 0      |   bucket 1      | bucket 2 |
                                                                    ^ backward end: after it, comm is exposed

Contract per step: zero the gradients (`zero_grad()`), run backward (the hooks
call `mark_ready`), call `finish()`. After finish(), in "all_reduce" mode every
.grad holds the reduced gradient; in "reduce_scatter" mode only this rank's
chunk of each bucket does (`grad_shards()`), and the rest of the buffer holds
undefined partial sums until the next zero_grad().
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from .buffer import FlatBuffer
from .collectives import all_reduce, broadcast, reduce_scatter
from .group import Group, resolve_group
from .launch import EMPTY_REPORT, OverlapReport, StartCollective, StreamLaunch, ThreadLaunch, overlap_report, stream_report
from .ops import ReduceOp, to_reduce_op

MODES = ("reduce_scatter", "all_reduce")
Slot = tuple[int, int]  # (buffer index, parameter index in that buffer)


class BucketScheduler:
    """Launches each bucket's collective as soon as its gradients are ready."""

    def __init__(self, buffers: Sequence[FlatBuffer], group: Group | None = None, *, mode: str = "reduce_scatter",
                 op: object = ReduceOp.AVG, overlap: bool = True, find_unused_parameters: bool = False,
                 timeout: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"BucketScheduler: mode={mode!r} is not one of {MODES}")
        if len({b.device.type for b in buffers}) > 1:
            raise ValueError(f"BucketScheduler: buffers on {[str(b.device) for b in buffers]}: use one scheduler per device type")
        self.buffers = list(buffers)
        self.group = resolve_group(group, "BucketScheduler")
        for buffer in self.buffers:
            if buffer.world_size != self.group.world_size:
                raise ValueError(f"BucketScheduler: {buffer} was laid out for world_size {buffer.world_size}, "
                                 f"the group has {self.group.world_size} (rank {self.group.rank})")
        self.mode, self.op = mode, to_reduce_op(op, where="BucketScheduler")
        self.overlap, self.find_unused_parameters = overlap, find_unused_parameters
        self.timeout_s = timeout if timeout is not None else self.group.transport.timeout_s + 5.0
        self._slot_of = {id(p): (b, i) for b, buf in enumerate(self.buffers) for i, p in enumerate(buf.params)}
        self._registration: list[Slot] = [(b, i) for b, buf in enumerate(self.buffers) for i in range(len(buf.params))]
        self._names: dict[Slot, str] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._lock = threading.Lock()
        self._sync_enabled = True
        self._comm_stream: torch.cuda.Stream | None = None
        self._launch_order = self._plan_launch_order(None)
        self._report: OverlapReport | None = EMPTY_REPORT
        self._lazy_report = None
        self._last_observed: list[Slot] = []
        self._reset_step()

    # -- set-up ---------------------------------------------------------------
    def register_hooks(self, params: Iterable[torch.nn.Parameter | tuple[str, torch.nn.Parameter]]) -> None:
        """Calls mark_ready from each parameter's post-accumulate-grad hook.
        `params` in registration order (model.parameters() or
        model.named_parameters(): names make errors readable); it fixes the
        expected ready order (its reverse) used for the launch order."""
        registration = []
        for item in params:
            name, param = item if isinstance(item, tuple) else (None, item)
            if not param.requires_grad:
                continue
            slot = self._slot_of.get(id(param))
            if slot is None:
                raise ValueError(f"BucketScheduler.register_hooks: parameter {name or tuple(param.shape)} requires "
                                 f"grad but is in none of the {len(self.buffers)} buffers (rank {self.group.rank})")
            registration.append(slot)
            self._names[slot] = name or f"buffer {slot[0]} param {slot[1]} {tuple(param.shape)}"
            self._hooks.append(param.register_post_accumulate_grad_hook(self.mark_ready))
        missing = set(self._registration) - set(registration)
        self._registration = registration + sorted(missing)
        self._launch_order = self._plan_launch_order(None)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _plan_launch_order(self, observed: Sequence[Slot] | None) -> list[Slot]:
        """Buckets sorted by when their last gradient is expected: `observed`
        ready order, else reverse registration order. See [Note: bucket launch order]."""
        expected = list(observed) if observed is not None else self._registration[::-1]
        position = {slot: n for n, slot in enumerate(expected)}
        keys = []
        for b, buffer in enumerate(self.buffers):
            for bucket in buffer.layout.buckets:
                last = max(position.get((b, i), len(position)) for i in bucket.param_indices)
                keys.append((last, b, bucket.index))
        return [(b, k) for _, b, k in sorted(keys)]

    def rebuild_buckets(self) -> None:
        """Collective: re-lays out every buffer in rank 0's ready order of the
        last synchronized step (allocates new buffers: call it once, after the
        first step, before an optimizer captures views of the buffers)."""
        ids = {slot: n for n, slot in enumerate(self._registration)}
        observed_set = set(self._last_observed)
        seen = [ids[s] for s in self._last_observed] + [n for s, n in ids.items() if s not in observed_set]
        order = torch.tensor(seen, dtype=torch.int64)
        broadcast(order, 0, self.group)
        observed = [self._registration[n] for n in order.tolist()]
        for b, buffer in enumerate(self.buffers):
            buffer.reorder([i for bb, i in observed if bb == b])
        self._launch_order = self._plan_launch_order(observed)
        self._reset_step()

    # -- one step -------------------------------------------------------------
    def _reset_step(self) -> None:
        self._remaining = {(b, k.index): len(k.param_indices) for b, buf in enumerate(self.buffers)
                           for k in buf.layout.buckets}
        self._marked: set[Slot] = set()
        self._observed: list[Slot] = []
        self._next_launch = 0
        self._launches: list[ThreadLaunch | StreamLaunch] = []
        self._active = False

    def mark_ready(self, param: torch.Tensor) -> None:
        """Param's gradient is final for this backward: (re)binds .grad to the
        buffer and launches every bucket that is now complete, in launch order."""
        slot = self._slot_of.get(id(param))
        if slot is None:
            raise ValueError(f"BucketScheduler.mark_ready: parameter {tuple(param.shape)} {param.dtype} is in no "
                             f"buffer (rank {self.group.rank})")
        with self._lock:
            self.buffers[slot[0]].bind_grad(param)
            if not self._sync_enabled:
                return
            if slot in self._marked:
                raise RuntimeError(f"BucketScheduler.mark_ready: {self._name(slot)} marked ready twice in one step on "
                                   f"rank {self.group.rank}: call finish() after each backward (or use no_sync())")
            self._active = True
            self._marked.add(slot)
            self._observed.append(slot)
            bucket = (slot[0], self.buffers[slot[0]].layout.params[slot[1]].bucket)
            self._remaining[bucket] -= 1
            if self.overlap and self._remaining[bucket] == 0:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._launch_order):
            b, k = self._launch_order[self._next_launch]
            if self._remaining[(b, k)] > 0:
                return
            self._next_launch += 1
            self._launch(b, k)

    def _launch(self, b: int, k: int) -> None:
        buffer = self.buffers[b]
        if buffer.layout.buckets[k].numel == 0:
            return
        what = f"BucketScheduler {self.mode} of buffer {b} ({buffer.dtype}) bucket {k} on rank {self.group.rank}"
        start = self._start_fn(buffer, k)
        if buffer.device.type == "cuda":
            if self._comm_stream is None:
                self._comm_stream = torch.cuda.Stream(buffer.device)
            self._launches.append(StreamLaunch(start, what, self._comm_stream))
        else:
            previous = self._launches[-1] if self._launches else None
            self._launches.append(ThreadLaunch(start, what, lambda: previous.end_s if previous else 0.0))

    def _start_fn(self, buffer: FlatBuffer, k: int) -> StartCollective:
        bucket, op, group = buffer.bucket_view(k), self.op, self.group
        if self.mode == "all_reduce":
            return lambda async_op: all_reduce(bucket, op, group, async_op)
        shard = buffer.shard_view(k, group.rank)
        return lambda async_op: reduce_scatter(shard, bucket, op, group, async_op)

    def finish(self) -> OverlapReport:
        """Waits for every bucket in launch order (launching those that backward
        did not); idempotent; a no-op under no_sync(). Returns the step's report."""
        if not self._sync_enabled or not self._active:
            return self.report
        backward_end_s, backward_end = time.perf_counter(), self._cuda_mark()
        with self._lock:
            unused = [slot for slot in self._registration if slot not in self._marked]
            if unused and not self.find_unused_parameters:
                self._wait_all()
                self._reset_step()
                names = [self._name(slot) for slot in unused]
                raise RuntimeError(f"BucketScheduler.finish: rank {self.group.rank}: {len(unused)} parameters got no "
                                   f"gradient this step: {names[:16]}; pass find_unused_parameters=True to treat "
                                   f"them as zero")
            for b, i in unused:
                self.buffers[b].bind_grad(self.buffers[b].params[i])
                self._remaining[(b, self.buffers[b].layout.params[i].bucket)] -= 1
            self._launch_ready()
            assert self._next_launch == len(self._launch_order), "every bucket is complete at finish()"
            self._wait_all()
            wait_s = time.perf_counter() - backward_end_s
            self._set_report(backward_end_s, backward_end, wait_s)
            self._last_observed = self._observed
            self._reset_step()
        return self.report

    def _wait_all(self) -> None:
        for launch in self._launches:
            launch.wait(self.timeout_s)

    def _cuda_mark(self) -> torch.cuda.Event | None:
        """On CUDA, an event on the compute stream where backward ended."""
        if not self.buffers or self.buffers[0].device.type != "cuda":
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream())
        return end

    def _set_report(self, backward_end_s: float, backward_end: torch.cuda.Event | None, wait_s: float) -> None:
        launches = self._launches
        if backward_end is None:
            self._report = overlap_report([l.interval() for l in launches], backward_end_s, wait_s)  # type: ignore[union-attr]
        elif not launches:
            self._report = OverlapReport(0, 0.0, 0.0, 1.0, wait_s)
        else:  # CUDA: computed when read, so that finish() does not synchronize the host
            self._report = None
            self._lazy_report = lambda: stream_report(launches, launches[0].start_event, backward_end, wait_s)  # type: ignore[union-attr]

    @property
    def report(self) -> OverlapReport:
        """The OverlapReport of the last finished step (on CUDA, reading it synchronizes)."""
        if self._report is None:
            self._report = self._lazy_report()
        return self._report

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside only accumulate into
        the buffers; the first backward after it synchronizes everything."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # -- after a step -----------------------------------------------------------
    def grad_shards(self) -> list[list[torch.Tensor]]:
        """This rank's chunk of every bucket of every buffer: [buffer][bucket]."""
        rank = self.group.rank
        return [[buf.shard_view(k.index, rank) for k in buf.layout.buckets] for buf in self.buffers]

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.zero_grad()

    def observed_order(self) -> list[Slot]:
        """(buffer, param) slots in the order the last synchronized step marked them ready."""
        return list(self._last_observed)

    def _name(self, slot: Slot) -> str:
        b, i = slot
        return self._names.get(slot) or f"buffer {b} param {i} {tuple(self.buffers[b].params[i].shape)}"
