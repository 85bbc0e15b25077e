"""The bodies of the collectives the "ringcomm" backend accelerates: each builder
checks nothing and returns a closure that runs the call on a transport (the
process group has already checked the tensors); and the lean path's check of
one (output, input) pair."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..comm import aliasing
from ..core import compat
from ..core.ops import ReduceOp
from ..transport.base import Transport
from .work import JoinedWork

Body = Callable[[], None]


def all_reduce(transport: Transport, tensors: Sequence[torch.Tensor], op: ReduceOp) -> Body:
    def body() -> None:
        for tensor in tensors:
            with contiguous(tensor) as flat:
                transport.all_reduce(output=flat, input=flat, op=op)

    return body


def broadcast(transport: Transport, tensors: Sequence[torch.Tensor], root: int) -> Body:
    def body() -> None:
        for tensor in tensors:
            with contiguous(tensor) as flat:
                transport.broadcast(flat, root)

    return body


def all_gather(transport: Transport, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Body:
    def body() -> None:
        for output, input in zip(outputs, aliasing.coalesced_inputs(outputs, inputs, transport.rank, gather=True)):
            transport.all_gather(output=output, input=input)

    return body


def reduce_scatter(transport: Transport, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   op: ReduceOp) -> Body:
    def body() -> None:
        for output, input in zip(outputs, aliasing.coalesced_inputs(outputs, inputs, transport.rank, gather=False)):
            transport.reduce_scatter(output=output, input=input, op=op)

    return body


@contextlib.contextmanager
def contiguous(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensor itself when contiguous (transports read any shape as flat), else
    a contiguous copy whose result is copied back: in-place calls on strided views."""
    if tensor.is_contiguous():
        yield tensor
        return
    staged = tensor.contiguous()
    yield staged
    tensor.copy_(staged)


def all_gather_list(transport: Transport, outputs: Sequence[torch.Tensor], input: torch.Tensor) -> Body:
    """torch's all_gather (a list of outputs): gather into one flat buffer, then
    copy chunk r into outputs[r]."""
    numel = input.numel()

    def body() -> None:
        gathered = torch.empty(len(outputs) * numel, dtype=input.dtype)
        transport.all_gather(output=gathered, input=input)
        for rank, output in enumerate(outputs):
            output.view(-1).copy_(gathered[rank * numel:(rank + 1) * numel])

    return body


def reduce_scatter_list(transport: Transport, output: torch.Tensor, inputs: Sequence[torch.Tensor],
                        op: ReduceOp) -> Body:
    """torch's reduce_scatter (a list of inputs): concatenate, then reduce-scatter."""

    def body() -> None:
        transport.reduce_scatter(output=output, input=torch.cat([t.reshape(-1) for t in inputs]), op=op)

    return body


# ---- checks of the caller's arguments ----
def equal_numels(tensors: Sequence[torch.Tensor]) -> bool:
    return len({t.numel() for t in tensors}) <= 1


def check_root(op: str, root: int, rank: int, world_size: int) -> None:
    if not 0 <= root < world_size:
        raise ValueError(f"{op}: root rank {root} outside the group (world_size {world_size}) on rank {rank}")


def check_list(op: str, tensors: Sequence[torch.Tensor], rank: int, world_size: int) -> None:
    if len(tensors) != world_size:
        raise ValueError(f"{op}: the tensor list has {len(tensors)} entries != world_size ({world_size}) "
                         f"on rank {rank}")


def check_pairs(op: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], rank: int, world_size: int,
                *, gather: bool) -> None:
    """all_gather_single: output = world_size inputs; reduce_scatter_single: input = world_size outputs."""
    for index, (output, input) in enumerate(zip(outputs, inputs)):
        big, small = (output, input) if gather else (input, output)
        if big.numel() != world_size * small.numel():
            raise ValueError(f"{op}: pair {index}: output.numel()={output.numel()}, input.numel()={input.numel()}; "
                             f"expected the {'output' if gather else 'input'} to be world_size ({world_size}) times "
                             f"the other, on rank {rank}")


# ---- forwarding the tensor forms to a gloo or NCCL backend ----
def forward_all_gather_single(backend: dist.ProcessGroup, outputs: Sequence[torch.Tensor],
                              inputs: Sequence[torch.Tensor], opts: object) -> dist.Work:
    works = [compat.allgather_base(backend, o, i, opts) for o, i in zip(outputs, inputs)]
    return _join(works, list(outputs))


def forward_reduce_scatter_single(backend: dist.ProcessGroup, outputs: Sequence[torch.Tensor],
                                  inputs: Sequence[torch.Tensor], opts: object) -> dist.Work:
    works = [compat.reduce_scatter_base(backend, o, i, opts) for o, i in zip(outputs, inputs)]
    return _join(works, list(outputs))


def _join(works: list[dist.Work], value: list[torch.Tensor]) -> dist.Work:
    return works[0] if len(works) == 1 else JoinedWork(works, value)
