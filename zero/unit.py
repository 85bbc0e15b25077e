"""Unit: one bucket's tensors (whole parameters, shard, gradient bucket, fp32
master) and its unshard / reshard around all-gathers."""
from __future__ import annotations

import torch
from torch import nn

from .comm import Comm, Handle
from .partition import UnitPlan


class Unit:
    """One unit's tensors. `full` holds the whole padded unit (always for a
    resident unit, while gathered otherwise); `shard` is this rank's chunk."""

    def __init__(self, plan: UnitPlan, params: list[nn.Parameter], full: torch.Tensor | None,
                 shard: torch.Tensor, rank: int) -> None:
        self.plan = plan
        self.params = params
        self.shapes = [p.shape for p in params]
        self.full = full
        self.shard = shard
        self.rank = rank
        self.grad: torch.Tensor | None = None  # whole-unit gradient bucket
        self.grad_owned: torch.Tensor | None = None  # reduced gradient of the owned span
        self.master: torch.Tensor | None = None  # fp32 owned span (may alias the params)
        self.master_views: list[tuple[torch.Tensor, int, int]] = []  # optimizer parameters
        self.owned: tuple[int, int] = (0, plan.padded_numel)
        self.num_ready = 0
        self.written: set[int] = set()  # slots written this backward
        self.fresh = True  # `grad` holds nothing of this accumulation window (skip the memset)
        self.owned_fresh = True  # the same for a separate `grad_owned` (stages 2-3)
        self.reduction: Handle | None = None
        self.gather: Handle | None = None

    def bind_params(self) -> None:
        """Points every parameter at its slice of `full` (or at nothing)."""
        for param, slot, shape in zip(self.params, self.plan.slots, self.shapes):
            if self.full is None:
                param.data = torch.empty(0, dtype=self.shard.dtype)
            else:
                param.data = self.full[slot.begin:slot.end].view(shape)

    def start_unshard(self, comm: Comm) -> None:
        if self.full is None and self.gather is None:
            self.full = torch.empty(self.plan.padded_numel, dtype=self.shard.dtype)
            self.gather = comm.all_gather(self.full, self.shard, async_op=True)

    def finish_unshard(self, comm: Comm) -> None:
        self.start_unshard(comm)
        if self.gather is not None:
            self.gather.wait()
            self.gather = None
            self.bind_params()

    def reshard(self) -> None:
        if self.plan.resident or self.full is None:
            return
        if self.gather is not None:
            self.gather.wait()
            self.gather = None
        self.full = None
        self.bind_params()


def build_units(params: list[nn.Parameter], plans: tuple[UnitPlan, ...], rank: int, comm: Comm) -> list[Unit]:
    """Copies parameters into unit buffers (rank 0's values win), then keeps
    only the chunk of non-resident units."""
    units = []
    for plan in plans:
        members = [params[slot.index] for slot in plan.slots]
        dtype = members[0].dtype
        full = torch.zeros(plan.padded_numel, dtype=dtype)
        for param, slot in zip(members, plan.slots):
            full[slot.begin:slot.end].copy_(param.detach().reshape(-1))
        comm.broadcast(full, 0)
        begin, end = plan.chunk(rank)
        shard = full[begin:end] if plan.resident else full[begin:end].clone()
        unit = Unit(plan, members, full if plan.resident else None, shard, rank)
        unit.bind_params()
        units.append(unit)
    return units


def units_on_buffer(buffer, plans: tuple[UnitPlan, ...], params: list[nn.Parameter], rank: int,
                    comm: Comm) -> list[Unit]:
    """Units that are views of a ringcomm FlatBuffer holding `params` (data and
    gradients), one per bucket of its layout (rank 0's values win)."""
    units = []
    for bucket, plan in enumerate(plans):
        full = buffer.bucket_view(bucket, "data")
        comm.broadcast(full, 0)
        unit = Unit(plan, [params[slot.index] for slot in plan.slots], full,
                    buffer.shard_view(bucket, rank, "data"), rank)
        unit.grad = buffer.bucket_view(bucket, "grad")
        unit.bind_params()  # the same memory FlatBuffer bound
        units.append(unit)
    return units

