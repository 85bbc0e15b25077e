"""Which gathered buckets a ZeRO stage-3 forward keeps for backward: the
release half of DeepSpeed's `stage3_max_reuse_distance` and
`stage3_max_live_parameters`, as data. Standard library only.

[Note: reuse distance]
A step's trace of uses is the forward's unit calls, in order, then the same
calls reversed (each unit's backward). After the forward call at position i,
a bucket it used is released unless its next use in that trace comes before
`max_reuse_numel` elements of other uses have gone by (DeepSpeed's rule: the
elements of every use in between are summed, repeats included). The last
units of forward are reused first by backward, so a suffix of forward is kept
gathered across the turn: with DeepSpeed's default (1e9) a small model keeps
everything, a big one its last ~1e9 elements, and 0 releases every bucket.
The buckets kept at once are bounded by `max_live_numel`, the nearest to the
turn first: a bucket that would go over it is released.
"""
from __future__ import annotations

from collections.abc import Sequence


def plan_forward_keeps(trace: Sequence[Sequence[int]], numels: Sequence[int], *, max_reuse_numel: int,
                       max_live_numel: int) -> tuple[frozenset[int], ...]:
    """For each forward call of `trace` (the buckets it uses), the buckets its
    post-forward keeps gathered; `numels[b]` is bucket b's size in elements."""
    n = len(trace)
    uses = list(trace) + list(reversed(trace))  # forward, then backward
    use_numels = [sum(numels[b] for b in use) for use in uses]
    kept: list[set[int]] = [set() for _ in range(n)]
    live, held = 0, set()
    for i in reversed(range(n)):  # nearest to the turn first, for max_live_numel
        for bucket in dict.fromkeys(trace[i]):
            distance = _distance_to_next_use(uses, use_numels, i, bucket)
            if distance is None or distance >= max_reuse_numel:
                continue
            if bucket not in held and live + numels[bucket] > max_live_numel:
                continue
            if bucket not in held:
                held.add(bucket)
                live += numels[bucket]
            kept[i].add(bucket)
    return tuple(frozenset(k) for k in kept)


def _distance_to_next_use(uses: list[Sequence[int]], use_numels: list[int], i: int, bucket: int) -> int | None:
    """Elements of the uses strictly between position i and the next use of
    `bucket` (None: no next use)."""
    distance = 0
    for j in range(i + 1, len(uses)):
        if bucket in uses[j]:
            return distance
        distance += use_numels[j]
    return None
