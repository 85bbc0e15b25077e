"""torch.distributed Work objects for the "ringcomm" backend: torch Works built
from futures, and the checks that decide which calls ringcomm accelerates."""
from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from .ops import DTYPE_CODES, ReduceOp, to_reduce_op
from .work import Work

def completed_work(value: object) -> dist.Work:
    """A torch Work that is already done, its future holding `value` (torch wants
    a Tensor or a list of Tensors there)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return _create_work_from_future(future)


def torch_work(work: Work | None, value: object) -> dist.Work:
    """Wraps a ringcomm Work (None: finished inline) as a torch Work whose future
    holds `value` once the collective is done, or its error."""
    if work is None:
        return completed_work(value)
    return _create_work_from_future(work.get_future(value))


def wait_forwarded(work: dist.Work, op: str, rank: int, timeout_s: float) -> None:
    """Waits for a Work of the internal gloo group, naming the call if it fails."""
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as err:  # gloo raises RuntimeError or DistBackendError
        raise RuntimeError(f"{op} (forwarded to gloo): rank {rank} failed or timed out after {timeout_s} s: "
                           f"{err}") from err


def accelerated_redop(opts: object) -> ReduceOp | None:
    """ringcomm's op for `opts.reduceOp`, or None when ringcomm does not do it
    (PREMUL_SUM, BAND, ...): such calls are forwarded."""
    try:
        return to_reduce_op(getattr(opts, "reduceOp", dist.ReduceOp.SUM), where="ringcomm backend")
    except ValueError:
        return None


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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2 * local_ranks
