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
                            gradients locally and reduce at the boundary).
    policy.shard_params     units are not resident: only the chunk is kept and
                            gather.py unshards a unit around its module's use.
"""
from __future__ import annotations

import torch
from torch import nn

from .comm import Comm
from .partition import ParamSlot, ShardingPolicy
from .unit import Unit


class ParamGroup:
    """Units of the model plus the reduction and update rules of a policy."""

    def __init__(self, units: list[Unit], policy: ShardingPolicy, comm: Comm) -> None:
        self.units = units
        self.policy = policy
        self.comm = comm
        self.boundary = True
        self.launched: list[Unit] = []
        self.transient_nbytes = 0
        self.peak_transient_nbytes = 0
        self.num_overlapped = 0  # reductions launched from gradient hooks, during backward
        self.last_num_overlapped = 0  # the same, for the last finished backward

    # ---- set-up -------------------------------------------------------------
    def setup_masters(self) -> list[tuple[int, torch.Tensor]]:
        """Allocates the owned gradient and fp32 master of every unit; returns
        (parameter index, master slice) pairs, the optimizer's parameters."""
        out = []
        for unit in self.units:
            plan, full_or_shard = unit.plan, unit.full if unit.full is not None else unit.shard
            if self.policy.shard_optimizer:
                unit.owned = plan.chunk(unit.rank)
                source = unit.shard
            else:
                source = full_or_shard
            numel = unit.owned[1] - unit.owned[0]
            if not self.policy.shard_grads:
                unit.grad = torch.zeros(plan.padded_numel, dtype=unit.shard.dtype)
                unit.grad_owned = unit.grad[unit.owned[0]:unit.owned[1]]
            else:
                unit.grad_owned = torch.zeros(numel, dtype=unit.shard.dtype)
            unit.master = source if source.dtype == torch.float32 else source.float()
            unit.master_views = []
            for slot, lo, hi in plan.owned_slices(*unit.owned):
                view = unit.master[lo - unit.owned[0]:hi - unit.owned[0]].requires_grad_()
                unit.master_views.append((view, lo - unit.owned[0], hi - unit.owned[0]))
                out.append((slot.index, view))
        return out

    def register_grad_hooks(self) -> list:
        handles = []
        for unit in self.units:
            for param, slot in zip(unit.params, unit.plan.slots):
                handles.append(param.register_post_accumulate_grad_hook(self._hook(unit, slot)))
        return handles

    # ---- backward ------------------------------------------------------------
    def _hook(self, unit: Unit, slot):
        def on_grad(param: nn.Parameter) -> None:
            self.add_grad(unit, slot, param)
        return on_grad

    def add_grad(self, unit: Unit, slot: ParamSlot, param: nn.Parameter) -> None:
        """Adds a parameter's gradient (pre-divided by world_size) to its bucket;
        launches the bucket's reduction once its last gradient arrived."""
        if unit.grad is None:
            self._new_bucket(unit)
        grad, scale, begin, end = param.grad.reshape(-1), 1.0 / self.comm.world_size, slot.begin, slot.end
        if unit.fresh:  # first write since the bucket was (re)started: no zeroing, no read
            torch.mul(grad, scale, out=unit.grad[begin:end])
        else:
            unit.grad[begin:end].add_(grad, alpha=scale)
        param.grad = None
        unit.num_ready += 1
        unit.written.add(slot.index)
        if unit.num_ready == len(unit.params) and self._reduce_now():
            self.start_reduce(unit)
            self.num_overlapped += 1

    def _new_bucket(self, unit: Unit) -> None:
        unit.grad = torch.empty(unit.plan.padded_numel, dtype=unit.shard.dtype)
        unit.grad[unit.plan.numel:].zero_()  # padding stays zero through every reduction
        unit.fresh = True
        self._track(unit.grad.nbytes)

    def _fill_unwritten(self, unit: Unit) -> None:
        """Zeroes the slots of parameters that got no gradient in a fresh bucket."""
        if unit.grad is None:
            self._new_bucket(unit)
        if unit.fresh:
            for slot in unit.plan.slots:
                if slot.index not in unit.written:
                    unit.grad[slot.begin:slot.end].zero_()

    def _reduce_now(self) -> bool:
        return self.policy.shard_grads or self.boundary

    def start_reduce(self, unit: Unit) -> None:
        if unit.reduction is not None:
            return
        if unit.num_ready < len(unit.params):  # parameters without a gradient this backward
            self._fill_unwritten(unit)
        if self.policy.shard_optimizer:
            begin, end = unit.plan.chunk(unit.rank)
            direct = self.policy.shard_grads and unit.owned_fresh  # reduce straight into the accumulator
            output = unit.grad_owned if direct else unit.grad[begin:end]
            unit.reduction = self.comm.reduce_scatter(output, unit.grad, async_op=True)
        else:
            unit.reduction = self.comm.all_reduce(unit.grad, async_op=True)
        self.launched.append(unit)
        if self.policy.shard_params:
            unit.reshard()

    def finish_backward(self) -> None:
        """After loss.backward(): reduces what no hook reduced, waits for every
        reduction, folds transient buckets into the owned accumulators."""
        self.last_num_overlapped, self.num_overlapped = self.num_overlapped, 0
        if self._reduce_now():
            for unit in self.units:
                self.start_reduce(unit)
        else:
            for unit in self.units:
                if unit.num_ready < len(unit.params):
                    self._fill_unwritten(unit)
        for unit in self.launched:
            unit.reduction.wait()
            unit.reduction = None
            if self.policy.shard_grads:
                if not unit.owned_fresh:
                    begin, end = unit.plan.chunk(unit.rank)
                    unit.grad_owned.add_(unit.grad[begin:end])
                unit.owned_fresh = False
                self._track(-unit.grad.nbytes)
                unit.grad = None
        self.launched = []
        for unit in self.units:
            unit.num_ready = 0
            unit.written.clear()
            unit.fresh = False
            unit.reshard()

    def _track(self, nbytes: int) -> None:
        self.transient_nbytes += nbytes
        self.peak_transient_nbytes = max(self.peak_transient_nbytes, self.transient_nbytes)

    # ---- step ------------------------------------------------------------------
    def owned_grads_fp32(self) -> list[torch.Tensor]:
        return [u.grad_owned if u.grad_owned.dtype == torch.float32 else u.grad_owned.float() for u in self.units]

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """Global L2 norm of the (still scaled) reduced gradients."""
        total = torch.zeros(1, dtype=torch.float64)
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
            if self.policy.shard_optimizer and unit.plan.resident:
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
                whole = torch.empty(unit.plan.padded_numel, dtype=torch.float32)
                self.comm.all_gather(whole, unit.master.contiguous()).wait()
            for slot, shape in zip(unit.plan.slots, unit.shapes):
                out[slot.index] = whole[slot.begin:slot.end].detach().clone().view(shape)
        self.comm.sent_nbytes = sent
        return [out[i] for i in sorted(out)]

    def zero_grads(self) -> None:
        """Starts a new accumulation window: the next writes overwrite (no memset)."""
        for unit in self.units:
            unit.fresh = True
            unit.owned_fresh = True
