"""Pure tests of ringcomm.plan.layout: bucket plans, owner-aligned chunks, shards."""
from __future__ import annotations

import random

import pytest

from ringcomm.plan.layout import plan_buckets

CASES = [
    [],
    [0],
    [1],
    [7, 0, 13, 1, 1, 4096, 3],
    [5] * 11,
    [0, 0, 3, 0],
]


def _check_invariants(numels: list[int], world_size: int, bucket_numel: int, first: int | None, case: str) -> None:
    layout = plan_buckets(numels, world_size=world_size, bucket_numel=bucket_numel, first_bucket_numel=first)
    assert layout.order == tuple(range(len(numels) - 1, -1, -1)), case
    covered = []
    offset = 0
    for k, bucket in enumerate(layout.buckets):
        assert bucket.index == k and bucket.begin == offset, case
        assert bucket.numel == bucket.chunk_numel * world_size, f"{case}: bucket {k} not divisible"
        assert bucket.numel - bucket.data_numel < world_size, f"{case}: bucket {k} over-padded"
        slots = [layout.params[i] for i in bucket.param_indices]
        assert sum(s.numel for s in slots) == bucket.data_numel, case
        position = bucket.begin
        for slot in slots:
            assert slot.bucket == k and slot.begin == position, f"{case}: param {slot.index} misplaced"
            position += slot.numel
        capacity = first if (first is not None and k == 0) else bucket_numel
        nonzero = [s.numel for s in slots if s.numel > 0]
        if len(nonzero) > 1:  # a bucket is closed once it reaches its capacity
            assert bucket.data_numel - nonzero[-1] < capacity, f"{case}: bucket {k} overfull"
        covered += bucket.param_indices
        offset = bucket.end
    assert layout.numel == offset and sorted(covered) == list(range(len(numels))), case
    shards = [layout.shard(r) for r in range(world_size)]
    for k, bucket in enumerate(layout.buckets):
        assert [shards[r][k].begin for r in range(world_size)] == [bucket.begin + r * bucket.chunk_numel
                                                                   for r in range(world_size)], case
    for index, numel in enumerate(numels):  # the param shards of all ranks tile the param exactly
        pieces = sorted((layout.param_shard(index, r).begin, layout.param_shard(index, r).numel)
                        for r in range(world_size) if layout.param_shard(index, r).numel)
        assert sum(n for _, n in pieces) == numel, f"{case}: param {index} shards {pieces}"
        assert all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:])), f"{case}: param {index} {pieces}"
    assert layout.shard_numel() * world_size == layout.numel, case


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_invariants(world_size: int) -> None:
    rng = random.Random(world_size)
    cases = CASES + [[rng.choice([0, 1, 2, 3, 17, 64, 1000]) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    for numels in cases:
        for bucket_numel in (1, 2, 7, 64, 10_000):
            for first in (None, 1, 5):
                _check_invariants(numels, world_size, bucket_numel, first, f"{numels} ws={world_size} "
                                                                         f"bucket={bucket_numel} first={first}")


def test_one_element_buckets_give_one_bucket_per_param() -> None:
    layout = plan_buckets([3, 1, 2], world_size=2, bucket_numel=1)
    assert [b.param_indices for b in layout.buckets] == [(2,), (1,), (0,)]
    assert [b.numel for b in layout.buckets] == [2, 2, 4]


def test_bucket_larger_than_model_is_one_bucket() -> None:
    layout = plan_buckets([3, 1, 2], world_size=4, bucket_numel=1 << 30)
    assert len(layout.buckets) == 1 and layout.buckets[0].numel == 8 and layout.buckets[0].chunk_numel == 2


def test_first_bucket_is_smaller() -> None:
    layout = plan_buckets([4] * 8, world_size=1, bucket_numel=16, first_bucket_numel=4)
    assert [len(b.param_indices) for b in layout.buckets] == [1, 4, 3]


def test_custom_order_and_errors() -> None:
    layout = plan_buckets([1, 2, 3], world_size=1, bucket_numel=100, order=[1, 0, 2])
    assert [layout.params[i].begin for i in range(3)] == [2, 0, 3]
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets([1, 2, 3], world_size=1, bucket_numel=100, order=[0, 0, 1])
    with pytest.raises(ValueError, match="bucket_numel=0"):
        plan_buckets([1], world_size=1, bucket_numel=0)
    with pytest.raises(ValueError, match="world_size=0"):
        plan_buckets([1], world_size=0, bucket_numel=1)
    with pytest.raises(ValueError, match="rank=2"):
        plan_buckets([1], world_size=2, bucket_numel=1).shard(2)


@pytest.mark.parametrize("world_size", range(1, 9))
def test_group_plans_cover_every_parameter_once(world_size: int) -> None:
    from ringcomm.plan.layout import Span, plan_groups, plan_module_buckets

    numels = [0, 1, 7, 13, 1000, 3, 64, 5]  # awkward: empty, primes, bigger than a bucket
    stage3, uses = plan_module_buckets([[0, 1], [2, 3, 4], [5], [6, 7]], numels, world_size=world_size,
                                        persistence_threshold=6)
    for layout in (plan_buckets(numels, world_size=world_size, bucket_numel=50), stage3,
                   plan_groups(numels, [[3, 1], [0, 2, 4, 5, 6, 7]], world_size=world_size)):
        seen = sorted(i for bucket in layout.buckets for i in bucket.param_indices)
        assert seen == list(range(len(numels))), f"{world_size=}: {seen}"
        for bucket in layout.buckets:
            assert bucket.numel % world_size == 0 and bucket.numel >= bucket.data_numel, f"{world_size=} {bucket}"
            owned = [layout.local_slices(bucket.index, bucket.local_chunk(r)) for r in range(world_size)]
            assert sum(local.numel for o in owned for _, local, _ in o) == bucket.data_numel, f"{world_size=} {bucket}"
            for o in owned:
                for index, local, in_param in o:
                    assert local.begin - layout.local(index).begin == in_param.begin, f"{world_size=} {index}"
    assert [b.resident for b in stage3.buckets] == [False, False, True], "module [0, 1] is all below the threshold"
    assert sorted(stage3.buckets[-1].param_indices) == [0, 1, 5, 7], "params up to the threshold stay resident"
    assert uses == ((), (0,), (), (1,)), uses
    tied, uses = plan_module_buckets([[0, 2], [1, 2]], [5, 6, 7], world_size=world_size,
                                     persistence_threshold=0)
    assert [sorted(b.param_indices) for b in tied.buckets] == [[0, 2], [1]], "a tied parameter is sharded once"
    assert not any(b.resident for b in tied.buckets) and uses == ((0,), (1, 0)), uses
    assert plan_module_buckets([[0]], [6], world_size=2, persistence_threshold=6).layout.buckets[0].resident, \
        "DeepSpeed keeps parameters of numel <= threshold whole"
    assert plan_groups([10], [[0]], world_size=4).buckets[0].numel == 12
    assert stage3.local(4) == Span(stage3.params[4].begin - stage3.buckets[stage3.params[4].bucket].begin, 1000)
    with pytest.raises(ValueError, match="once"):
        plan_groups([1, 2], [[0]], world_size=2)
