"""Set-up: the buckets filled from the model's parameters (rank 0's values
win), each keeping only its chunk unless resident; parameters partitioned by
zero.Init are gathered one at a time."""
from __future__ import annotations

import torch
from torch import nn

from ringcomm import BufferLayout

from . import init as zero_init
from .param_group import ZeroBucket
from .seam import Comm


def build_buckets(params: list[nn.Parameter], layout: BufferLayout, rank: int, comm: Comm) -> list[ZeroBucket]:
    """Copies parameters into bucket tensors on their device (rank 0's values
    win), then keeps only the chunk of non-resident buckets. A bucket holding
    parameters partitioned by zero.Init is filled one gathered parameter at a
    time, so set-up never holds more than the shards, a bucket's chunk and the
    largest parameter."""
    buckets = []
    for index, span in enumerate(layout.buckets):
        members = [params[i] for i in span.param_indices]
        if any(zero_init.is_partitioned(p) for p in members):
            full, shard = _fill_from_partitioned(members, layout, span, rank, comm)
        else:
            full = torch.zeros(span.numel, dtype=members[0].dtype, device=members[0].device)
            for i, param in zip(span.param_indices, members):
                local = layout.local(i)
                full[local.begin:local.end].copy_(param.detach().reshape(-1))
            comm.broadcast(full, 0)
            chunk = span.local_chunk(rank)
            shard = full[chunk.begin:chunk.end]
            if not span.resident:
                full, shard = None, shard.clone()
        bucket = ZeroBucket(layout, index, members, full, shard, rank)
        bucket.bind_params()
        buckets.append(bucket)
    return buckets


def _fill_from_partitioned(members: list[nn.Parameter], layout: BufferLayout, span, rank: int,
                           comm: Comm) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(full, shard) of one bucket built parameter by parameter; full is None
    for a non-resident bucket."""
    dtype, device = members[0].dtype, members[0].device  # the engine's dtype (model.to ran on the empty data)
    chunk = span.local_chunk(rank)
    full = torch.zeros(span.numel, dtype=dtype, device=device) if span.resident else None
    shard = full[chunk.begin:chunk.end] if full is not None else torch.zeros(chunk.numel, dtype=dtype, device=device)
    counts = comm.take_wire()  # set-up traffic is not a step's
    for i, param in zip(span.param_indices, members):
        local = layout.local(i)
        if zero_init.is_partitioned(param):
            whole = torch.empty(param.ds_tensor.numel() * comm.world_size, dtype=param.ds_tensor.dtype,
                                device=param.ds_tensor.device)
            comm.all_gather(whole, param.ds_tensor).wait()
            whole = whole[:param.ds_numel].to(device=device, dtype=dtype)
            zero_init.release(param)
        else:
            whole = param.detach().reshape(-1).clone()
            comm.broadcast(whole, 0)
        if full is not None:
            full[local.begin:local.end].copy_(whole)
            continue
        begin, end = max(local.begin, chunk.begin), min(local.end, chunk.end)
        if begin < end:
            shard[begin - chunk.begin:end - chunk.begin].copy_(whole[begin - local.begin:end - local.begin])
    comm.take_wire()
    comm.restore_wire(counts)
    return full, shard
