"""Pure rules of ZeRO sharding: what a stage shards (ShardingPolicy) and the
ring volume of each collective. The buckets themselves are planned by
ringcomm.layout. Standard library only."""
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
