"""Pure plans of ZeRO sharding: what a stage shards (ShardingPolicy) and how
parameters are laid out in units (buckets) whose chunk r is rank r's shard.
Standard library only."""
from __future__ import annotations

from dataclasses import dataclass

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, slots=True)
class ShardingPolicy:
    """A ZeRO stage as data: which model states are split across ranks."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @classmethod
    def for_stage(cls, stage: int) -> ShardingPolicy:
        if stage not in STAGES:
            raise ValueError(f"zero_optimization.stage: {stage!r} is not one of {STAGES}")
        return cls(shard_optimizer=stage >= 1, shard_grads=stage >= 2, shard_params=stage >= 3)

    @property
    def stage(self) -> int:
        return int(self.shard_optimizer) + int(self.shard_grads) + int(self.shard_params)


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Parameter `index` lives at elements [begin, begin + numel) of its unit."""

    index: int
    begin: int
    numel: int

    @property
    def end(self) -> int:
        return self.begin + self.numel


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """One unit: a bucket of parameters communicated together, padded to
    world_size chunks of chunk_numel elements. `resident` units keep their full
    parameters between steps; the others hold only their chunk (stage 3)."""

    slots: tuple[ParamSlot, ...]
    chunk_numel: int
    world_size: int
    resident: bool

    @property
    def padded_numel(self) -> int:
        return self.chunk_numel * self.world_size

    @property
    def numel(self) -> int:
        return sum(slot.numel for slot in self.slots)

    def chunk(self, rank: int) -> tuple[int, int]:
        """[begin, end) of rank's chunk."""
        return rank * self.chunk_numel, (rank + 1) * self.chunk_numel

    def owned_slices(self, begin: int, end: int) -> tuple[tuple[ParamSlot, int, int], ...]:
        """(slot, lo, hi) for each parameter overlapping [begin, end): elements
        lo..hi of the unit, which are elements lo-slot.begin.. of the parameter."""
        out = []
        for slot in self.slots:
            lo, hi = max(begin, slot.begin), min(end, slot.end)
            if lo < hi:
                out.append((slot, lo, hi))
        return tuple(out)


def make_unit(indices: list[int], numels: list[int], world_size: int, resident: bool) -> UnitPlan:
    """Lays parameters `indices` (with `numels`) back to back and pads the unit
    to a multiple of world_size (at least one element per chunk)."""
    if world_size < 1:
        raise ValueError(f"make_unit: {world_size=} must be >= 1")
    slots, offset = [], 0
    for index, numel in zip(indices, numels):
        slots.append(ParamSlot(index, offset, numel))
        offset += numel
    chunk_numel = max(1, -(-offset // world_size))
    return UnitPlan(tuple(slots), chunk_numel, world_size, resident)


def module_units(groups: list[list[int]], numels: list[int], world_size: int,
                 persistence_threshold: int) -> tuple[UnitPlan, ...]:
    """Stage 3 units: one per module (its direct parameters, `groups`), minus
    parameters smaller than persistence_threshold and parameters of several
    modules (tied weights: no single module's hooks can own them), which go to
    one resident unit at the end."""
    owners: dict[int, int] = {}
    for group in groups:
        for i in group:
            owners[i] = owners.get(i, 0) + 1
    units, persistent = [], []
    for group in groups:
        sharded = [i for i in group if numels[i] >= persistence_threshold and owners[i] == 1]
        persistent.extend(i for i in group if i not in sharded and i not in persistent)
        if sharded:
            units.append(make_unit(sharded, [numels[i] for i in sharded], world_size, False))
    if persistent:
        units.append(make_unit(persistent, [numels[i] for i in persistent], world_size, True))
    return tuple(units)


def wire_numel(kind: str, numel: int, world_size: int) -> int:
    """Elements one rank sends for a ring collective over `numel` elements
    (all_reduce = reduce-scatter + all-gather)."""
    if world_size <= 1:
        return 0
    per_phase = numel * (world_size - 1) // world_size
    if kind == "all_reduce":
        return 2 * per_phase
    if kind in ("reduce_scatter", "all_gather", "broadcast"):
        return per_phase if kind != "broadcast" else numel
    raise ValueError(f"wire_numel: unknown collective {kind!r}")
