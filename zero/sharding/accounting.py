"""Per-rank model-state bytes: parameters, gradients, optimizer states, and the
communication buffers (transient buckets and gathered units) apart."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .param_group import ParamGroup


@dataclass(frozen=True, slots=True)
class MemoryReport:
    params_nbytes: int
    grads_nbytes: int
    optimizer_nbytes: int  # fp32 master weights (when not the parameters) + optimizer states
    comm_buffer_nbytes: int  # peaks of transient gradient buckets + of gathered stage 3 units
    checkpoint_nbytes: int = 0  # activation side: peak of checkpointed inputs held (zero.checkpointing)
    # stage 3: what the persistent parameters (stage3_param_persistence_threshold) hold whole beyond the
    # shard that params_nbytes counts, so params + grads + optimizer is the paper's 16 psi / N
    persistent_params_nbytes: int = 0
    # where the model states are: on the model's device, in host memory (offloaded,
    # plus NVMe staging buffers), in NVMe swap files. On a CPU-only machine the
    # device is host memory too: offloaded states count as host, the rest as device.
    device_nbytes: int = 0
    host_nbytes: int = 0
    disk_nbytes: int = 0
    # hpZ (zero_hpz_partition_size): the secondary partition, 1/size of every gathered bucket, held from a
    # bucket's forward to the step; part of the comm side, not of the model states' 16 psi / N
    secondary_params_nbytes: int = 0
    # stage 3: the gathered units a forward keeps for its backward ([Note: reuse distance] in
    # ringcomm/plan/gathers.py: stage3_max_reuse_distance, stage3_max_live_parameters); part of comm_buffer_nbytes
    kept_gathered_nbytes: int = 0
    # the in-memory snapshots' shared memory (/dev/shm) this rank's files hold: its pieces and its buddy
    # copies of the last two steps (zero/checkpoint/snapshot.py; zero.estimate's snapshot_nbytes)
    snapshot_nbytes: int = 0

    @property
    def model_state_nbytes(self) -> int:
        return self.params_nbytes + self.grads_nbytes + self.optimizer_nbytes + self.persistent_params_nbytes


class _Storages:
    """Counts each storage once (views of one buffer share it)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def nbytes(self, tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.filename is not None:  # a snapshot's file ([Note: moments in the own piece]): the tensor's bytes
                total += t.nbytes
                continue
            if storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total


def memory_report(group: ParamGroup, optimizer: torch.optim.Optimizer, gathered_nbytes: int = 0,
                  kept_nbytes: int = 0) -> MemoryReport:
    """Measured between steps (stage 3 units resharded, no transient buckets)."""
    storages = _Storages()
    params = storages.nbytes(b.full if b.span.resident else b.shard for b in group.buckets)
    persistent = 0
    if group.policy.shard_params:  # resident buckets hold their parameters whole: count a shard, the rest apart
        persistent = sum((b.span.numel - b.shard.numel()) * b.shard.element_size()
                         for b in group.buckets if b.span.resident)
        params -= persistent
    persistent_grads = [b.grads.accumulator if group.policy.shard_grads else b.grads.grad for b in group.buckets]
    grads = storages.nbytes(persistent_grads)
    on_host = storages.nbytes(t for b in group.buckets if group.offloaded(b) for t in _optimizer_tensors(b, optimizer))
    on_device = storages.nbytes(t for b in group.buckets if not group.offloaded(b)
                                for t in _optimizer_tensors(b, optimizer))
    disk, staging = group.disk_nbytes(), group.offload_host_nbytes()
    secondary = 0 if group.secondary is None else sum(
        b.span.numel // group.secondary.size * b.shard.element_size() for b in group.buckets if not b.span.resident)
    return MemoryReport(params, grads, on_host + on_device, group.scheduler.peak_transient_nbytes + gathered_nbytes,
                        persistent_params_nbytes=persistent, device_nbytes=params + persistent + grads + on_device,
                        host_nbytes=on_host + staging, disk_nbytes=disk, secondary_params_nbytes=secondary,
                        kept_gathered_nbytes=kept_nbytes)


def _optimizer_tensors(bucket, optimizer: torch.optim.Optimizer):
    """The bucket's fp32 master and the optimizer states of its slices."""
    yield bucket.master
    for view, _, _ in bucket.master_views:
        for t in optimizer.state.get(view, {}).values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                yield t
