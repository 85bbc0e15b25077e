"""The ring executor: walks the plans of ringcomm.plan.schedule over a Link,
moving segments and reducing them with ringcomm.kernels.cpu.

Segments of one step are all posted at once and reduced in order as they
arrive, so the reduction of segment i overlaps the transfer of segment i + 1.
"""
from __future__ import annotations

from itertools import zip_longest
from typing import Protocol

import torch

from ..core.ops import LOW_PRECISION, ReduceOp
from ..kernels.cpu import reduce_into
from ..plan import schedule


class Transfer(Protocol):
    def wait_send(self) -> None: ...

    def wait_recv(self) -> None: ...


class Link(Protocol):
    """Point-to-point transfers to the right neighbour and from the left one."""

    rank: int
    world_size: int

    def start(self, send: torch.Tensor | None, recv: torch.Tensor | None, *, op: str, step: int) -> Transfer: ...


class Scratch:
    """A buffer reused across calls (fresh memory costs a page fault per 4 KiB)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = self._buffers.get((dtype, device))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(dtype, device)] = buffer
        return buffer[:numel]


def _start_step(link: Link, send: torch.Tensor, recv: torch.Tensor, segment_numel: int, name: str,
                step: int) -> list[tuple[schedule.Span | None, Transfer]]:
    """Posts every segment of one step (`send` and `recv` are whole chunks);
    returns (received segment, transfer) pairs in order."""
    transfers = []
    for send_seg, recv_seg in zip_longest(schedule.segments(schedule.Span(0, send.numel()), segment_numel),
                                          schedule.segments(schedule.Span(0, recv.numel()), segment_numel)):
        transfers.append((recv_seg, link.start(send[send_seg.begin:send_seg.end] if send_seg else None,
                                               recv[recv_seg.begin:recv_seg.end] if recv_seg else None,
                                               op=name, step=step)))
    return transfers


def _finish_sends(transfers: list[tuple[schedule.Span | None, Transfer]]) -> None:
    for _, transfer in transfers:
        transfer.wait_send()


def reduce_scatter(link: Link, *, output: torch.Tensor, input: torch.Tensor, chunks: tuple[schedule.Span, ...],
                   op: ReduceOp, segment_numel: int, name: str = "reduce_scatter",
                   scratch: Scratch | None = None) -> None:
    """`output` becomes chunk `rank` of `input` reduced over all ranks; `input` is
    left as it is. Partial sums travel in two ping-pong buffers of one chunk; for
    16-bit inputs they are float32, so the result is rounded once. `scratch`
    keeps those buffers from one call to the next."""
    acc_dtype = torch.float32 if input.dtype in LOW_PRECISION else input.dtype

    def widen(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == acc_dtype else t.to(acc_dtype)

    own = chunks[link.rank]
    steps = schedule.reduce_scatter_steps(link.rank, link.world_size)
    if not steps:
        reduce_into(output, [input[own.begin:own.end]], op, 1)
        return
    width = max(c.numel for c in chunks)
    pair = (scratch or Scratch()).get(2 * width, acc_dtype, input.device)
    buffers = (pair[:width], pair[width:])
    for step in steps:
        send_chunk, recv_chunk = chunks[step.send_chunk], chunks[step.recv_chunk]
        send = widen(input[send_chunk.begin:send_chunk.end]) if step.step == 0 else \
            buffers[(step.step - 1) % 2][:send_chunk.numel]
        partial = buffers[step.step % 2][:recv_chunk.numel]
        last = step.step == len(steps) - 1
        step_op = op if last or op != ReduceOp.AVG else ReduceOp.SUM
        transfers = _start_step(link, send, partial, segment_numel, name, step.step)
        for seg, transfer in transfers:
            transfer.wait_recv()
            if seg is None:
                continue
            mine = input[recv_chunk.begin + seg.begin:recv_chunk.begin + seg.end]
            received = partial[seg.begin:seg.end]
            if last and acc_dtype == input.dtype:
                reduce_into(output[seg.begin:seg.end], [mine, received], step_op, link.world_size)
                continue
            reduce_into(received, [widen(mine), received], step_op, link.world_size)
            if last:
                output[seg.begin:seg.end].copy_(received)  # float32 -> 16-bit: the one rounding
        _finish_sends(transfers)


def all_gather(link: Link, data: torch.Tensor, chunks: tuple[schedule.Span, ...], segment_numel: int, *,
               name: str = "all_gather") -> None:
    """In place on `data`: rank r's chunk r is forwarded around the ring into every rank's `data`."""
    for step in schedule.all_gather_steps(link.rank, link.world_size):
        send_chunk, recv_chunk = chunks[step.send_chunk], chunks[step.recv_chunk]
        transfers = _start_step(link, data[send_chunk.begin:send_chunk.end], data[recv_chunk.begin:recv_chunk.end],
                                segment_numel, name, step.step)
        for _, transfer in transfers:
            transfer.wait_recv()
        _finish_sends(transfers)
