"""Public collectives: check the caller's arguments, then hand the tensors
to the group's transport (inline, or on its comm thread with async_op=True).

[Note: lean path] A synchronous call on plain CPU tensors (torch.Tensor
itself, not a subclass) that are contiguous, of a ringcomm dtype, sized
consistently and not overlapping other than in the exact in-place forms,
on a group whose transport has lean calls and nothing queued, goes straight to
the C++ op: one call, which checks the tensors itself and says whether it ran
(csrc/cpu/module_lean.cpp, [Note: lean calls]). Every other call takes the
checked path below it, which raises the errors. The C++ op still checks,
across ranks, that all called the same op, dtype and size, and that one thread
at a time uses the group.
"""
from __future__ import annotations

import torch

from .. import _C
from ..core import compat
from ..core.ops import DTYPE_CODES, ReduceOp, dtype_code, to_reduce_op
from . import aliasing
from .group import Group
from .registry import resolve_group
from .work import Work

# ---- the lean path: see [Note: lean path]. Each returns whether the call ran. ----
_C._lean_setup(torch.Tensor, torch.strided, DTYPE_CODES, *compat.profiler_flag())


def lean_all_reduce(tensor: object, op: ReduceOp, group: Group) -> bool:
    """In place: `tensor` becomes its reduction over the group, here and now,
    when the call may take the lean path; False sends it down the checked one."""
    handle = group.lean_handle
    try:
        return handle is not None and _C.all_reduce_tensor(handle, tensor, op, group.timeout_s)
    except Exception as err:
        raise lean_failed(err, group, "all_reduce") from None


def lean_reduce_scatter(output: object, input: object, op: ReduceOp, group: Group) -> bool:
    """reduce_scatter (torch's reduce_scatter_tensor) on the lean path, if it may take it."""
    handle = group.lean_handle
    try:
        return handle is not None and _C.reduce_scatter_tensors(handle, output, input, op, group.timeout_s)
    except Exception as err:
        raise lean_failed(err, group, "reduce_scatter") from None


def lean_all_gather(output: object, input: object, group: Group) -> bool:
    """all_gather (torch's all_gather_into_tensor) on the lean path, if it may take it."""
    handle = group.lean_handle
    try:
        return handle is not None and _C.all_gather_tensors(handle, output, input, group.timeout_s)
    except Exception as err:
        raise lean_failed(err, group, "all_gather") from None


def lean_failed(err: Exception, group: Group, op: str) -> Exception:
    """What a failed lean call raises: the group's error for it (a CallMismatch
    worded in the caller's units; the lean path runs on shm only)."""
    if isinstance(err, _C.CallMismatch):
        err = group.transport.mismatch_error(err, op)
    return group.failed(None, err)


def _check(op: str, name: str, tensor: object, group: Group) -> None:
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


