"""Public collectives: check the caller's arguments, then hand the flat views
to the group's transport (inline, or on its comm thread with async_op=True)."""
from __future__ import annotations

import torch

from .group import Group, default_group
from .ops import DTYPE_CODES, ReduceOp, dtype_code, to_reduce_op
from .work import Work


def _check(op: str, name: str, tensor: object, group: Group) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__} on rank {group.rank}")
    if tensor.dtype not in DTYPE_CODES:
        dtype_code(tensor.dtype, where=f"{op} ({name} on rank {group.rank})")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (shape {tuple(tensor.shape)}, "
                         f"stride {tensor.stride()}) on rank {group.rank}")
    if not group.transport.supports(tensor):
        raise ValueError(f"{op}: the {group.transport.kind} transport does not handle {name} on {tensor.device} "
                         f"(rank {group.rank}); use a CPU tensor or transport='torch_dist'")
    return tensor


def _check_pair(op: str, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output dtype {output.dtype} != input dtype {input.dtype} on rank {group.rank}")
    if output.device != input.device:
        raise ValueError(f"{op}: output device {output.device} != input device {input.device} on rank {group.rank}")


def all_reduce(tensor: torch.Tensor, op: object = ReduceOp.SUM, group: Group | None = None,
               async_op: bool = False, *, output: torch.Tensor | None = None) -> Work | None:
    """`tensor` (or `output`, when given, leaving `tensor` unchanged) becomes the
    reduction of `tensor` over all ranks."""
    group = group or default_group()
    redop = op if type(op) is ReduceOp else to_reduce_op(op, where=f"all_reduce on rank {group.rank}")
    flat = _check("all_reduce", "tensor", tensor, group)
    out = flat
    if output is not None:
        out = _check("all_reduce", "output", output, group)
        _check_pair("all_reduce", output, tensor, group)
        if out.numel() != flat.numel():
            raise ValueError(f"all_reduce: output.numel()={out.numel()} != tensor.numel()={flat.numel()} "
                             f"on rank {group.rank}")
    return group.run("all_reduce", lambda: group.transport.all_reduce(flat, out, redop), async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: Group | None = None,
                   async_op: bool = False) -> Work | None:
    """torch's reduce_scatter_tensor: input holds world_size chunks of output.numel()
    elements; rank r's output becomes chunk r reduced over all ranks."""
    group = group or default_group()
    redop = op if type(op) is ReduceOp else to_reduce_op(op, where=f"reduce_scatter on rank {group.rank}")
    out = _check("reduce_scatter", "output", output, group)
    inp = _check("reduce_scatter", "input", input, group)
    _check_pair("reduce_scatter", output, input, group)
    if inp.numel() != group.world_size * out.numel():
        raise ValueError(f"reduce_scatter: input.numel()={inp.numel()} != world_size ({group.world_size}) * "
                         f"output.numel()={out.numel()} on rank {group.rank}")
    return group.run("reduce_scatter", lambda: group.transport.reduce_scatter(inp, out, redop), async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group | None = None,
               async_op: bool = False) -> Work | None:
    """torch's all_gather_into_tensor: output chunk r becomes rank r's input."""
    group = group or default_group()
    out = _check("all_gather", "output", output, group)
    inp = _check("all_gather", "input", input, group)
    _check_pair("all_gather", output, input, group)
    if out.numel() != group.world_size * inp.numel():
        raise ValueError(f"all_gather: output.numel()={out.numel()} != world_size ({group.world_size}) * "
                         f"input.numel()={inp.numel()} on rank {group.rank}")
    return group.run("all_gather", lambda: group.transport.all_gather(inp, out), async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Group | None = None, async_op: bool = False) -> Work | None:
    """In place: every rank's `tensor` becomes that of group rank `src`."""
    group = group or default_group()
    flat = _check("broadcast", "tensor", tensor, group)
    if not 0 <= src < group.world_size:
        raise ValueError(f"broadcast: src={src} outside the group (world_size {group.world_size}) on rank {group.rank}")
    return group.run("broadcast", lambda: group.transport.broadcast(flat, src), async_op)


def barrier(group: Group | None = None, async_op: bool = False) -> Work | None:
    group = group or default_group()
    return group.run("barrier", group.transport.barrier, async_op)


def empty(*shape: int, dtype: torch.dtype = torch.float32, group: Group | None = None) -> torch.Tensor:
    """Collective (every rank of the group calls it with its own shape): an
    uninitialized CPU tensor in memory the group's ranks share, so collectives
    on it, or on views of it, read peers' data in place instead of staging it.
    On a torch_dist group this is plain torch.empty."""
    group = group or default_group()
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    dtype_code(dtype, where=f"empty on rank {group.rank}")
    numel = 1
    for extent in shape:
        if extent < 0:
            raise ValueError(f"empty: negative extent in shape {shape} on rank {group.rank}")
        numel *= extent
    return group.allocate(numel, dtype).view(shape)
