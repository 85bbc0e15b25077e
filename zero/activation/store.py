"""Where checkpointed inputs wait for backward: whole, on the host, partitioned
over the ranks that hold the same activation, or in preallocated slots; and the
all-gather that brings a partitioned input back.

[Note: which ranks partition an activation]
A checkpointed input can only be split across ranks that hold the same values:
the model-parallel group of an `mpu` (DeepSpeed's rule), where every rank runs
the same micro-batch. Under pure data parallelism each rank's activations are
its own, the group has one rank, and `partition_activations` keeps it whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..sharding.seam import Comm, Handle, make_comm
from .config import StoreOptions


class GroupComm(Comm):
    """all_gather over an mpu's model-parallel subgroup (torch.distributed)."""

    kind = "torch-subgroup"

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group

    def _all_gather(self, output, input, async_op):
        return dist.all_gather_into_tensor(output, input, group=self.group, async_op=async_op)


def partition_comm(mpu: object | None, device: torch.device) -> Comm | None:
    """The collectives of the ranks that share an activation (see the Note);
    None when that is this rank alone."""
    if mpu is None or not dist.is_initialized():
        return None
    if hasattr(mpu, "get_tensor_model_parallel_group"):
        group, world_size = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size()
    else:
        group, world_size = mpu.get_model_parallel_group(), mpu.get_model_parallel_world_size()
    if world_size == 1:
        return None
    if world_size == dist.get_world_size():
        return make_comm("ringcomm", device)  # the whole world: ringcomm's ring
    return GroupComm(group)


@dataclass(slots=True)
class Held:
    """One checkpointed input while it waits: `data` is the whole tensor, or
    this rank's chunk (`partitioned`), maybe on the host or in a slot."""

    data: torch.Tensor
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool
    slot: tuple[int, int] | None = None  # (argument index, slot index) in the contiguous buffers
    full: torch.Tensor | None = None  # the gathered flat tensor, while fetching
    handle: Handle | None = None

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(slots=True)
class SlotBuffers:
    """contiguous_memory_optimization: per argument position, one buffer of
    `num_slots` equal slots, allocated at the first checkpoint (the slot
    size is its input's stored numel: checkpoints must be alike)."""

    num_slots: int
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    free: dict[int, list[int]] = field(default_factory=dict)

    def take(self, position: int, flat: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        if position not in self.buffers:
            self.buffers[position] = torch.empty(self.num_slots, flat.numel(), dtype=flat.dtype, device=flat.device,
                                                 pin_memory=flat.device.type == "cpu" and torch.cuda.is_available())
            self.free[position] = list(range(self.num_slots - 1, -1, -1))
        buffer = self.buffers[position]
        if flat.numel() != buffer.shape[1] or flat.dtype != buffer.dtype:
            raise ValueError(f"activation_checkpointing.contiguous_memory_optimization: input {position} has "
                             f"{flat.numel()} {flat.dtype} elements to store, the slots hold {buffer.shape[1]} "
                             f"{buffer.dtype} (every checkpoint's inputs must have the same shapes)")
        if not self.free[position]:
            raise ValueError(f"activation_checkpointing.number_checkpoints ({self.num_slots}) is smaller than the "
                             f"number of checkpoints alive at once")
        index = self.free[position].pop()
        return buffer[index].copy_(flat), (position, index)

    def give_back(self, slot: tuple[int, int]) -> None:
        self.free[slot[0]].append(slot[1])

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class ActivationStore:
    """hold() at forward, start_fetch() / fetch() in backward (fetch waits for
    the gather and frees what was held)."""

    def __init__(self, options: StoreOptions, comm: Comm | None) -> None:
        self.options = options
        self.comm = comm if options.partition else None
        self.slots = SlotBuffers(options.num_slots) if options.contiguous else None
        self.checked = False  # the first partitioned input was compared across the group

    def hold(self, position: int, tensor: torch.Tensor) -> Held:
        value = tensor.detach()
        stored, partitioned = value, False
        if self.comm is not None:
            if not self.checked:
                self._check_replicated(value)
            stored, partitioned = self._chunk(value), True
        if self.options.cpu and stored.device.type != "cpu":  # one copy, straight into pinned memory
            stored = torch.empty(stored.shape, dtype=stored.dtype, pin_memory=True).copy_(stored)
        slot = None
        if self.slots is not None:
            stored, slot = self.slots.take(position, stored.reshape(-1))
        return Held(stored, value.shape, value.device, tensor.requires_grad, partitioned, slot)

    def _check_replicated(self, value: torch.Tensor) -> None:
        """Once per store: every rank of the group holds this same input (see
        the Note), else the gathered inputs would mix ranks' activations."""
        mine = torch.stack([value.double().sum(), value.double().abs().sum()]).to(value.device)
        every = torch.empty(2 * self.comm.world_size, dtype=torch.float64, device=value.device)
        self.comm.all_gather(every, mine).wait()
        rows = every.view(-1, 2)
        differ = [r for r in range(self.comm.world_size) if not torch.equal(rows[r], rows[self.comm.rank])]
        if differ:
            raise ValueError(f"activation_checkpointing.partition_activations: rank {self.comm.rank}'s checkpointed "
                             f"input differs from that of group ranks {differ}; partitioning needs the same "
                             "activations on every rank of the mpu's model-parallel group")
        self.checked = True

    def _chunk(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the flattened input, the last one zero-padded."""
        world_size, rank = self.comm.world_size, self.comm.rank
        flat = value.reshape(-1)
        chunk_numel = -(-flat.numel() // world_size)
        begin = min(rank * chunk_numel, flat.numel())
        piece = flat[begin:begin + chunk_numel]
        chunk = torch.zeros(chunk_numel, dtype=flat.dtype, device=flat.device)
        chunk[:piece.numel()].copy_(piece)
        return chunk

    def start_fetch(self, held: Held) -> None:
        """Starts the all-gather of a partitioned input (a no-op otherwise)."""
        if not held.partitioned or held.full is not None:
            return
        chunk = held.data.to(held.device)
        held.full = torch.empty(chunk.numel() * self.comm.world_size, dtype=chunk.dtype, device=held.device)
        held.handle = self.comm.all_gather(held.full, chunk, async_op=True)

    def fetch(self, held: Held) -> torch.Tensor:
        """The whole input on its device, detached; what was held is freed."""
        if held.partitioned:
            self.start_fetch(held)
            held.handle.wait()
            numel = held.shape.numel()
            value = held.full[:numel].view(held.shape)
        else:
            value = held.data.to(held.device)
            if held.slot is not None and value.data_ptr() == held.data.data_ptr():
                value = value.clone()  # the slot is reused by the next checkpoint
            value = value.view(held.shape)
        self.release(held)
        return value

    def release(self, held: Held) -> None:
        if held.slot is not None:
            self.slots.give_back(held.slot)
            held.slot = None
        held.data = torch.empty(0, dtype=held.data.dtype)
        held.full, held.handle = None, None
