"""torch.distributed Work objects for the "ringcomm" backend: torch Works built
from futures, and the checks that decide which calls ringcomm accelerates."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm.work import Work, completed_future
from ..core.host import usable_cores
from ..core.ops import DTYPE_CODES, DTYPE_CODES_BY_ID, TORCH_OPS, ReduceOp

_TORCH_SUM, _SUM = TORCH_OPS[0]  # torch's SUM and ringcomm's: most calls' op (accelerated_redop)
_OTHER_OPS = TORCH_OPS[1:]

# [Note: finished works]
# A call that finished inline (every sync call, and async ones where
# [Note: async calls] says inline) returns a FinishedWork: no torch Future is
# made unless someone asks for one (dist.* with async_op=False waits and drops
# the Work; DDP and FSDP call get_future(), which then makes a completed one
# carrying the output tensors). A FinishedWork is made by finished_work(), which
# sets its value after construction: a Python __init__ calling dist.Work's
# pybind one costs ~0.5 us more per call. Measured per piece (one rank, 2-vCPU
# machine under load, best of runs; benchmarks/call_overhead.py --world-size 1):
# a finished Work 0.7 us (2.9 with its Future made at once), accelerated_redop
# 0.8 us (reading opts.reduceOp copies the C++ ReduceOp; compare it, never hash
# it: hashing its RedOpType costs ~1.5 us), takes() 0.6 us, Group.run 0.9 us.
# allreduce, all_gather_single and reduce_scatter_single run through
# ringcomm.comm.collectives' lean path ([Note: lean path]), whose checks are C++:
# ~0.1 us a tensor where torch reads it through DLPack (module_lean.cpp).

# [Note: reused finished works]
# Even set after construction, a FinishedWork costs ~1 us (dist.Work's pybind
# constructor), a quarter of a whole 8-byte dist.all_reduce's cost. A process
# group's inline calls therefore take theirs from a FinishedWorks, which hands
# out its last Work again, with the new value, when nothing else references it:
# a Work is observed only through its Python object (Python callers hold it;
# C++ holders such as a future's callback, DDP's reducer or the work registry of
# functional collectives keep that object alive, adding a reference), so a Work
# referenced by nobody else cannot be observed again. dist.* with async_op=False
# drops the Work once it waited, and the next call reuses it; one that is still
# held is left to its holders and a new one made.


class FinishedWork(dist.Work):
    """The torch Work of a call that already finished, successfully (a failed
    inline call raised before returning one). Its future is made on demand."""

    _value: object = None
    _future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = completed_future(self._value)
        return self._future

    def result(self) -> object:
        return self._value

    def synchronize(self) -> None:
        pass


def finished_work(value: object) -> FinishedWork:
    """A FinishedWork whose future carries `value` (see [Note: finished works])."""
    work = FinishedWork()
    work._value = value
    return work


class FinishedWorks:
    """FinishedWorks for one process group's inline calls, reused when no one
    else references them ([Note: reused finished works])."""

    def __init__(self) -> None:
        self._spare = FinishedWork()
        work = self._spare
        # The count of an unheld spare, read as __call__ reads it (self._spare, `work`,
        # and getrefcount's argument where the interpreter counts it: 3.14 may not).
        self._unheld = sys.getrefcount(work)

    def __call__(self, value: object) -> FinishedWork:
        """A FinishedWork whose future carries `value`. Safe between threads: a
        thread that holds the spare in its `work` adds a reference, so another
        one that reads it meanwhile sees it held and makes a new one."""
        work = self._spare
        if sys.getrefcount(work) > self._unheld:  # someone else holds it
            work = self._spare = FinishedWork()
        work._value = value
        if work._future is not None:
            work._future = None
        return work


class DelegatingWork(dist.Work):
    """A torch Work whose state is that of `_inner` (a ringcomm Work, or a
    point-to-point request): is_completed, is_success and exception ask it."""

    _inner: Work

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self.exception() is None

    def exception(self) -> BaseException | None:
        return self._inner.exception()


class BackendWork(DelegatingWork):
    """The torch Work of one backend call running on the comm thread. wait()
    re-raises the call's error, is_success()/exception() report it, and the
    future fails with it (torch's `_create_work_from_future` Works do none of
    that for a Python future: see [Note: torch futures]). The future is made on
    the first get_future()."""

    def __init__(self, work: Work, value: object) -> None:
        super().__init__()
        self._inner = work
        self._value = value
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Blocks until the call finished; raises its error. A zero or absent
        timeout waits as long as the group's own timeout allows."""
        self._inner.wait(timeout.total_seconds() if timeout else None)
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = self._inner.get_future(self._value)
        return self._future

    def result(self) -> object:
        self.wait()
        return self._value

    def synchronize(self) -> None:
        self.wait()


