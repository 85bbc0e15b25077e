"""Launching one bucket's collective without blocking backward, and timing it:
on CPU as an async work on the group's comm thread, on CUDA on a comm stream
ordered after the compute stream by events. Also the OverlapReport arithmetic."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from ..comm.work import Work


class Collectives(Protocol):
    """The two collectives the scheduler launches (a ringcomm group, or zero's
    comm seam over torch.distributed). Handles have wait() and get_future()."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Work: ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work: ...


# start(async_op) calls the collective; with async_op=True it returns its Work.
StartCollective = Callable[[bool], Work | None]


class OverlapReport(NamedTuple):
    """One step of gradient sync. comm_s: time the bucket collectives ran;
    exposed_s: the part of it after backward ended (finish() was called);
    hidden_fraction: 1 - exposed_s / comm_s (1.0 when there was no comm);
    wait_s: wall time finish() spent waiting; num_overlapped: buckets launched
    before backward ended (from gradient hooks)."""

    num_buckets: int
    comm_s: float
    exposed_s: float
    hidden_fraction: float
    wait_s: float
    num_overlapped: int = 0


EMPTY_REPORT = OverlapReport(0, 0.0, 0.0, 1.0, 0.0)


def overlap_report(intervals: Sequence[tuple[float, float]], backward_end_s: float, wait_s: float,
                   num_overlapped: int = 0) -> OverlapReport:
    """From each bucket's (start, end) times, in one clock with backward_end_s."""
    comm_s = sum(end - start for start, end in intervals)
    exposed_s = sum(max(0.0, end - max(start, backward_end_s)) for start, end in intervals)
    hidden = 1.0 - exposed_s / comm_s if comm_s > 0 else 1.0
    return OverlapReport(len(intervals), comm_s, exposed_s, hidden, wait_s, num_overlapped)


class ThreadLaunch:
    """A collective running on the group's comm thread (CPU tensors).

    The comm thread runs a group's works one at a time in launch order, so a
    bucket starts when it was launched or when the one before it ended,
    whichever is later; it ends when its Work completes (timed by a callback
    on the comm thread). Other works queued on the group in between are
    counted in the next bucket's time. A torch.distributed Work without a
    future (gloo's reduce_scatter_tensor has none) is timed when wait() returns."""

    def __init__(self, start: StartCollective, what: str, previous_end: Callable[[], float]) -> None:
        self.what = what
        self.launched_s = time.perf_counter()
        self._previous_end = previous_end
        self._done = threading.Event()
        self._ok = False
        self.end_s = 0.0
        self.work = start(True)
        assert self.work is not None, "an async collective returns a Work"
        self._timed_by_callback = True
        if isinstance(self.work, Work):
            work = self.work
            work.add_done_callback(lambda: self._on_done(work.exception() is None))
        else:  # a torch.distributed Work
            try:
                self.work.get_future().add_done_callback(lambda future: self._on_done(_succeeded(future)))
            except RuntimeError:  # "Work::getFuture not implemented"
                self._timed_by_callback = False

    def _on_done(self, ok: bool) -> None:
        self._ok = ok
        self.end_s = time.perf_counter()
        self._done.set()

    def succeeded(self) -> bool:
        """True once the collective has completed without error; never blocks
        and never raises (a failure is raised by wait())."""
        return self._done.is_set() and self._ok

    def wait(self, timeout: float) -> None:
        """Waits at most `timeout` s (the collective's own timeout may fire
        first), then re-raises the collective's error."""
        if self._timed_by_callback and not self._done.wait(timeout):
            raise RuntimeError(f"{self.what}: not finished within {timeout} s")
        self.work.wait()
        if not self._timed_by_callback and not self._done.is_set():
            self._on_done(True)

    def interval(self) -> tuple[float, float]:
        return max(self.launched_s, self._previous_end()), self.end_s


def _succeeded(future: torch.futures.Future) -> bool:
    try:
        future.value()
    except Exception:  # noqa: BLE001 (the error itself is raised by wait())
        return False
    return True


class StreamLaunch:
    """A collective enqueued on `comm_stream` after everything the compute
    stream has queued so far (the gradients of this bucket):

        compute: ..grad k..|ready|..grad k+1..            |wait(done)| optimizer
        comm:               wait(ready)|start| collective |done|
    """

    def __init__(self, start: StartCollective, what: str, comm_stream: torch.cuda.Stream) -> None:
        self.what = what
        self.launched_s = time.perf_counter()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        comm_stream.wait_event(ready)
        self.start_event = torch.cuda.Event(enable_timing=True)
        self.done_event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(comm_stream):
            self.start_event.record(comm_stream)
            start(False)
            self.done_event.record(comm_stream)

    def wait(self, timeout: float) -> None:
        """Orders the compute stream after the collective (does not block the host)."""
        torch.cuda.current_stream().wait_event(self.done_event)

    def interval_after(self, reference: torch.cuda.Event) -> tuple[float, float]:
        """(start, end) in seconds after `reference`; synchronizes on the collective."""
        self.done_event.synchronize()
        return reference.elapsed_time(self.start_event) / 1e3, reference.elapsed_time(self.done_event) / 1e3


def stream_report(launches: Sequence[StreamLaunch], reference: torch.cuda.Event, backward_end: torch.cuda.Event,
                  wait_s: float, num_overlapped: int) -> OverlapReport:
    """The OverlapReport of CUDA launches, all timed against `reference`."""
    backward_end.synchronize()
    intervals = [launch.interval_after(reference) for launch in launches]
    return overlap_report(intervals, reference.elapsed_time(backward_end) / 1e3, wait_s, num_overlapped)
