"""Unit: one bucket's tensors (whole parameters, shard, gradient bucket, fp32
master) and its unshard / reshard around all-gathers."""
from __future__ import annotations

import torch
from torch import nn

from ringcomm.layout import BucketSpan, BufferLayout
from ringcomm.schedule import Span

from .comm import Comm, Handle


class Unit:
    """One bucket's tensors. `full` holds the whole padded bucket (always for a
    resident bucket, while gathered otherwise); `shard` is this rank's chunk.
    `spans[i]` is where params[i] lives in the bucket (bucket coordinates)."""

    def __init__(self, layout: BufferLayout, bucket: BucketSpan, params: list[nn.Parameter],
                 full: torch.Tensor | None, shard: torch.Tensor, rank: int) -> None:
        self.layout = layout
        self.bucket = bucket
        self.indices = bucket.param_indices
        self.spans = [layout.local(i) for i in bucket.param_indices]
        self.params = params
        self.shapes = [p.shape for p in params]
        self.full = full
        self.shard = shard
        self.rank = rank
        self.grad: torch.Tensor | None = None  # whole-unit gradient bucket
        self.grad_owned: torch.Tensor | None = None  # reduced gradient of the owned span
        self.master: torch.Tensor | None = None  # fp32 owned span (may alias the params)
        self.master_views: list[tuple[torch.Tensor, int, int]] = []  # optimizer parameters
        self.owned = Span(0, bucket.numel)
        self.num_ready = 0
        self.written: set[int] = set()  # slots written this backward
        self.fresh = True  # `grad` holds nothing of this accumulation window (skip the memset)
        self.owned_fresh = True  # the same for a separate `grad_owned` (stages 2-3)
        self.reduction: Handle | None = None
        self.gather: Handle | None = None

    def bind_params(self) -> None:
        """Points every parameter at its slice of `full` (or at nothing)."""
        for param, span, shape in zip(self.params, self.spans, self.shapes):
            if self.full is None:
                param.data = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)
            else:
                param.data = self.full[span.begin:span.end].view(shape)

    def start_unshard(self, comm: Comm) -> None:
        if self.full is None and self.gather is None:
            self.full = torch.empty(self.bucket.numel, dtype=self.shard.dtype, device=self.shard.device)
            self.gather = comm.all_gather(self.full, self.shard, async_op=True)

    def finish_unshard(self, comm: Comm) -> None:
        self.start_unshard(comm)
        if self.gather is not None:
            self.gather.wait()
            self.gather = None
            self.bind_params()

    def reshard(self) -> None:
        if self.bucket.resident or self.full is None:
            return
        if self.gather is not None:
            self.gather.wait()
            self.gather = None
        self.full = None
        self.bind_params()


def build_units(params: list[nn.Parameter], layout: BufferLayout, rank: int, comm: Comm) -> list[Unit]:
    """Copies parameters into bucket buffers on their device (rank 0's values
    win), then keeps only the chunk of non-resident buckets."""
    units = []
    for bucket in layout.buckets:
        members = [params[i] for i in bucket.param_indices]
        full = torch.zeros(bucket.numel, dtype=members[0].dtype, device=members[0].device)
        for index, param in zip(bucket.param_indices, members):
            span = layout.local(index)
            full[span.begin:span.end].copy_(param.detach().reshape(-1))
        comm.broadcast(full, 0)
        chunk = bucket.local_chunk(rank)
        shard = full[chunk.begin:chunk.end]
        unit = Unit(layout, bucket, members, full if bucket.resident else None,
                    shard if bucket.resident else shard.clone(), rank)
        unit.bind_params()
        units.append(unit)
    return units
