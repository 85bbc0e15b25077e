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
The same rule holds at the other turn, from a backward to the next micro
step's forward within one gradient accumulation (the parameters do not change
until the optimizer step): the first units of the model are the last of
backward and the first of the next forward, so a prefix stays gathered. At an
accumulation boundary every bucket is released: the step changes them.
"""
from __future__ import annotations

from collections.abc import Sequence


def plan_forward_keeps(trace: Sequence[Sequence[int]], numels: Sequence[int], *, max_reuse_numel: int,
                       max_live_numel: int) -> tuple[frozenset[int], ...]:
    """For each forward call of `trace` (the buckets it uses), the buckets its
    post-forward keeps gathered; `numels[b]` is bucket b's size in elements."""
    return _keeps(list(trace), list(reversed(trace)), numels, max_reuse_numel, max_live_numel)


def plan_backward_keeps(trace: Sequence[Sequence[int]], numels: Sequence[int], *, max_reuse_numel: int,
                        max_live_numel: int) -> frozenset[int]:
    """The buckets a backward keeps gathered for the next micro step's forward
    (between micro steps of one accumulation, when the parameters do not
    change): those whose last use in backward (`trace` reversed) comes within
    the reuse distance of their first use in the next forward."""
    backward = list(reversed(trace))
    keeps = _keeps(backward, list(trace), numels, max_reuse_numel, max_live_numel)
    last = {bucket: i for i, use in enumerate(backward) for bucket in use}
    return frozenset(bucket for bucket, i in last.items() if bucket in keeps[i])


def _keeps(first: list[Sequence[int]], then: list[Sequence[int]], numels: Sequence[int], max_reuse_numel: int,
           max_live_numel: int) -> tuple[frozenset[int], ...]:
    """For each use of `first`, the buckets kept after it: the next use (in
    `first`, then in `then`) is within the reuse distance, and the kept total
    stays within max_live_numel, nearest to the turn first. One pass back over
    the uses finds every next use; prefix sums give the elements between."""
    uses = first + then
    before = [0]  # before[j]: elements of uses[:j]
    for use in uses:
        before.append(before[-1] + sum(numels[b] for b in use))
    next_use: list[dict[int, int]] = [{} for _ in first]  # per use of first: bucket -> position of its next use
    upcoming: dict[int, int] = {}
    for j in reversed(range(len(uses))):
        if j < len(first):
            next_use[j] = {b: upcoming[b] for b in uses[j] if b in upcoming}
        upcoming.update((b, j) for b in uses[j])
    kept: list[set[int]] = [set() for _ in first]
    live, held = 0, set()
    for i in reversed(range(len(first))):
        for bucket, j in next_use[i].items():
            if before[j] - before[i + 1] >= max_reuse_numel:
                continue
            if bucket not in held:
                if live + numels[bucket] > max_live_numel:
                    continue
                held.add(bucket)
                live += numels[bucket]
            kept[i].add(bucket)
    return tuple(frozenset(k) for k in kept)