def backend_work(work: Work | None, value: object) -> dist.Work:
    """The torch Work for what Group.run returned: None (finished inline) or a
    ringcomm Work on the comm thread."""
    return finished_work(value) if work is None else BackendWork(work, value)


class JoinedWork(dist.Work):
    """One torch Work over several Works of a forwarded backend (a coalesced
    call split per tensor): done when all are, failed when any failed. Its
    future joins the parts' futures; a part without one (gloo's reduce-scatter
    Works raise "Work::getFuture not implemented") is waited for when the
    future is first asked for, which then comes back completed. Such parts
    also never report is_completed(), so a finished wait() is remembered."""

    def __init__(self, works: Sequence[dist.Work], value: list[torch.Tensor]) -> None:
        super().__init__()
        self._works = list(works)
        self._value = value
        self._future: torch.futures.Future | None = None
        self._waited = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for every part; raises the first failure."""
        for work in self._works:
            if timeout:
                work.wait(timeout)
            else:
                work.wait()
        self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited or all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> BaseException | None:
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = self._join_futures()
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._value

    def synchronize(self) -> None:
        self.wait()

    def _join_futures(self) -> torch.futures.Future:
        try:
            parts = [w.get_future() for w in self._works]
        except RuntimeError as err:
            if "not implemented" not in str(err):
                raise
            return self._waited_future()
        value = self._value

        def values(done: torch.futures.Future) -> list[torch.Tensor]:
            for future in done.value():
                future.value()  # re-raises a failed call's error
            return value

        return torch.futures.collect_all(parts).then(values)

    def _waited_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        try:
            self.wait()
        except RuntimeError as err:  # gloo's DistBackendError is one
            future.set_exception(err)
        else:
            future.set_result(self._value)
        return future


def wait_forwarded(work: dist.Work, op: str, rank: int, timeout_s: float) -> None:
    """Waits for a Work of the internal gloo group, naming the call if it fails."""
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as err:  # gloo raises RuntimeError or DistBackendError
        raise RuntimeError(f"{op} (forwarded to gloo): rank {rank} failed or timed out after {timeout_s} s: "
                           f"{err}") from err


def accelerated_redop(opts: object) -> ReduceOp | None:
    """ringcomm's op for `opts.reduceOp`, or None when ringcomm does not do it
    (PREMUL_SUM, BAND, ...): such calls are forwarded. Compares, as hashing
    torch's op is slow (see [Note: finished works]), SUM first and alone: it is
    most calls' op, and each further comparison costs ~0.1 us. Options without a
    reduceOp mean torch's default, SUM."""
    try:
        torch_op = opts.reduceOp
    except AttributeError:
        return _SUM
    if torch_op == _TORCH_SUM:
        return _SUM
    for torch_type, ours in _OTHER_OPS:
        if torch_op == torch_type:
            return ours
    return None


def takes(tensor: torch.Tensor, supports: Callable[[torch.Tensor], bool]) -> bool:
    """The lean path's check of one tensor: dense, on the CPU, of a ringcomm dtype,
    contiguous, and taken by the transport (`supports`). Tens of ns per test."""
    return (tensor.layout is torch.strided and tensor.is_cpu and id(tensor.dtype) in DTYPE_CODES_BY_ID
            and tensor.is_contiguous() and supports(tensor))


def on_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.device.type == "cuda" for t in tensors)


def accelerates(tensors: Sequence[torch.Tensor], supports, *, strided: bool = False) -> bool:
    """True when ringcomm's transport takes every tensor: on a device the transport
    handles (CPU for shm), of one supported dtype, contiguous (strided: in-place
    calls copy strided tensors through a contiguous buffer)."""
    if not tensors:
        return False
    dtype = tensors[0].dtype
    return all(t.dtype == dtype and t.dtype in DTYPE_CODES and (strided or t.is_contiguous()) and t.device.type == "cpu"
               and supports(t) for t in tensors)


def is_async(opts: object) -> bool:
    """Calls from C++ (DDP's reducer, functional collectives) come with the
    default options, asyncOp=True; dist.* sets it from async_op."""
    return bool(getattr(opts, "asyncOp", True))


ASYNC_MODES = ("auto", "thread", "inline")


def use_comm_thread(transport_kind: str, world_size: int) -> bool:
    """Whether async calls run on the group's comm thread (overlapping the caller's
    compute) or inline, finished before they return. See [Note: async calls]."""
    mode = os.environ.get("RINGCOMM_ASYNC", "auto")
    if mode not in ASYNC_MODES:
        raise ValueError(f"ringcomm backend: RINGCOMM_ASYNC={mode!r} is not one of {ASYNC_MODES}")
    if mode != "auto":
        return mode == "thread"
    local_ranks = world_size if transport_kind == "shm" else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = usable_cores()
    return cores >= 2 * local_ranks
