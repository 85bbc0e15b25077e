"""Stage 3 hooks on each gather unit (units.py): unshard a unit's bucket before
its forward and again before its backward, reshard after (unless the reuse
plan keeps it: [Note: reuse distance] in ringcomm/plan/gathers.py), and
prefetch the next bucket in the order recorded on the previous forward. The
hooks only call ParamGroup's verbs.

    forward:   pre(m_i): unshard(b_i), start_unshard(b_{i+1})  ...  post(m_i): reshard(b_i) or keep
    backward:  hook on m_i's output gradients: unshard(b_i), start_unshard(b_{i-1})
               last gradient of b_i (the scheduler): reduce-scatter, reshard(b_i) or keep
A unit may use several buckets (a tied weight lives in its first unit's
bucket): it gathers all of them.

[Note: saved weights]
Autograd saves the weights a module's backward needs (Linear: weight.t()),
views of the gathered bucket, so resharding after forward would free nothing
until backward and stage 3 would hold every gathered parameter at the end of
forward. Inside saved_weights(), a saved view of a gathered bucket is kept as
(bucket, offset, size, stride) instead and rebuilt on use from the bucket as
gathered again for backward (DeepSpeed's LinearFunctionForZeroStage3 does this
for Linear only).

[Note: recomputed forward]
A checkpointed unit runs its forward again inside backward (activation
checkpointing), with its hooks. Its backward then uses the parameters as that
recomputation left them, with no hook of its own in between when the unit is
a whole block, so the post-forward hook of a recomputation leaves the unit
gathered; the scheduler reshards it after its gradients, as for any unit.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ringcomm.core.compat import in_backward, tree_flatten
from ringcomm.plan.gathers import plan_backward_keeps, plan_forward_keeps

from .param_group import ParamGroup, ZeroBucket


def _dense(numels: dict[int, int]) -> list[int]:
    """{bucket index: numel} as a list indexed by bucket index (0 where none)."""
    dense = [0] * (max(numels, default=-1) + 1)
    for index, numel in numels.items():
        dense[index] = numel
    return dense


class SavedSlice(NamedTuple):
    """A saved tensor that is a view of a gathered bucket, by position."""

    bucket: ZeroBucket
    offset: int  # in elements, from the start of bucket.full
    size: torch.Size
    stride: tuple[int, ...]


class ModuleGatherer:
    """Owns the module -> buckets map (a module gathers the buckets of the
    parameters it uses: its own, and a tied weight's in its first module's
    bucket) and the forward order used for prefetch."""

    def __init__(self, module_buckets: dict[nn.Module, list[ZeroBucket]], group: ParamGroup, *, prefetch_numel: int,
                 max_live_numel: int, max_reuse_numel: int = 0) -> None:
        self.module_buckets = module_buckets
        self.buckets = list({id(b): b for bs in module_buckets.values() for b in bs}.values())
        self.group = group
        self.prefetch_numel = prefetch_numel  # stage3_prefetch_bucket_size
        self.max_live_numel = max_live_numel  # stage3_max_live_parameters
        self.max_reuse_numel = max_reuse_numel  # stage3_max_reuse_distance: [Note: reuse distance]
        self.calls: list[tuple[nn.Module, tuple[int, ...]]] = []  # this forward's unit calls, bucket indices each
        self.recorded: list[tuple[nn.Module, tuple[int, ...]]] = []  # the last forward's, which `keeps` plans
        self.keeps: tuple[frozenset[int], ...] = ()  # per recorded call: buckets its post-forward keeps gathered
        self.positions: list[int] = []  # the calls whose forward is running (units may nest)
        self.order: list[ZeroBucket] = []  # forward order of the last forward
        self.current: list[ZeroBucket] = []
        self.in_use: dict[int, int] = {}  # id(bucket) -> modules in forward using it (nested modules may share one)
        self.handles: list = []
        self.peak_live_nbytes = 0  # gathered buckets at once, the communication buffers of stage 3
        self.gathered: dict[int, ZeroBucket] = {}  # storage address -> a bucket gathered in this forward

    def register(self) -> None:
        for module in self.module_buckets:
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward))

    def start_forward(self) -> None:
        if self.current:
            self.order = self.current
        if self.calls and self.calls != self.recorded:
            self.recorded = self.calls
            numels = _dense({b.span.index: b.span.numel for b in self.buckets})
            trace, limits = [indices for _, indices in self.calls], {
                "max_reuse_numel": self.max_reuse_numel, "max_live_numel": self.max_live_numel}
            self.keeps = plan_forward_keeps(trace, numels, **limits)
            self.group.keep_after_backward = plan_backward_keeps(trace, numels, **limits)
        for bucket in self.buckets:  # kept or prefetched for a backward that did not come
            if bucket.span.index not in self.group.kept:
                self.group.reshard(bucket)
        self.group.kept = frozenset()
        self.calls, self.positions = [], []
        self.current = []
        self.in_use.clear()  # a forward that raised left its counts behind
        self.gathered.clear()

    def saved_weights(self) -> torch.autograd.graph.saved_tensors_hooks:
        """See [Note: saved weights]."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | SavedSlice:
        if tensor.layout != torch.strided:  # sparse and nested tensors have no storage to look up
            return tensor
        bucket = self.gathered.get(tensor.untyped_storage().data_ptr())
        full = bucket.full if bucket is not None else None
        if full is None or full.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr() \
                or full.dtype != tensor.dtype:  # resharded since, and the address reused
            return tensor
        return SavedSlice(bucket, tensor.storage_offset() - full.storage_offset(), tensor.size(), tensor.stride())

    def _unpack(self, saved: torch.Tensor | SavedSlice) -> torch.Tensor:
        if not isinstance(saved, SavedSlice):
            return saved
        if saved.bucket.full is None:  # used outside its module's backward
            self.group.unshard(saved.bucket, backward=True)
        full = saved.bucket.full
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    def _prefetch(self, bucket: ZeroBucket, direction: int) -> None:
        """Starts gathering the buckets after `bucket` in `direction` (+1 forward,
        -1 backward) of the recorded order: at least one, then more while they
        fit in prefetch_numel and the gathered total stays under max_live_numel."""
        if bucket not in self.order:
            self._note_live()
            return
        live = sum(b.span.numel for b in self.order if b.full is not None)
        fetched, i = 0, self.order.index(bucket) + direction
        while 0 <= i < len(self.order):
            nxt = self.order[i]
            numel = nxt.span.numel
            if fetched and (fetched + numel > self.prefetch_numel or live + numel > self.max_live_numel):
                break
            if nxt.full is None:
                self.group.start_unshard(nxt, backward=direction < 0)
                live += numel
            fetched += numel
            i += direction
        self._note_live()

    def _note_live(self) -> None:
        live = sum(b.full.nbytes for b in self.buckets if b.full is not None)
        self.peak_live_nbytes = max(self.peak_live_nbytes, live)

    def _unshard(self, buckets: list[ZeroBucket], direction: int) -> None:
        for bucket in buckets:
            self.group.unshard(bucket, backward=direction < 0)
        self._prefetch(buckets[-1], direction)

    @property
    def kept_nbytes(self) -> int:
        """Bytes the plan keeps gathered at the larger of its two turns, forward to
        backward and backward to the next forward ([Note: reuse distance])."""
        turns = (set().union(*self.keeps), self.group.keep_after_backward)  # forward -> backward -> forward
        return max(sum(b.span.numel * b.shard.element_size() for b in self.buckets if b.span.index in kept)
                   for kept in turns)

    def _keeps_at(self, position: int, module: nn.Module) -> frozenset[int]:
        """What the plan keeps after this call, if the forward follows the recorded one."""
        if position < len(self.recorded) and self.recorded[position][0] is module and torch.is_grad_enabled():
            return self.keeps[position]
        return frozenset()

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        buckets = self.module_buckets[module]
        if not in_backward():
            self.positions.append(len(self.calls))
            self.calls.append((module, tuple(b.span.index for b in buckets)))
        for bucket in buckets:
            if bucket not in self.current:
                self.current.append(bucket)
            self.in_use[id(bucket)] = self.in_use.get(id(bucket), 0) + 1
        self._unshard(buckets, +1)
        for bucket in buckets:
            if not bucket.span.resident:
                self.gathered[bucket.full.untyped_storage().data_ptr()] = bucket

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        buckets = self.module_buckets[module]
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward(buckets))
        recomputing = in_backward()  # see [Note: recomputed forward]
        keep = frozenset() if recomputing else self._keeps_at(self.positions.pop(), module)
        for bucket in buckets:
            self.in_use[id(bucket)] -= 1
            if not self.in_use[id(bucket)] and not recomputing and bucket.span.index not in keep:
                self.group.reshard(bucket)

    def _pre_backward(self, buckets: list[ZeroBucket]):
        def hook(grad: torch.Tensor) -> None:
            self._unshard(buckets, -1)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
