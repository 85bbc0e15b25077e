"""Pure tier: the ring plans, simulated for world sizes 1..8 without processes."""
from __future__ import annotations


import pytest

from ringcomm.plan import schedule


@pytest.mark.parametrize("world_size", range(1, 9))
def test_chunk_bounds_cover_evenly(world_size):
    for numel in [0, 1, 2, 3, 7, 8, 13, 64, 97, 1000]:
        chunks = schedule.chunk_bounds(numel, world_size)
        assert len(chunks) == world_size
        assert chunks[0].begin == 0 and chunks[-1].end == numel, (numel, world_size, chunks)
        for a, b in zip(chunks, chunks[1:]):
            assert a.end == b.begin, (numel, world_size, chunks)
        sizes = [c.numel for c in chunks]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), (numel, world_size, sizes)


def test_segments_cut_chunk_exactly():
    for begin, numel, segment_numel in [(0, 0, 4), (5, 1, 4), (3, 17, 4), (0, 16, 4), (10, 100, 1), (0, 7, 100)]:
        pieces = schedule.segments(schedule.Span(begin, numel), segment_numel)
        covered = [i for p in pieces for i in range(p.begin, p.end)]
        assert covered == list(range(begin, begin + numel)), (begin, numel, segment_numel)
        assert all(0 < p.numel <= segment_numel for p in pieces)
    with pytest.raises(ValueError):
        schedule.segments(schedule.Span(0, 4), 0)


@pytest.mark.parametrize("world_size", range(1, 9))
def test_ring_reduce_scatter_simulated(world_size):
    # contributions[r][c]: the set of ranks whose data rank r's copy of chunk c includes.
    contributions = [[{r} for _ in range(world_size)] for r in range(world_size)]
    plans = [schedule.reduce_scatter_steps(r, world_size) for r in range(world_size)]
    assert all(len(p) == world_size - 1 for p in plans)
    for step in range(world_size - 1):
        messages = {}
        for r in range(world_size):
            plan = plans[r][step]
            messages[schedule.right(r, world_size)] = (plan.send_chunk, set(contributions[r][plan.send_chunk]))
        for r in range(world_size):
            chunk, data = messages[r]
            assert chunk == plans[r][step].recv_chunk, f"rank {r} step {step}: left sent {chunk}"
            assert not data & contributions[r][chunk], f"rank {r} step {step}: a contribution counted twice"
            contributions[r][chunk] |= data
    for r in range(world_size):
        assert contributions[r][r] == set(range(world_size)), f"rank {r} chunk {r}: {contributions[r][r]}"


@pytest.mark.parametrize("world_size", range(1, 9))
def test_ring_all_gather_simulated(world_size):
    have = [{r} for r in range(world_size)]
    plans = [schedule.all_gather_steps(r, world_size) for r in range(world_size)]
    for step in range(world_size - 1):
        messages = {}
        for r in range(world_size):
            plan = plans[r][step]
            assert plan.send_chunk in have[r], f"rank {r} step {step} forwards chunk {plan.send_chunk} it lacks"
            messages[schedule.right(r, world_size)] = plan.send_chunk
        for r in range(world_size):
            assert messages[r] == plans[r][step].recv_chunk
            have[r].add(messages[r])
    assert all(h == set(range(world_size)) for h in have)


def test_bad_arguments():
    with pytest.raises(ValueError):
        schedule.chunk_bounds(-1, 2)
    with pytest.raises(ValueError):
        schedule.chunk_bounds(4, 0)
    with pytest.raises(ValueError):
        schedule.reduce_scatter_steps(3, 3)
