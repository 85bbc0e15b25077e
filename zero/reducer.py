"""BucketReducer: how the gradients of one backward reach the owned shards
(any comm backend, every stage). Post-accumulate-grad hooks copy each gradient
into its unit's bucket and launch the unit's reduce-scatter (or all-reduce at
stage 0) once its last gradient arrived, overlapped with the rest of backward.
Stages 2-3 use transient buckets that fold into a chunk-sized accumulator every
micro-step; stages 0-1 keep whole buckets and reduce at the accumulation boundary.
"""
from __future__ import annotations

import torch
from torch import nn

from ringcomm.schedule import Span

from .comm import Comm
from .partition import ShardingPolicy
from .unit import Unit


class BucketReducer:
    """See the module docstring. After backward() each unit's reduced gradient
    is in grad_owned (at an accumulation boundary; stages 2-3 every micro-step)."""

    def __init__(self, units: list[Unit], policy: ShardingPolicy, comm: Comm, launch_order: list[Unit]) -> None:
        self.units = units
        self.policy = policy
        self.comm = comm
        self.launch_order = launch_order  # see [Note: launch order]
        self.next_launch = 0
        self.boundary = True
        self.handles: list = []
        self.launched: list[Unit] = []
        self.transient_nbytes = 0
        self.peak_transient_nbytes = 0
        self.num_overlapped = 0  # reductions launched from gradient hooks, during backward
        self.last_num_overlapped = 0  # the same, for the last finished backward

    def register(self) -> None:
        for unit in self.units:
            for index, param, span in zip(unit.indices, unit.params, unit.spans):
                self.handles.append(param.register_post_accumulate_grad_hook(self._hook(unit, index, span)))

    def backward(self, scaled_loss: torch.Tensor, boundary: bool) -> None:
        self.boundary = boundary
        scaled_loss.backward()
        self.finish_backward()

    def _hook(self, unit: Unit, index: int, span: Span):
        def on_grad(param: nn.Parameter) -> None:
            self.add_grad(unit, index, span, param)
        return on_grad

    def add_grad(self, unit: Unit, index: int, span: Span, param: nn.Parameter) -> None:
        """Adds a parameter's gradient (pre-divided by world_size) to its bucket;
        launches the bucket's reduction once its last gradient arrived."""
        if unit.grad is None:
            self._new_bucket(unit)
        grad, scale, begin, end = param.grad.reshape(-1), 1.0 / self.comm.world_size, span.begin, span.end
        if unit.fresh:  # first write since the bucket was (re)started: no zeroing, no read
            torch.mul(grad, scale, out=unit.grad[begin:end])
        else:
            unit.grad[begin:end].add_(grad, alpha=scale)
        param.grad = None
        unit.num_ready += 1
        unit.written.add(index)
        if unit.num_ready == len(unit.params) and self._reduce_now():
            self._launch_ready()

    def _launch_ready(self) -> None:
        """[Note: launch order] Every rank must issue the same collectives in the
        same order, so units launch in the fixed `launch_order` (their expected
        gradient-ready order), a unit only once all units before it launched;
        never in the order gradients happen to arrive on this rank."""
        while self.next_launch < len(self.launch_order):
            unit = self.launch_order[self.next_launch]
            if unit.num_ready < len(unit.params):
                return
            self.start_reduce(unit)
            self.next_launch += 1
            self.num_overlapped += 1

    def _new_bucket(self, unit: Unit) -> None:
        unit.grad = torch.empty(unit.bucket.numel, dtype=unit.shard.dtype, device=unit.shard.device)
        unit.grad[unit.bucket.data_numel:].zero_()  # padding stays zero through every reduction
        unit.fresh = True
        self._track(unit.grad.nbytes)

    def _fill_unwritten(self, unit: Unit) -> None:
        """Zeroes the slots of parameters that got no gradient in a fresh bucket."""
        if unit.grad is None:
            self._new_bucket(unit)
        if unit.fresh:
            for index, span in zip(unit.indices, unit.spans):
                if index not in unit.written:
                    unit.grad[span.begin:span.end].zero_()

    def _reduce_now(self) -> bool:
        return self.policy.shard_grads or self.boundary

    def start_reduce(self, unit: Unit) -> None:
        if unit.reduction is not None:
            return
        if unit.num_ready < len(unit.params):  # parameters without a gradient this backward
            self._fill_unwritten(unit)
        if self.policy.shard_optimizer:
            chunk = unit.bucket.local_chunk(unit.rank)
            direct = self.policy.shard_grads and unit.owned_fresh  # reduce straight into the accumulator
            output = unit.grad_owned if direct else unit.grad[chunk.begin:chunk.end]
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
            for unit in self.launch_order[self.next_launch:]:
                self.start_reduce(unit)
            self.next_launch = 0
        else:
            for unit in self.units:
                if unit.num_ready < len(unit.params):
                    self._fill_unwritten(unit)
        for unit in self.launched:
            unit.reduction.wait()
            unit.reduction = None
            if self.policy.shard_grads:
                if not unit.owned_fresh:
                    chunk = unit.bucket.local_chunk(unit.rank)
                    unit.grad_owned.add_(unit.grad[chunk.begin:chunk.end])
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

    def zero_grads(self) -> None:
        """Starts a new accumulation window: the next writes overwrite (no memset)."""
        for unit in self.units:
            unit.fresh = True
            unit.owned_fresh = True
