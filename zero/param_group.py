"""ParamGroup: the model's trainable parameters in units (buckets), honouring a
ShardingPolicy: what it keeps whole or as this rank's chunk, how gradients are
reduced, and the optimizer step on the fp32 master shard.

[Note: one class, every stage]
    policy.shard_optimizer  grads are reduce-scattered (else all-reduced); the
                            master weights and optimizer states cover only this
                            rank's chunk of each unit; resident units are
                            all-gathered after the step.
    policy.shard_grads      reduce every micro-step from a transient bucket into
                            a chunk-sized accumulator (else accumulate whole
                            gradients locally and reduce at the boundary);
                            reducer.py runs the gradient side.
    policy.shard_params     units are not resident: only the chunk is kept and
                            gather.py unshards a unit around its module's use.
"""
from __future__ import annotations

import torch

from .comm import Comm
from .partition import ShardingPolicy
from .reducer import BucketReducer
from .unit import Unit


class ParamGroup:
    """Units of the model plus the reduction and update rules of a policy."""

    def __init__(self, units: list[Unit], policy: ShardingPolicy, comm: Comm, reducer: BucketReducer) -> None:
        self.units = units
        self.policy = policy
        self.comm = comm
        self.reducer = reducer

    # ---- set-up -------------------------------------------------------------
    def setup_masters(self) -> list[tuple[int, torch.Tensor]]:
        """Allocates the owned gradient and fp32 master of every unit; returns
        (parameter index, master slice) pairs, the optimizer's parameters."""
        out = []
        for unit in self.units:
            full_or_shard = unit.full if unit.full is not None else unit.shard
            if self.policy.shard_optimizer:
                unit.owned = unit.bucket.local_chunk(unit.rank)
                source = unit.shard
            else:
                source = full_or_shard
            owned, dtype, device = unit.owned, unit.shard.dtype, unit.shard.device
            if not self.policy.shard_grads:
                unit.grad = torch.zeros(unit.bucket.numel, dtype=dtype, device=device)
                unit.grad_owned = unit.grad[owned.begin:owned.end]
            else:
                unit.grad_owned = torch.zeros(owned.numel, dtype=dtype, device=device)
            unit.master = source if source.dtype == torch.float32 else source.float()
            unit.master_views = []
            for index, local, _ in unit.layout.local_slices(unit.bucket.index, owned):
                begin, end = local.begin - owned.begin, local.end - owned.begin
                unit.master_views.append((unit.master[begin:end].requires_grad_(), begin, end))
                out.append((index, unit.master_views[-1][0]))
        return out

    # ---- step ------------------------------------------------------------------
    def owned_grads_fp32(self) -> list[torch.Tensor]:
        return [u.grad_owned if u.grad_owned.dtype == torch.float32 else u.grad_owned.float() for u in self.units]

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """Global L2 norm of the (still scaled) reduced gradients."""
        total = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
        for g in grads:
            total += torch.linalg.vector_norm(g).double() ** 2
        if self.policy.shard_optimizer:
            self.comm.all_reduce(total)
        return float(total.sqrt())

    def set_master_grads(self, grads: list[torch.Tensor], coef: float) -> None:
        """Hands the optimizer its gradients: owned slices times `coef` (unscale, clip)."""
        for unit, g in zip(self.units, grads):
            if coef != 1.0:
                g.mul_(coef)  # g is a scratch fp32 copy or the owned gradient, zeroed after the step
            for view, begin, end in unit.master_views:
                view.grad = g[begin:end]

    def publish_masters(self) -> None:
        """Copies updated masters into the parameters; all-gathers resident units."""
        works = []
        for unit in self.units:
            target = unit.shard if self.policy.shard_optimizer else (unit.full if unit.full is not None else unit.shard)
            if target.data_ptr() != unit.master.data_ptr():
                target.copy_(unit.master)
            if self.policy.shard_optimizer and unit.bucket.resident:
                works.append(self.comm.all_gather(unit.full, unit.shard, async_op=True))
        for work in works:
            work.wait()

    def full_masters(self) -> list[torch.Tensor]:
        """Every parameter's whole fp32 master, in parameter-index order (collective;
        for checkpoints and tests, not counted as step traffic)."""
        sent, out = self.comm.sent_nbytes, {}
        for unit in self.units:
            whole = unit.master
            if self.policy.shard_optimizer:
                whole = torch.empty(unit.bucket.numel, dtype=torch.float32, device=unit.master.device)
                self.comm.all_gather(whole, unit.master.contiguous()).wait()
            for index, span, shape in zip(unit.indices, unit.spans, unit.shapes):
                out[index] = whole[span.begin:span.end].detach().clone().view(shape)
        self.comm.sent_nbytes = sent
        return [out[i] for i in sorted(out)]

    def zero_grads(self) -> None:
        self.reducer.zero_grads()
