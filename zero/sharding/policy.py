"""Pure rules of ZeRO sharding, the stage table: what each stage shards
(ShardingPolicy) and how many ring phases a step's traffic takes. The buckets
themselves are planned by ringcomm.plan.layout. Standard library only."""
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

    @property
    def ring_phases(self) -> int:
        """Ring phases of one step's traffic ([Note: ring volume] in
        ringcomm/plan/schedule.py): the gradients' reduce-scatter and the
        parameters' all-gather (stage 0's all_reduce is both), the all-gather
        twice at stage 3 (for forward, and again for backward)."""
        return 3 if self.shard_params else 2
