"""Coalesced collectives over lists of tensors: pack each bucket of tensors
into one flat tensor, run one collective per bucket, unpack.

Packing is owner-aligned (see [Note: owner-aligned buckets] in layout.py): for
reduce-scatter, input i is viewed as (world_size, n_i) and the packed bucket
is their concatenation along dim 1, so chunk r of the bucket holds chunk r of
every input; all-gather is the mirror image.
"""
from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Callable, Sequence

import torch

from ..core.ops import ReduceOp
from ..plan.layout import plan_buckets
from .collectives import all_gather, reduce_scatter
from .group import Group
from .registry import resolve_group
from .work import Work


def reduce_scatter_coalesced(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], op: object = ReduceOp.SUM,
                             group: Group | None = None, async_op: bool = False, *,
                             bucket_bytes: int | None = None) -> Work | None:
    """For every i, reduce_scatter(outputs[i], inputs[i]) (inputs[i] holds
    world_size * outputs[i].numel() elements), with one collective per bucket
    of at most `bucket_bytes` (None: one bucket per dtype)."""
    group = resolve_group(group, "reduce_scatter_coalesced")
    ws = group.world_size
    _check_lists("reduce_scatter_coalesced", outputs, inputs, ws, group.rank, gather=False)
    pieces = []
    for indices in _buckets(outputs, bucket_bytes):
        packed = torch.cat([inputs[i].reshape(ws, outputs[i].numel()) for i in indices], dim=1).reshape(-1)
        out = torch.empty(packed.numel() // ws, dtype=packed.dtype, device=packed.device)
        unpack = _unpack_rs(out, [outputs[i] for i in indices])
        pieces.append((lambda a, o=out, p=packed: reduce_scatter(o, p, op, group, a), unpack))
    return _run("reduce_scatter_coalesced", pieces, group, async_op)


def all_gather_coalesced(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group: Group | None = None,
                         async_op: bool = False, *, bucket_bytes: int | None = None) -> Work | None:
    """For every i, all_gather(outputs[i], inputs[i]) (outputs[i] holds
    world_size * inputs[i].numel() elements), one collective per bucket."""
    group = resolve_group(group, "all_gather_coalesced")
    ws = group.world_size
    _check_lists("all_gather_coalesced", outputs, inputs, ws, group.rank, gather=True)
    pieces = []
    for indices in _buckets(inputs, bucket_bytes):
        packed = torch.cat([inputs[i].reshape(-1) for i in indices])
        out = torch.empty(packed.numel() * ws, dtype=packed.dtype, device=packed.device)
        unpack = _unpack_ag(out, [outputs[i] for i in indices], ws)
        pieces.append((lambda a, o=out, p=packed: all_gather(o, p, group, a), unpack))
    return _run("all_gather_coalesced", pieces, group, async_op)


def _unpack_rs(out: torch.Tensor, targets: list[torch.Tensor]) -> Callable[[], None]:
    def unpack() -> None:
        for target, part in zip(targets, out.split([t.numel() for t in targets])):
            target.copy_(part.view(target.shape))
    return unpack


def _unpack_ag(out: torch.Tensor, targets: list[torch.Tensor], ws: int) -> Callable[[], None]:
    def unpack() -> None:
        numels = [t.numel() // ws for t in targets]
        for target, numel, part in zip(targets, numels, out.view(ws, sum(numels)).split(numels, dim=1)):
            target.view(ws, numel).copy_(part)
    return unpack


def _run(op: str, pieces: list, group: Group, async_op: bool) -> Work | None:
    """Launches every bucket in order; unpacks each when it completes."""
    if not async_op:
        for start, unpack in pieces:
            start(False)
            unpack()
        return None
    done: concurrent.futures.Future = concurrent.futures.Future()
    remaining = [len(pieces)]
    lock = threading.Lock()
    if not pieces:
        done.set_result(None)

    def on_done(work: Work, unpack: Callable[[], None]) -> None:
        error = work.exception()
        try:
            if error is None:
                unpack()
        except BaseException as err:  # reported through the Work
            error = err
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if error is not None and not done.done():
            done.set_exception(error)
        elif last and not done.done():
            done.set_result(None)

    for start, unpack in pieces:
        work = start(True)
        work.get_future().add_done_callback(lambda _f, w=work, u=unpack: on_done(w, u))
    return Work(done, op, group.rank)


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int | None) -> list[list[int]]:
    """Indices grouped by (dtype, device), each group cut into buckets of about
    `bucket_bytes` by ringcomm.plan.layout's planner, in call order."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(i)
    buckets = []
    for indices in groups.values():
        itemsize = tensors[indices[0]].element_size()
        capacity = sys.maxsize if bucket_bytes is None else max(1, bucket_bytes // itemsize)
        layout = plan_buckets([tensors[i].numel() for i in indices], world_size=1, bucket_numel=capacity,
                              order=range(len(indices)))
        buckets.extend([indices[j] for j in bucket.param_indices] for bucket in layout.buckets)
    return buckets


def _check_lists(op: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], ws: int, rank: int, *,
                 gather: bool) -> None:
    if len(outputs) != len(inputs):
        raise ValueError(f"{op}: {len(outputs)} outputs != {len(inputs)} inputs on rank {rank}")
    for i, (out, inp) in enumerate(zip(outputs, inputs)):
        big, small = (out, inp) if gather else (inp, out)
        if big.numel() != ws * small.numel():
            raise ValueError(f"{op}: tensor {i}: {'output' if gather else 'input'}.numel()={big.numel()} != "
                             f"world_size ({ws}) * {'input' if gather else 'output'}.numel()={small.numel()} on rank {rank}")
        if out.dtype != inp.dtype or out.device != inp.device:
            raise TypeError(f"{op}: tensor {i}: output {out.dtype} on {out.device} != input {inp.dtype} on "
                            f"{inp.device} on rank {rank}")
        if not out.is_contiguous():
            raise ValueError(f"{op}: output {i} must be contiguous (shape {tuple(out.shape)}) on rank {rank}")
