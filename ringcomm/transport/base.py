"""The interface every transport implements."""
from __future__ import annotations

from typing import Protocol

import torch

from ..core.ops import ReduceOp
from .agreement import CallKey


class P2pRequest(Protocol):
    """One send or receive of a PointToPoint, until it ends."""

    source: int  # a receive's sender (group rank) once matched, else -1

    def wait(self, timeout_s: float | None = None) -> None:
        """Until it ended (None: the group's timeout); raises its error."""
        ...

    def is_completed(self) -> bool:
        """Whether it ended, after one round of progress."""
        ...

    def succeeded(self) -> bool:
        """Whether it ended without an error, as far as known now (no progress made)."""
        ...

    def exception(self) -> BaseException | None: ...


class PointToPoint(Protocol):
    """Messages between two ranks of a group: the bytes of a contiguous CPU
    tensor, matched by source and tag, in send order per (src, dst, tag)."""

    timeout_s: float

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> P2pRequest: ...

    def irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> P2pRequest:
        """src None: from any source."""
        ...


class Transport(Protocol):
    """Moves and combines the bytes of one group's collectives.

    Callers (ringcomm.comm.collectives) have already checked the arguments: tensors
    are contiguous (of any shape: a transport reads them as flat), of one
    supported dtype, with consistent numels. What the ranks must agree on they
    compare in each call's agreement step ([Note: call agreement]); `key`, where
    a call takes one, is the caller's own description of the call, compared too.
    """

    kind: str
    rank: int
    world_size: int
    timeout_s: float
    p2p: PointToPoint | None  # None: point-to-point goes over the process group's own send/recv

    def supports(self, tensor: torch.Tensor) -> bool: ...

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Collective: a 1-D tensor its collectives use without staging copies."""
        ...

    def all_reduce(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None: ...

    def reduce_scatter(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None: ...

    def all_gather(self, *, output: torch.Tensor, input: torch.Tensor, key: CallKey | None = None) -> None: ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> None: ...

    def all_to_all(self, *, output: torch.Tensor, input: torch.Tensor, key: CallKey | None = None) -> None:
        """Chunk p of input to rank p, chunk p of output from rank p (equal chunks,
        distinct buffers). A transport of two levels offers agree() and levels()
        instead (HierarchicalTransport)."""
        ...

    def barrier(self) -> None: ...

    def close(self, timeout_s: float | None = None) -> bool:
        """Refuses new calls, waits up to timeout_s (None: the group's timeout) for
        the calls in flight, aborts them past that, then releases what the
        transport holds. Safe from any thread, idempotent. Returns whether the
        calls in flight ended by themselves."""
        ...

    def abort(self) -> None:
        """Makes the calls in flight fail ("aborted") and refuses later ones, then
        releases what the transport holds. Safe from any thread, idempotent."""
        ...