def _check_pair(op: str, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output dtype {output.dtype} != input dtype {input.dtype} on rank {group.rank}")
    if output.device != input.device:
        raise ValueError(f"{op}: output device {output.device} != input device {input.device} on rank {group.rank}")


def all_reduce(tensor: torch.Tensor, op: object = ReduceOp.SUM, group: Group | None = None,
               async_op: bool = False, *, output: torch.Tensor | None = None) -> Work | None:
    """`tensor` (or `output`, when given, leaving `tensor` unchanged) becomes the
    reduction of `tensor` over all ranks."""
    if type(group) is not Group:
        group = resolve_group(group, "all_reduce")
    if output is None and not async_op and type(op) is ReduceOp and lean_all_reduce(tensor, op, group):
        return None
    redop = op if type(op) is ReduceOp else to_reduce_op(op, where=f"all_reduce on rank {group.rank}")
    _check("all_reduce", "tensor", tensor, group)
    if output is None:
        output = tensor
    else:
        _check("all_reduce", "output", output, group)
        _check_pair("all_reduce", output, tensor, group)
        if output.numel() != tensor.numel():
            raise ValueError(f"all_reduce: output.numel()={output.numel()} != tensor.numel()={tensor.numel()} "
                             f"on rank {group.rank}")
        tensor = aliasing.all_reduce_input(output, tensor)
    return group.run("all_reduce", lambda: group.transport.all_reduce(output=output, input=tensor, op=redop),
                     async_op, inputs=(tensor,), outputs=(output,), redop=redop)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: Group | None = None,
                   async_op: bool = False) -> Work | None:
    """torch's reduce_scatter_tensor: input holds world_size chunks of output.numel()
    elements; rank r's output becomes chunk r reduced over all ranks."""
    if type(group) is not Group:
        group = resolve_group(group, "reduce_scatter")
    if not async_op and type(op) is ReduceOp and lean_reduce_scatter(output, input, op, group):
        return None
    redop = op if type(op) is ReduceOp else to_reduce_op(op, where=f"reduce_scatter on rank {group.rank}")
    _check("reduce_scatter", "output", output, group)
    _check("reduce_scatter", "input", input, group)
    _check_pair("reduce_scatter", output, input, group)
    if input.numel() != group.world_size * output.numel():
        raise ValueError(f"reduce_scatter: input.numel()={input.numel()} != world_size ({group.world_size}) * "
                         f"output.numel()={output.numel()} on rank {group.rank}")
    input = aliasing.reduce_scatter_input(output, input, group.rank)
    return group.run("reduce_scatter", lambda: group.transport.reduce_scatter(output=output, input=input, op=redop),
                     async_op, inputs=(input,), outputs=(output,), redop=redop)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group | None = None,
               async_op: bool = False) -> Work | None:
    """torch's all_gather_into_tensor: output chunk r becomes rank r's input."""
    if type(group) is not Group:
        group = resolve_group(group, "all_gather")
    if not async_op and lean_all_gather(output, input, group):
        return None
    _check("all_gather", "output", output, group)
    _check("all_gather", "input", input, group)
    _check_pair("all_gather", output, input, group)
    if output.numel() != group.world_size * input.numel():
        raise ValueError(f"all_gather: output.numel()={output.numel()} != world_size ({group.world_size}) * "
                         f"input.numel()={input.numel()} on rank {group.rank}")
    input = aliasing.all_gather_input(output, input, group.rank)
    return group.run("all_gather", lambda: group.transport.all_gather(output=output, input=input), async_op,
                     inputs=(input,), outputs=(output,))


def broadcast(tensor: torch.Tensor, src: int = 0, group: Group | None = None, async_op: bool = False) -> Work | None:
    """In place: every rank's `tensor` becomes that of group rank `src`."""
    group = resolve_group(group, "broadcast")
    _check("broadcast", "tensor", tensor, group)
    if not 0 <= src < group.world_size:
        raise ValueError(f"broadcast: src={src} outside the group (world_size {group.world_size}) on rank {group.rank}")
    return group.run("broadcast", lambda: group.transport.broadcast(tensor, src), async_op,
                     inputs=(tensor,), outputs=(tensor,))


def barrier(group: Group | None = None, async_op: bool = False) -> Work | None:
    group = resolve_group(group, "barrier")
    return group.run("barrier", group.transport.barrier, async_op)


def empty(*shape: int, dtype: torch.dtype = torch.float32, group: Group | None = None) -> torch.Tensor:
    """Collective (every rank of the group calls it with its own shape): an
    uninitialized CPU tensor in memory the group's ranks share, so collectives
    on it, or on views of it, read peers' data in place instead of staging it.
    On a torch_dist group this is plain torch.empty."""
    group = resolve_group(group, "empty")
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    dtype_code(dtype, where=f"empty on rank {group.rank}")
    numel = 1
    for extent in shape:
        if extent < 0:
            raise ValueError(f"empty: negative extent in shape {shape} on rank {group.rank}")
        numel *= extent
    return group.allocate(numel, dtype).view(shape)
