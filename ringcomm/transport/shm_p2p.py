"""Point-to-point messages over the shared-memory transport: the Python face of
the channels in csrc/cpu/shm_p2p*.cpp ([Note: p2p channels])."""
from __future__ import annotations

from collections import deque

import torch

from .. import _C


class ShmRequest:
    """One send or receive on the channels."""

    __slots__ = ("_comm", "_request", "_timeout_s")

    def __init__(self, comm: _C.ShmComm, request: _C.P2pRequest, timeout_s: float) -> None:
        self._comm = comm
        self._request = request
        self._timeout_s = timeout_s

    def wait(self, timeout_s: float | None = None) -> None:
        """Makes progress until it ends (None: the group's timeout); raises its
        error: ValueError for sizes that differ, RuntimeError for a failure."""
        self._comm.p2p_wait(self._request, self._timeout_s if timeout_s is None else timeout_s)

    def is_completed(self) -> bool:
        """Whether it ended (one round of progress first, as MPI_Test); never
        raises: a closed group's pending request stays pending (wait says why)."""
        if self._request.done:
            return True
        try:
            return self._comm.p2p_test(self._request)
        except RuntimeError:
            return False

    def succeeded(self) -> bool:
        """Whether it ended without an error (no progress made to find out)."""
        return self._request.succeeded

    def exception(self) -> BaseException | None:
        if not self._request.done or not self._request.error:
            return None
        return (ValueError if self._request.caller_error else RuntimeError)(self._request.error)

    @property
    def source(self) -> int:
        """A receive's sender (group rank), once matched; -1 before."""
        return self._request.source


class ShmPointToPoint:
    """Sends and receives between the ranks of a shared-memory group: any bytes
    (the caller passes contiguous CPU tensors), matched by source and tag in send
    order; an eager send that fits the channel ends when posted.

    The channels hold raw pointers: each request that did not end when posted
    keeps its tensor here until it ends, so a caller that drops its Work (an
    isend never waited for) cannot free memory that a peer still reads or that
    a message is still written into."""

    def __init__(self, comm: _C.ShmComm, timeout_s: float) -> None:
        self._comm = comm
        self.timeout_s = timeout_s
        self._pending: deque[tuple[_C.P2pRequest, torch.Tensor]] = deque()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> ShmRequest:
        return self._keep(self._comm.p2p_isend(tensor.data_ptr(), tensor.nbytes, dst, tag), tensor)

    def irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> ShmRequest:
        """src None: from any source (ShmRequest.source says which)."""
        return self._keep(self._comm.p2p_irecv(tensor.data_ptr(), tensor.nbytes, -1 if src is None else src, tag),
                          tensor)

    def _keep(self, request: _C.P2pRequest, tensor: torch.Tensor) -> ShmRequest:
        pending = self._pending
        if pending:
            try:
                while pending[0][0].done:  # mostly in order: the oldest end first
                    pending.popleft()
            except IndexError:  # emptied (by another thread posting too)
                pass
        if not request.done:
            pending.append((request, tensor))
        return ShmRequest(self._comm, request, self.timeout_s)
