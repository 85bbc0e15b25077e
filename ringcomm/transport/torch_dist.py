"""Ring over any torch.distributed process group (gloo on CPU, NCCL on CUDA):
how ringcomm spans hosts. Point-to-point transfers use the group's own
send/recv; the ring itself is ringcomm.ring walking ringcomm.schedule."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import ring, schedule
from ..ops import LOW_PRECISION, ReduceOp, dtype_code

_KINDS = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4, "barrier": 0}


@dataclass(frozen=True, slots=True)
class TorchDistOptions:
    segment_nbytes: int = 4 << 20
    check_calls: bool = True  # compare op, dtype and sizes across ranks before each collective


class _PendingTransfer:
    def __init__(self, link: _P2PLink, send_work, recv_work, op: str, step: int) -> None:
        self._link, self._send, self._recv, self._op, self._step = link, send_work, recv_work, op, step

    def wait_send(self) -> None:
        if self._send is not None:
            self._link.wait(self._send, self._op, self._step, f"sending to rank {self._link.right}")

    def wait_recv(self) -> None:
        if self._recv is not None:
            self._link.wait(self._recv, self._op, self._step, f"receiving from rank {self._link.left}")


class _P2PLink:
    """ring.Link over a process group's send/recv (group-local ranks)."""

    def __init__(self, pg: dist.ProcessGroup, timeout_s: float) -> None:
        self.pg = pg
        self.rank, self.world_size = pg.rank(), pg.size()
        self.left = schedule.left(self.rank, self.world_size)
        self.right = schedule.right(self.rank, self.world_size)
        self.timeout = timedelta(seconds=timeout_s)

    def start(self, send: torch.Tensor | None, recv: torch.Tensor | None, *, op: str, step: int) -> _PendingTransfer:
        tag = step
        recv_work = self.pg.recv([recv], self.left, tag) if recv is not None else None
        send_work = self.pg.send([send], self.right, tag) if send is not None else None
        return _PendingTransfer(self, send_work, recv_work, op, step)

    def wait(self, work: dist.Work, op: str, step: int, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as err:  # gloo/NCCL raise RuntimeError or DistBackendError
            raise RuntimeError(
                f"{op}: rank {self.rank} at step {step}/{self.world_size - 1} failed {what} "
                f"(timeout {self.timeout.total_seconds()} s): {err}"
            ) from err


class TorchDistTransport:
    kind = "torch_dist"

    def __init__(self, pg: dist.ProcessGroup, timeout_s: float, options: TorchDistOptions) -> None:
        self.pg = pg
        self.rank, self.world_size = pg.rank(), pg.size()
        self.timeout_s = timeout_s
        self.options = options
        self._link = _P2PLink(pg, timeout_s)

    def supports(self, device: torch.device) -> bool:
        return True

    def _segment_numel(self, tensor: torch.Tensor) -> int:
        return max(1, self.options.segment_nbytes // tensor.element_size())

    def _check_call(self, op: str, tensor: torch.Tensor | None, numel: int, *, redop: int = -1, root: int = -1,
                    always: bool = False) -> None:
        """All ranks must call the same op on the same dtype and sizes; a mismatch
        would otherwise pair unequal messages. Costs one small all-gather."""
        if self.world_size == 1 or not (always or self.options.check_calls):
            return
        dtype = dtype_code(tensor.dtype, where=op) if tensor is not None else -1
        mine = torch.tensor([_KINDS[op], dtype, redop, root, numel], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._link.wait(self.pg.allgather([everyone], [mine]), op, 0, "checking the call across ranks")
        bad = [r for r, theirs in enumerate(everyone) if not torch.equal(theirs, mine)]
        if bad:
            calls = {r: everyone[r].tolist() for r in range(self.world_size)}
            raise ValueError(
                f"{op}: ranks disagree on the call (kind, dtype, op, root, numel): rank {self.rank} has "
                f"{mine.tolist()}, ranks {bad} differ; all calls: {calls}"
            )

    def all_reduce(self, input: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> None:
        self._check_call("all_reduce", input, input.numel(), redop=int(op))
        chunks = schedule.chunk_bounds(input.numel(), self.world_size)
        own = chunks[self.rank]
        if input.dtype in LOW_PRECISION:  # accumulate in float32, round once
            work = input.to(torch.float32)
            ring.reduce_scatter(self._link, work, chunks, op, self._segment_numel(work))
            output[own.begin:own.end].copy_(work[own.begin:own.end])
        else:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            ring.reduce_scatter(self._link, output, chunks, op, self._segment_numel(output))
        ring.all_gather(self._link, output, chunks, self._segment_numel(output))

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> None:
        self._check_call("reduce_scatter", input, output.numel(), redop=int(op))
        chunks = schedule.equal_chunks(output.numel(), self.world_size)
        own = chunks[self.rank]
        work = input.to(torch.float32 if input.dtype in LOW_PRECISION else input.dtype, copy=True)
        ring.reduce_scatter(self._link, work, chunks, op, self._segment_numel(work))
        output.copy_(work[own.begin:own.end])

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> None:
        self._check_call("all_gather", input, input.numel())
        chunks = schedule.equal_chunks(input.numel(), self.world_size)
        own = output[chunks[self.rank].begin:chunks[self.rank].end]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        ring.all_gather(self._link, output, chunks, self._segment_numel(output))

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self._check_call("broadcast", tensor, tensor.numel(), root=root)
        if self.world_size > 1 and tensor.numel() > 0:
            options = dist.BroadcastOptions()
            options.rootRank = root
            self._link.wait(self.pg.broadcast([tensor], options), "broadcast", 0, f"receiving from root {root}")

    def barrier(self) -> None:
        self._check_call("barrier", None, 0, always=True)

    def close(self) -> None:
        self._link = None
