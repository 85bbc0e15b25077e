"""Point-to-point calls of the "ringcomm" backend (send, recv, recv_anysource;
torch's isend, irecv and batch_isend_irecv are made of them): on the transport's
channels where it has them (shm), else on the backend's internal gloo group,
both with the group's timeout, errors that name the call, and profiler events
`ringcomm:send`, `ringcomm:recv`, `ringcomm:recvAnySource`."""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm.work import completed_future
from ..observe import profiling
from ..transport.base import P2pRequest, PointToPoint
from .work import DelegatingWork, finished_work

SEND, RECV, RECV_ANYSOURCE = "send", "recv", "recv_anysource"


def takes(tensor: torch.Tensor) -> bool:
    """Whether the backend's point-to-point carries `tensor` itself: a dense CPU
    tensor of any dtype (the channels move bytes; strided ones go through a
    contiguous copy). CUDA and sparse tensors are forwarded to NCCL / gloo."""
    return tensor.layout is torch.strided and tensor.is_cpu


def start(p2p: PointToPoint, op: str, tensors: list[torch.Tensor], peer: int | None, tag: int, *,
          rank: int, world_size: int) -> dist.Work:
    """Posts `op` (SEND to `peer`, RECV from `peer`, RECV_ANYSOURCE) of tensors[0]
    on `p2p`; returns its Work. A send that ended when posted returns a finished
    Work, as does a receive from a named peer whose message had arrived."""
    if len(tensors) != 1:
        raise ValueError(f"{op}: rank {rank} got {len(tensors)} tensors; point-to-point takes exactly one")
    tensor = tensors[0]
    buffer = tensor if tensor.is_contiguous() else (tensor.contiguous() if op == SEND else torch.empty_like(
        tensor, memory_format=torch.contiguous_format))
    request = p2p.isend(buffer, peer, tag) if op == SEND else p2p.irecv(buffer, peer, tag)
    finish = None if buffer is tensor or op == SEND else (lambda: tensor.copy_(buffer))
    if profiling.active():
        event = profiling.Event("recvAnySource" if op == RECV_ANYSOURCE else op, [tensor], seq=0,
                                 group_size=world_size)
        return p2p_work(Watched(request, event), tensors, finish)
    if op != RECV_ANYSOURCE and request.succeeded():
        if finish is not None:
            finish()
        return finished_work(tensors)
    return p2p_work(request, tensors, finish)


def p2p_work(request: P2pRequest, value: list[torch.Tensor], finish: Callable[[], object] | None) -> P2pWork:
    """A P2pWork, its fields set after construction (see [Note: finished works]:
    a Python __init__ that calls dist.Work's costs ~0.5 us more per call)."""
    work = P2pWork()
    work._inner, work._value, work._finish = request, value, finish
    return work


class P2pWork(DelegatingWork):
    """The torch Work of one send or receive (made by p2p_work): wait() makes
    progress until it ended (raising its error), _source_rank() names a
    receive's sender."""

    _inner: P2pRequest
    _value: list[torch.Tensor]
    _finish: Callable[[], object] | None = None  # copies a strided receive's contiguous buffer back
    _future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """A zero or absent timeout waits as long as the group's timeout allows."""
        self._inner.wait(timeout.total_seconds() if timeout else None)
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return True

    def _source_rank(self) -> int:
        return self._inner.source

    def get_future(self) -> torch.futures.Future:
        """Completed with the tensors once the call ended (a thread waits for it)."""
        if self._future is None:
            self._future = completed_future(self._value) if self._finish is None and self.is_completed() \
                and self.exception() is None else self._waited_future()
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._value

    def synchronize(self) -> None:
        self.wait()

    def _waited_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()

        def wait() -> None:
            try:
                self.wait()
            except Exception as err:  # noqa: BLE001  (handed to the future)
                future.set_exception(err)
            else:
                future.set_result(self._value)

        threading.Thread(target=wait, name="ringcomm-p2p-future", daemon=True).start()
        return future.then(_value_or_raise)


def _value_or_raise(done: torch.futures.Future) -> object:
    """See [Note: torch futures] in work.py: a `then` that raises fails for C++ readers too."""
    return done.value()


class Watched:
    """A request that a thread of its own waits for, ending its profiler event
    there: torch marks an event that ends on another thread async, as it marks
    gloo's (see [Note: profiler events]). Only while a profiler records."""

    def __init__(self, request: P2pRequest, event: profiling.Event) -> None:
        self._request = request
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, args=(event,), name="ringcomm-p2p-profiled", daemon=True)
        self._thread.start()

    def _watch(self, event: profiling.Event) -> None:
        try:
            self._request.wait()
        except BaseException as err:  # noqa: BLE001  (re-raised by wait)
            self._error = err
        finally:
            event.end()

    def wait(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"point-to-point: Work.wait timed out after {timeout_s} s")
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def succeeded(self) -> bool:
        return not self._thread.is_alive() and self._error is None

    def exception(self) -> BaseException | None:
        return None if self._thread.is_alive() else self._error

    @property
    def source(self) -> int:
        return self._request.source


class ForwardedPointToPoint:
    """PointToPoint over a process group's send and recv (the backend's internal
    gloo group): how point-to-point crosses hosts, with ringcomm's timeout,
    error naming and profiler events around it."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, timeout_s: float) -> None:
        self._pg = pg
        self.rank = rank
        self.timeout_s = timeout_s

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> ForwardedRequest:
        what = f"send: rank {self.rank} (tag {tag}, {tensor.nbytes} bytes to rank {dst})"
        return ForwardedRequest(self._pg.send([tensor], dst, tag), what, dst, self.timeout_s)

    def irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> ForwardedRequest:
        if src is None:
            what = f"recv_anysource: rank {self.rank} (tag {tag}, {tensor.nbytes} bytes from any rank)"
            return ForwardedRequest(self._pg.recv_anysource([tensor], tag), what, -1, self.timeout_s)
        what = f"recv: rank {self.rank} (tag {tag}, {tensor.nbytes} bytes from rank {src})"
        return ForwardedRequest(self._pg.recv([tensor], src, tag), what, src, self.timeout_s)


class ForwardedRequest:
    """A Work of the internal gloo group, waited for with the group's timeout."""

    def __init__(self, work: dist.Work, what: str, peer: int, timeout_s: float) -> None:
        self._work, self._what, self._peer, self._timeout_s = work, what, peer, timeout_s
        self._error: BaseException | None = None
        self._done = False

    def wait(self, timeout_s: float | None = None) -> None:
        if self._error is None and not self._done:
            timeout_s = self._timeout_s if timeout_s is None else timeout_s
            try:
                self._work.wait(timedelta(seconds=timeout_s))
                self._done = True
            except Exception as err:  # gloo raises RuntimeError or DistBackendError
                self._error = RuntimeError(f"{self._what} (forwarded to gloo) failed or timed out after {timeout_s} "
                                           f"s: {err}")
                self._error.__cause__ = err
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        if not self._done and self._error is None and self._work.is_completed():
            try:
                self.wait()  # gloo's Work says completed when it failed too: find out which
            except RuntimeError:
                pass
        return self._done or self._error is not None

    def succeeded(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    @property
    def source(self) -> int:
        return self._work._source_rank() if self._peer < 0 and self._done else self._peer
