"""The bucket schedulers' shared machinery (BucketLauncher) and ZeRO's own
(OwnedBucketScheduler; the DDP-style one is flat_scheduler.BucketScheduler):
they reduce the gradients of bucketed parameters while backward is still
running, and report how much of it was hidden.

[Note: bucket launch order]
Ranks must issue the same collectives in the same order. A bucket is launched
when all its parameters are marked ready *and* every bucket before it in the
launch order has been launched; the launch order is fixed for all ranks by the
expected ready order (reverse registration, or rank 0's observed order after
rebuild_buckets), never by the order gradients happen to arrive on this rank.

[Note: writing gradients]
Each gradient is written into its bucket once, from its post-accumulate-grad
hook. With `bind_grads` (flat buffers, DDP-style) `.grad` becomes the bucket's
view: later micro-steps accumulate into it in place and the reduced result is
read through `.grad`. Without it (ZeRO) the hook adds `grad * scale` into the
bucket (overwriting in a fresh accumulation window: no memset) and drops
`.grad`. Sharded buckets (ZeRO stages 2-3) are transient: reduce-scattered
every backward, their chunk folded into a chunk-sized accumulator and freed,
during backward as soon as the reduce-scatter succeeded (CPU), so backward
holds the buckets in flight, not the whole gradient.

[Note: a failed step]
When a bucket's collective fails (or times out, or backward itself raises),
finish() raises that first error once and leaves the scheduler ready for the
next step: it waits for the step's other launches (one timeout_s for all of
them, their errors dropped), then drops the failed step's gradients and the
accumulation window it was in (accumulators and persistent buckets zeroed,
transient buckets freed, every window fresh) and forgets which parameters were
marked. A failed reduction leaves partial sums behind, so nothing of the window
can be kept; the next backward starts a new one. A collective still running
when that timeout passed may write its bucket late: a group whose peer is gone
must be closed or aborted anyway.

Timeline of one step (CPU; on CUDA the comm thread is a comm stream):

    backward: |grads of bucket 0|grads of bucket 1|grads of bucket 2| finish(): wait
    comm:                       |   bucket 0      |   bucket 1      | bucket 2 |
                                                                    ^ backward end: after it, comm is exposed
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from ..comm.work import Work
from .buffer import GradBucket
from .launch import (EMPTY_REPORT, Collectives, OverlapReport, StreamLaunch, ThreadLaunch, overlap_report,
                     stream_report)

MODES = ("reduce_scatter", "all_reduce")


class BucketLauncher:
    """Launches each bucket's collective as soon as its gradients are ready: what
    both schedulers share. Per step: run backward (the hooks call mark_ready),
    then finish(); zero_grad() starts a new accumulation window. BucketScheduler
    (flat_scheduler.py) serves flat buffers, whose `.grad` are views of the
    buffers; OwnedBucketScheduler serves GradBuckets laid out and owned by the
    ZeRO engine.
    """

    def __init__(self, buckets: list[GradBucket], collectives: Collectives, *, mode: str, overlap: bool,
                 bind_grads: bool, find_unused_parameters: bool, timeout_s: float, scale: float = 1.0,
                 on_launch: Callable[[GradBucket], None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"BucketScheduler: mode={mode!r} is not one of {MODES}")
        self.mode, self.collectives, self.overlap = mode, collectives, overlap
        self.bind_grads, self.scale, self.on_launch = bind_grads, scale, on_launch
        self.find_unused_parameters, self.timeout_s = find_unused_parameters, timeout_s
        self.buckets = buckets
        self._params = [p for bucket in buckets for p in bucket.params]  # registration order until register_hooks
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._names: dict[int, str] = {}
        self._lock = threading.Lock()
        self._sync_enabled = True
        self._comm_stream: torch.cuda.Stream | None = None
        self._report: OverlapReport | None = EMPTY_REPORT
        self._lazy_report: Callable[[], OverlapReport] | None = None
        self._last_observed: list[torch.nn.Parameter] = []
        self.transient_nbytes = self.peak_transient_nbytes = 0
        self._index_params()
        self._launch_order = self._plan_launch_order(None)
        self._reset_step()

    def _index_params(self) -> None:
        self._where = {id(p): (k, n) for k, bucket in enumerate(self.buckets) for n, p in enumerate(bucket.params)}

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
            if id(param) not in self._where:
                raise ValueError(f"BucketScheduler.register_hooks: parameter {name or tuple(param.shape)} requires "
                                 f"grad but is in none of the {len(self.buckets)} buckets (rank {self.collectives.rank})")
            registration.append(param)
            self._names[id(param)] = name or f"parameter {tuple(param.shape)} {param.dtype}"
            self._hooks.append(param.register_post_accumulate_grad_hook(self.mark_ready))
        seen = {id(p) for p in registration}
        self._params = registration + [p for p in self._params if id(p) not in seen]
        self._launch_order = self._plan_launch_order(None)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _plan_launch_order(self, observed: Sequence[torch.nn.Parameter] | None) -> list[int]:
        """Buckets sorted by when their last gradient is expected. See [Note: bucket launch order]."""
        expected = list(observed) if observed is not None else self._params[::-1]
        position = {id(p): n for n, p in enumerate(expected)}
        keys = [(max((position.get(id(p), len(position)) for p in bucket.params), default=0), k)
                for k, bucket in enumerate(self.buckets)]
        return [k for _, k in sorted(keys)]

    # -- one step -------------------------------------------------------------
    def _reset_step(self) -> None:
        self._marked: set[int] = set()
        self._observed: list[torch.nn.Parameter] = []
        self._next_launch = 0
        self._launches: list[ThreadLaunch | StreamLaunch] = []
        self._in_flight: list[tuple[ThreadLaunch, GradBucket]] = []  # transient buckets not yet folded
        self._active = False
        for bucket in self.buckets:
            bucket.num_ready = 0

    def mark_ready(self, param: torch.Tensor) -> None:
        """Param's gradient is final for this backward: writes it into its bucket
        and launches every bucket that is now complete, in launch order."""
        where = self._where.get(id(param))
        if where is None:
            raise ValueError(f"BucketScheduler.mark_ready: parameter {tuple(param.shape)} {param.dtype} is in no "
                             f"bucket (rank {self.collectives.rank})")
        bucket = self.buckets[where[0]]
        with self._lock:
            self._take(bucket, where[1], param)
            if not self._sync_enabled:
                return
            if id(param) in self._marked:
                raise RuntimeError(f"BucketScheduler.mark_ready: {self._name(param)} marked ready twice in one step "
                                   f"on rank {self.collectives.rank}: call finish() after each backward (or use no_sync())")
            self._active = True
            self._marked.add(id(param))
            self._observed.append(param)
            bucket.num_ready += 1
            if self.overlap and bucket.num_ready == len(bucket.params):
                self._launch_ready()

    def _take(self, bucket: GradBucket, position: int, param: torch.Tensor) -> None:
        """See [Note: writing gradients]."""
        if self.bind_grads:
            self._bind(bucket, position, param)
            return
        if bucket.grad is None:
            self._reclaim()
            self._track(bucket.nbytes)
        bucket.write(position, param.grad, self.scale)
        param.grad = None

    def _bind(self, bucket: GradBucket, position: int, param: torch.Tensor) -> None:
        span = bucket.spans[position]
        view = bucket.grad[span.begin:span.end].view(param.shape)
        grad = param.grad
        if grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape:
            return
        if grad is not None:
            view.copy_(grad)
        else:
            view.zero_()
        param.grad = view

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._launch_order):
            bucket = self.buckets[self._launch_order[self._next_launch]]
            if bucket.num_ready < len(bucket.params):
                return
            self._next_launch += 1
            self._launch(bucket)

    def _launch(self, bucket: GradBucket) -> None:
        if bucket.span.numel == 0:
            return
        if not self.bind_grads:
            bucket.fill_unwritten()
        what = f"BucketScheduler {self.mode} of bucket {bucket.index} ({bucket.dtype}) on rank {self.collectives.rank}"
        grad, comm = bucket.ensure(), self.collectives
        if self.mode == "all_reduce":
            def start(async_op: bool) -> Work:
                return comm.all_reduce(grad, async_op)
        else:
            direct = bucket.accumulator is not None and bucket.accumulator_fresh  # straight into the accumulator
            output = bucket.accumulator if direct else bucket.own_chunk()

            def start(async_op: bool) -> Work:
                return comm.reduce_scatter(output, grad, async_op)
        if bucket.device.type == "cuda":
            if self._comm_stream is None:
                self._comm_stream = torch.cuda.Stream(bucket.device)
            self._launches.append(StreamLaunch(start, what, self._comm_stream))
        else:
            previous = self._launches[-1] if self._launches else None
            self._launches.append(ThreadLaunch(start, what, lambda: previous.end_s if previous else 0.0))
            if bucket.accumulator is not None:
                self._in_flight.append((self._launches[-1], bucket))
        if self.on_launch is not None:
            self.on_launch(bucket)

    def finish(self) -> OverlapReport:
        """After each backward: waits for every bucket in launch order (launching
        those that backward did not) and folds sharded buckets into their
        accumulators; idempotent. Under no_sync() it only closes the micro-step.
        Returns the step's report."""
        if not self._sync_enabled:
            self._close_unsynced_backward()
            return self.report
        if not self._active:
            return self.report
        backward_end_s, backward_end = time.perf_counter(), self._cuda_mark()
        with self._lock:
            try:
                self._count_unused()
                self._launch_ready()
                assert self._next_launch == len(self._launch_order), "every bucket is complete at finish()"
                self._wait_all()
            except BaseException:
                self._discard_step()
                raise
            wait_s = time.perf_counter() - backward_end_s
            self._set_report(backward_end_s, backward_end, wait_s)
            self._fold()
            self._last_observed = self._observed
            self._reset_step()
        return self.report

    def discard_step(self) -> None:
        """Abandons the step in progress (its backward raised): see [Note: a failed step]."""
        with self._lock:
            self._discard_step()

    def _discard_step(self) -> None:
        """See [Note: a failed step]."""
        deadline = time.monotonic() + self.timeout_s
        for launch in self._launches:
            try:
                launch.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 (the caller raises the step's first error)
                pass
        for bucket in self.buckets:
            if bucket.accumulator is not None:
                bucket.accumulator.zero_()
                if bucket.grad is not None:
                    self._track(-bucket.nbytes)
                    bucket.release()
            elif bucket.grad is not None:
                bucket.grad.zero_()
            bucket.fresh = bucket.accumulator_fresh = True
            bucket.written.clear()
        self._reset_step()

    def _count_unused(self) -> None:
        unused = [p for p in self._params if id(p) not in self._marked]
        if unused and not self.find_unused_parameters:
            names = [self._name(p) for p in unused]
            raise RuntimeError(f"BucketScheduler.finish: rank {self.collectives.rank}: {len(unused)} parameters got no "
                               f"gradient this step: {names[:16]}; pass find_unused_parameters=True to treat them as zero")
        for param in unused:
            k, position = self._where[id(param)]
            if self.bind_grads:
                self._bind(self.buckets[k], position, param)
            self.buckets[k].num_ready += 1

    def _fold(self) -> None:
        for bucket in self.buckets:
            self._fold_bucket(bucket)
            bucket.fresh = False
            bucket.written.clear()

    def _fold_bucket(self, bucket: GradBucket) -> None:
        """A sharded bucket: adds the reduced chunk to the accumulator (unless it
        was reduced straight into it) and frees the transient bucket."""
        if bucket.accumulator is not None and bucket.grad is not None:
            if not bucket.accumulator_fresh:
                bucket.accumulator.add_(bucket.own_chunk())
            bucket.accumulator_fresh = False
            self._track(-bucket.nbytes)
            bucket.release()

    def _reclaim(self) -> None:
        """Folds and frees, during backward, the transient buckets whose
        reduce-scatter has already succeeded, so backward holds the buckets in
        flight rather than the whole gradient (CPU launches; a failed one is
        left for finish() to raise)."""
        pending = []
        for launch, bucket in self._in_flight:
            if launch.succeeded():
                self._fold_bucket(bucket)
            else:
                pending.append((launch, bucket))
        self._in_flight = pending

    def _close_unsynced_backward(self) -> None:
        """End of a backward under no_sync(): written gradients stay in their
        buckets; slices no gradient reached in a fresh window become zeros."""
        with self._lock:
            for bucket in self.buckets:
                if not self.bind_grads and bucket.written:
                    bucket.fill_unwritten()
                bucket.fresh = bucket.fresh and not bucket.written
                bucket.written.clear()

    def _wait_all(self) -> None:
        for launch in self._launches:
            launch.wait(self.timeout_s)

    def _track(self, nbytes: int) -> None:
        self.transient_nbytes += nbytes
        self.peak_transient_nbytes = max(self.peak_transient_nbytes, self.transient_nbytes)

    def _cuda_mark(self) -> torch.cuda.Event | None:
        """On CUDA, an event on the compute stream where backward ended."""
        if not self.buckets or self.buckets[0].device.type != "cuda":
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream())
        return end

    def _set_report(self, backward_end_s: float, backward_end: torch.cuda.Event | None, wait_s: float) -> None:
        launches = self._launches
        overlapped = sum(launch.launched_s < backward_end_s for launch in launches)
        if backward_end is None:
            intervals = [launch.interval() for launch in launches]  # type: ignore[union-attr]
            self._report = overlap_report(intervals, backward_end_s, wait_s, overlapped)
        elif not launches:
            self._report = OverlapReport(0, 0.0, 0.0, 1.0, wait_s, 0)
        else:  # CUDA: computed when read, so that finish() does not synchronize the host
            self._report = None
            self._lazy_report = lambda: stream_report(launches, launches[0].start_event, backward_end,  # type: ignore[union-attr]
                                                      wait_s, overlapped)

    @property
    def report(self) -> OverlapReport:
        """The OverlapReport of the last finished step (on CUDA, reading it synchronizes)."""
        if self._report is None:
            self._report = self._lazy_report()
        return self._report

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside only accumulate into
        the buckets; the first backward after it synchronizes everything."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # -- after a step -----------------------------------------------------------
    def zero_grad(self) -> None:
        """Starts a new accumulation window: the next writes overwrite, no memset."""
        for bucket in self.buckets:
            bucket.fresh = bucket.accumulator_fresh = True

    def _name(self, param: torch.Tensor) -> str:
        return self._names.get(id(param)) or f"parameter {tuple(param.shape)} {param.dtype}"


class OwnedBucketScheduler(BucketLauncher):
    """Buckets whose owner keeps their parameters' values (ZeRO): gradients are
    added times `scale` into the buckets and `.grad` is dropped; parameters
    without a gradient count as zero; `on_launch(bucket)` runs right after each
    bucket's collective started."""

    def __init__(self, buckets: Sequence[GradBucket], collectives: Collectives, *, mode: str, scale: float,
                 timeout_s: float, on_launch: Callable[[GradBucket], None] | None = None) -> None:
        super().__init__(list(buckets), collectives, mode=mode, overlap=True, bind_grads=False, scale=scale,
                         find_unused_parameters=True, timeout_s=timeout_s, on_launch=on_launch)
