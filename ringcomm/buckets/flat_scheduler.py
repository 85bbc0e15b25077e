"""The DDP-style scheduler: flat gradient buffers (ringcomm.flat_buffers) whose
`.grad` are views of the buffers, reduced bucket by bucket as backward fills
them (the shared launching is overlap.BucketLauncher)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.collectives import all_reduce, broadcast, reduce_scatter
from ..comm.group import Group
from ..comm.registry import resolve_group
from ..comm.work import Work
from ..core.ops import ReduceOp, to_reduce_op
from .buffer import FlatBuffer, GradBucket
from .overlap import BucketLauncher

Slot = tuple[int, int]  # (buffer index, parameter index in that buffer)


class GroupCollectives:
    """A ringcomm Group with a fixed reduce op, as Collectives."""

    def __init__(self, group: Group, op: ReduceOp) -> None:
        self.group, self.op = group, op
        self.rank, self.world_size = group.rank, group.world_size

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Work:
        return all_reduce(tensor, self.op, self.group, async_op) or Work.completed("all_reduce", self.rank)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        return (reduce_scatter(output, input, self.op, self.group, async_op)
                or Work.completed("reduce_scatter", self.rank))


class BucketScheduler(BucketLauncher):
    """Launches each bucket of `buffers` as soon as its gradients are ready (see
    BucketLauncher); zero_grad() zeroes the buffers and keeps every `.grad` bound."""

    def __init__(self, buffers: Sequence[FlatBuffer], group: Group | None = None, *, mode: str = "reduce_scatter",
                 op: object = ReduceOp.AVG, overlap: bool = True, find_unused_parameters: bool = False,
                 timeout_s: float | None = None) -> None:
        if len({b.device.type for b in buffers}) > 1:
            raise ValueError(f"BucketScheduler: buffers on {[str(b.device) for b in buffers]}: use one scheduler per "
                             f"device type")
        group = resolve_group(group, "BucketScheduler")
        for buffer in buffers:
            if buffer.world_size != group.world_size:
                raise ValueError(f"BucketScheduler: {buffer} was laid out for world_size {buffer.world_size}, "
                                 f"the group has {group.world_size} (rank {group.rank})")
        self.group = group
        self.buffers = list(buffers)
        collectives = GroupCollectives(group, to_reduce_op(op, where="BucketScheduler"))
        super().__init__(self._buffer_buckets(), collectives, mode=mode, overlap=overlap, bind_grads=True,
                         find_unused_parameters=find_unused_parameters,
                         timeout_s=timeout_s if timeout_s is not None else group.transport.timeout_s + 5.0)

    def _buffer_buckets(self) -> list[GradBucket]:
        return [GradBucket(buffer.layout, k, [buffer.params[i] for i in span.param_indices], self.group.rank,
                           persistent=buffer.bucket_view(k)) for buffer in self.buffers for k, span in
                enumerate(buffer.layout.buckets)]

    def rebuild_buckets(self) -> None:
        """Collective: re-lays out every buffer in rank 0's ready order of the last
        synchronized step (allocates new buffers: call it once, after the first
        step, before an optimizer captures views)."""
        ids = {id(p): n for n, p in enumerate(self._params)}
        seen = [ids[id(p)] for p in self._last_observed]
        seen += [n for n in range(len(self._params)) if n not in set(seen)]
        order = torch.tensor(seen, dtype=torch.int64)
        broadcast(order, 0, self.group)
        observed = [self._params[n] for n in order.tolist()]
        for buffer in self.buffers:
            members = {id(p) for p in buffer.params}
            buffer.reorder([buffer.index_of(p) for p in observed if id(p) in members])
        self.buckets = self._buffer_buckets()
        self._index_params()
        self._launch_order = self._plan_launch_order(observed)
        self._reset_step()

    def zero_grad(self) -> None:
        """Starts a new accumulation window: zeroes the buffers, every `.grad` stays bound."""
        for buffer in self.buffers:
            buffer.zero_grad()
        super().zero_grad()

    def observed_order(self) -> list[Slot]:
        """(buffer, param) slots in the order the last synchronized step marked them ready."""
        slots = {id(p): (b, i) for b, buffer in enumerate(self.buffers) for i, p in enumerate(buffer.params)}
        return [slots[id(p)] for p in self._last_observed]
