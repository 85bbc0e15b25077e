"""The ring executor: walks the plans of ringcomm.schedule over a Link,
moving segments and reducing them with ringcomm.kernels.

Segments of one step are all posted at once and reduced in order as they
arrive, so the reduction of segment i overlaps the transfer of segment i + 1.
"""
from __future__ import annotations

from itertools import zip_longest
from typing import Protocol

import torch

from . import schedule
from .kernels import reduce_into
from .ops import ReduceOp


class Transfer(Protocol):
    def wait_send(self) -> None: ...

    def wait_recv(self) -> None: ...


class Link(Protocol):
    """Point-to-point transfers to the right neighbour and from the left one."""

    rank: int
    world_size: int

    def start(self, send: torch.Tensor | None, recv: torch.Tensor | None, *, op: str, step: int) -> Transfer: ...


def _start_step(link: Link, data: torch.Tensor, recv_into: torch.Tensor, step: schedule.RingStep,
                chunks: tuple[schedule.Span, ...], segment_numel: int, op: str) -> list[tuple[schedule.Span | None, Transfer]]:
    """Posts every segment of one ring step; returns (received segment, transfer) pairs."""
    send_chunk, recv_chunk = chunks[step.send_chunk], chunks[step.recv_chunk]
    transfers = []
    for send_seg, recv_seg in zip_longest(schedule.segments(send_chunk, segment_numel),
                                          schedule.segments(recv_chunk, segment_numel)):
        send = data[send_seg.begin:send_seg.end] if send_seg else None
        recv = None
        if recv_seg:
            offset = recv_seg.begin - recv_chunk.begin
            recv = recv_into[offset:offset + recv_seg.numel]
        transfers.append((recv_seg, link.start(send, recv, op=op, step=step.step)))
    return transfers


def reduce_scatter(link: Link, data: torch.Tensor, chunks: tuple[schedule.Span, ...], op: ReduceOp,
                   segment_numel: int, *, name: str = "reduce_scatter") -> None:
    """In place on `data`: afterwards data[chunks[rank]] holds that chunk reduced over all ranks.
    Other chunks of `data` hold partial results."""
    steps = schedule.reduce_scatter_steps(link.rank, link.world_size)
    scratch = torch.empty(max(c.numel for c in chunks), dtype=data.dtype, device=data.device)
    for step in steps:
        last = step.step == len(steps) - 1
        step_op = op if last or op != ReduceOp.AVG else ReduceOp.SUM
        transfers = _start_step(link, data, scratch, step, chunks, segment_numel, name)
        recv_chunk = chunks[step.recv_chunk]
        for recv_seg, transfer in transfers:
            transfer.wait_recv()
            if recv_seg is not None:
                mine = data[recv_seg.begin:recv_seg.end]
                offset = recv_seg.begin - recv_chunk.begin
                reduce_into(mine, [mine, scratch[offset:offset + recv_seg.numel]], step_op, link.world_size)
        for _, transfer in transfers:
            transfer.wait_send()
    if not steps and op == ReduceOp.AVG:
        own = chunks[link.rank]
        reduce_into(data[own.begin:own.end], [data[own.begin:own.end]], op, 1)


def all_gather(link: Link, data: torch.Tensor, chunks: tuple[schedule.Span, ...], segment_numel: int, *,
               name: str = "all_gather") -> None:
    """In place on `data`: rank r's chunk r is forwarded around the ring into every rank's `data`."""
    for step in schedule.all_gather_steps(link.rank, link.world_size):
        recv_chunk = chunks[step.recv_chunk]
        transfers = _start_step(link, data, data[recv_chunk.begin:recv_chunk.end], step, chunks, segment_numel, name)
        for _, transfer in transfers:
            transfer.wait_recv()
        for _, transfer in transfers:
            transfer.wait_send()
