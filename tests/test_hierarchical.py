"""Hierarchical transport: 4 ranks as simulated hosts (RINGCOMM_HOST), against
torch.distributed gloo on the same random data; auto's choice; a dead peer."""
from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ringcomm
from harness import run_ranks
from ringcomm import ReduceOp
from test_collectives import (DTYPES, SMALL_CMA, SMALL_TORCH_DIST, assert_bf16_rounds_once, assert_close,
                              check_moves, gloo_reduce, random_data)
from test_failures import killed_in_all_reduce

HOST_MAJOR = ("a", "a", "b", "b")
INTERLEAVED = ("a", "b", "a", "b")
UNEVEN = ("a", "a", "a", "b")
ALL_REDUCE_NUMELS = (0, 1, 3, 13, 1001)  # odd totals: the tail past the last multiple of 2 local ranks
CHUNK_NUMELS = (0, 1, 7, 250)  # reduce_scatter output / all_gather input


def hierarchical_group(rank: int, hosts: tuple[str, ...], **kwargs) -> ringcomm.Group:
    os.environ["RINGCOMM_HOST"] = hosts[rank]
    return ringcomm.new_group(transport="hierarchical", timeout=kwargs.pop("timeout", 30.0), shm=SMALL_CMA,
                              torch_dist=SMALL_TORCH_DIST, **kwargs)


def check_reductions(group, rank, world_size, dtype, op, case):
    for numel in ALL_REDUCE_NUMELS:
        case += 1
        what = f"rank {rank} {group.transport.kind} {dtype} {op.name} numel={numel}"
        data = random_data(numel, dtype, op, rank, case)
        expected = gloo_reduce(data, op, world_size)
        tensor = data.clone()
        ringcomm.all_reduce(tensor, op, group=group)
        assert_close(tensor, expected, "all_reduce in place " + what)
        output = torch.full_like(data, 7)
        ringcomm.all_reduce(data, op, group=group, output=output)
        assert_close(output, expected, "all_reduce out of place " + what)
    for numel in CHUNK_NUMELS:
        case += 1
        what = f"rank {rank} {group.transport.kind} {dtype} {op.name} chunk numel={numel}"
        data = random_data(numel * world_size, dtype, op, rank, case)
        expected = gloo_reduce(data, op, world_size)[rank * numel:(rank + 1) * numel]
        output = torch.empty(numel, dtype=dtype)
        source = data.clone()
        ringcomm.reduce_scatter(output, source, op, group=group)
        assert_close(output, expected, "reduce_scatter " + what)
        assert torch.equal(source, data), "reduce_scatter modified its input " + what
        ringcomm.reduce_scatter(source[rank * numel:(rank + 1) * numel], source, op, group=group)
        assert_close(source[rank * numel:(rank + 1) * numel], expected, "reduce_scatter in place " + what)
    return case


def check_against_gloo(rank, world_size, hosts, kind, description, dtypes):
    group = hierarchical_group(rank, hosts)
    assert group.transport.kind == kind, f"rank {rank}: {group!r}"
    assert description in group.transport.describe(), f"rank {rank}: {group.transport.describe()}"
    case = 0
    for dtype in dtypes:
        for op in ReduceOp:
            case = check_reductions(group, rank, world_size, dtype, op, case)
        case = check_moves(group, rank, world_size, dtype, case, CHUNK_NUMELS, group.transport.kind)
    ringcomm.barrier(group=group)
    check_windows(group, rank, world_size, case)
    group.close()


def check_windows(group, rank, world_size, case):
    """Tensors from the group's allocator (local shared memory) take the in-place local steps."""
    for dtype in (torch.float32, torch.bfloat16):
        case += 1
        what = f"rank {rank} {group.transport.kind} windows {dtype}"
        window = ringcomm.empty(1004, dtype=dtype, group=group)
        data = random_data(1004, dtype, ReduceOp.AVG, rank, case)
        expected = gloo_reduce(data, ReduceOp.AVG, world_size)
        window.copy_(data)
        ringcomm.all_reduce(window, ReduceOp.AVG, group=group)
        assert_close(window, expected, "all_reduce " + what)
        window.copy_(data)
        own = slice(rank * 251, (rank + 1) * 251)
        ringcomm.reduce_scatter(window[own], window, ReduceOp.AVG, group=group)
        assert_close(window[own], expected[own], "reduce_scatter in place " + what)
        window[own] = data[own]
        ringcomm.all_gather(window, window[own], group=group)
        reference = torch.empty_like(data)
        dist.all_gather_into_tensor(reference, data[own].contiguous())
        assert torch.equal(window, reference), "all_gather in place " + what


# The uneven placement runs the flat torch_dist ring (tested in full by test_collectives): fewer dtypes.
@pytest.mark.parametrize("hosts, kind, description, dtypes", [
    (HOST_MAJOR, "hierarchical", "2 hosts x 2 ranks (host-major)", DTYPES),
    pytest.param(INTERLEAVED, "hierarchical", "2 hosts x 2 ranks (interleaved)", DTYPES, marks=pytest.mark.slow),
    pytest.param(UNEVEN, "torch_dist", "unequal numbers of ranks [3, 1]", [torch.float32, torch.bfloat16, torch.int64],
                 marks=pytest.mark.slow),
], ids=["host_major", "interleaved", "uneven"])
def test_hierarchical_matches_gloo(hosts, kind, description, dtypes):
    run_ranks(check_against_gloo, 4, hosts, kind, description, dtypes, timeout=120)


def check_bf16_rounds_once(rank, world_size, hosts):
    assert_bf16_rounds_once(hierarchical_group(rank, hosts), rank, world_size, "hierarchical")


def test_bf16_all_reduce_rounds_once():
    run_ranks(check_bf16_rounds_once, 4, HOST_MAJOR)


def check_auto_choice(rank, world_size):
    cases = [(("a", "a", "b", "b"), "hierarchical"), (("a", "b", "a", "b"), "hierarchical"),
             (("a",) * 4, "shm"), (("a", "b", "c", "d"), "torch_dist")]
    for hosts, kind in cases:
        os.environ["RINGCOMM_HOST"] = hosts[rank]
        group = ringcomm.new_group(timeout=30)
        assert group.transport.kind == kind, f"rank {rank} hosts {hosts}: {group!r}, expected {kind}"
        assert group.placement.hosts == hosts, f"rank {rank}: the group's placement {group.placement}, hosts {hosts}"
        tensor = torch.full((11,), float(rank + 1))
        ringcomm.all_reduce(tensor, group=group)
        assert torch.all(tensor == 10), f"rank {rank} hosts {hosts}: {tensor}"
        group.close()


def test_auto_picks_hierarchical_when_hosts_differ():
    run_ranks(check_auto_choice, 4, env={"RINGCOMM_TRANSPORT": "auto"})


TIMEOUT_S = 3.0


def die_during_all_reduce(rank, world_size, hosts):
    group = hierarchical_group(rank, hosts, timeout=TIMEOUT_S)
    message, elapsed = killed_in_all_reduce(rank, group, 8 << 20)  # 32 MiB: many segments on both levels
    assert f"all_reduce: rank {rank} " in message and "at step" in message, message
    assert elapsed < 3 * TIMEOUT_S, f"rank {rank} took {elapsed:.1f} s to notice: {message}"
    return message


def test_dead_peer_fails_every_rank():
    messages = run_ranks(die_during_all_reduce, 4, INTERLEAVED, may_die=frozenset({1}), timeout=60)
    assert messages[1] is None
    assert all(messages[r] for r in (0, 2, 3)), messages


def die_between_levels(rank, world_size, hosts):
    """Rank 1 dies after its local step, as its cross-host step starts: rank 3
    (its local peer) passed step 1 and runs a long cross-host step with rank 2,
    both alive (32 MiB in 96-byte segments: seconds), while rank 0 fails at
    once. Ranks 2 and 3 must hear of it from rank 0 ([Note: hierarchical
    failures]), not at their next local step."""
    group = hierarchical_group(rank, hosts, timeout=TIMEOUT_S)
    if rank == 1:
        def die(**_):
            os.kill(os.getpid(), signal.SIGKILL)
        group.transport.cross.all_reduce = die
    big = torch.ones(8 << 20)
    ringcomm.barrier(group=group)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ringcomm.all_reduce(big, group=group)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert f"all_reduce: rank {rank} " in message and "at step" in message, message
    assert elapsed < 2 * TIMEOUT_S, f"rank {rank} took {elapsed:.1f} s to notice: {message}"
    with pytest.raises(RuntimeError, match="unusable"):  # a broken group refuses further work
        ringcomm.all_reduce(torch.ones(10), group=group)
    return message


def test_dead_peer_between_levels_fails_every_rank():
    messages = run_ranks(die_between_levels, 4, INTERLEAVED, may_die=frozenset({1}), timeout=60)
    # told by rank 0: its abort through the shm segment, or (a pipelined call's
    # cross-host piece already under way) its report, which rank 2 reads
    assert "aborted the group" in messages[2] or "rank 0 at step" in messages[2], messages[2]


def test_placement_and_auto_choice_are_pure():
    from ringcomm.transport.placement import auto_transport, plan_placement

    interleaved = plan_placement(INTERLEAVED)
    assert interleaved.ranks_on == ((0, 2), (1, 3)) and not interleaved.is_host_major()
    assert (interleaved.host_of(3), interleaved.local_rank_of(3)) == (1, 1)
    assert plan_placement(HOST_MAJOR).is_host_major() and not plan_placement(HOST_MAJOR).unsupported()
    assert "unequal" in plan_placement(UNEVEN).unsupported()
    assert "own host" in plan_placement(("a", "b")).unsupported()
    assert [auto_transport(h) for h in (("a",) * 3, ("a", "b", "c"), HOST_MAJOR, UNEVEN)] == \
        ["shm", "torch_dist", "hierarchical", "hierarchical"]
    cores = len(os.sched_getaffinity(0))  # simulated hosts on one machine: no spinning past its cores
    assert ringcomm.ShmOptions().for_ranks_on_machine(cores + 1).spin_us == 0.0
    assert ringcomm.ShmOptions().for_ranks_on_machine(cores) == ringcomm.ShmOptions()


# Plain calls on which the ranks disagree, (what every rank passes, what the odd
# rank passes instead): AVG runs as SUM on both levels and 16-bit floats cross as
# float32, so neither level's own check sees those; a size that differs on one
# rank only differs on one host and one cross-host ring.
PLAIN_MISMATCHES = (
    (dict(op="all_reduce", numel=8), dict(redop=ReduceOp.AVG)),
    (dict(op="all_reduce", numel=1001), dict(redop=ReduceOp.AVG)),
    (dict(op="reduce_scatter", numel=8), dict(redop=ReduceOp.AVG)),
    (dict(op="all_reduce", numel=8, dtype=torch.bfloat16), dict(dtype=torch.float16)),
    (dict(op="reduce_scatter", numel=8, dtype=torch.bfloat16), dict(dtype=torch.float16)),
    (dict(op="all_reduce", numel=8), dict(numel=9)),
    (dict(op="all_gather", numel=8), dict(numel=7)),
    (dict(op="all_gather", numel=8), dict(numel=0)),
    (dict(op="reduce_scatter", numel=8), dict(numel=0)),
    (dict(op="broadcast", numel=8, root=0), dict(root=1)),
)
PLAIN_CALL = dict(dtype=torch.float32, redop=ReduceOp.SUM, root=0)


def plain_call(group, rank, world_size, *, op, numel, dtype, redop, root) -> None:
    """One plain collective on (rank + 1)-filled data."""
    fill = float(rank + 1)
    if op == "all_reduce":
        ringcomm.all_reduce(torch.full((numel,), fill, dtype=dtype), redop, group=group)
    elif op == "reduce_scatter":
        ringcomm.reduce_scatter(torch.empty(numel, dtype=dtype), torch.full((world_size * numel,), fill, dtype=dtype),
                                redop, group=group)
    elif op == "all_gather":
        ringcomm.all_gather(torch.empty(world_size * numel, dtype=dtype), torch.full((numel,), fill, dtype=dtype),
                            group=group)
    else:
        ringcomm.broadcast(torch.full((numel,), fill, dtype=dtype), root, group=group)


def check_disagreements(rank, world_size, hosts):
    """Every case of PLAIN_MISMATCHES, the odd rank going round: a ValueError on
    every rank, and the group works after it (closed form: sum of rank + 1)."""
    group = hierarchical_group(rank, hosts, timeout=10.0)
    messages = []
    for case, (every, odd) in enumerate(PLAIN_MISMATCHES):
        call = {**PLAIN_CALL, **every, **(odd if rank == case % world_size else {})}
        with pytest.raises(ValueError, match="disagree") as info:
            plain_call(group, rank, world_size, **call)
        messages.append(str(info.value))
        for numel in (8, 1001):
            tensor = torch.ones(numel)
            ringcomm.all_reduce(tensor, group=group)
            assert torch.all(tensor == world_size), f"rank {rank} case {case} {call}: all_reduce after it: {tensor}"
    group.close()
    return messages


def test_disagreements_raise_on_every_rank():
    messages = run_ranks(check_disagreements, 4, HOST_MAJOR, timeout=120)
    for case, (every, odd) in enumerate(PLAIN_MISMATCHES):
        seen = {m[case] for m in messages}
        assert len(seen) == 1, f"case {case} {every} {odd}: the ranks' errors differ: {seen}"
        assert seen.pop().startswith(f"{every['op']}: ranks disagree"), f"case {case}: {messages[0][case]}"


@pytest.mark.parametrize("late_piece", [1, 3])  # the last piece (none left pending), an earlier one
def test_a_timed_out_piece_is_done_with_its_buffers_when_the_call_fails(late_piece):
    """A piece's cross-host step that outlasts its bound: the call fails, and the
    cross thread is no longer in this call's pieces when it does (it would write
    the scratch buffers the next call reuses): the pipeline waited, then aborted."""
    import threading

    from ringcomm.algorithms.pipeline import Pipeline, Stages

    aborted, running, scratch = threading.Event(), set(), [None] * 4
    def across(k: int) -> None:
        running.add(k)
        try:
            if k == late_piece:
                assert aborted.wait(10), "never aborted"  # a transfer that fails once the transport aborts
                scratch[k] = "late write"
                raise RuntimeError(f"piece {k}: aborted")
        finally:
            running.discard(k)

    pipeline = Pipeline(0, lambda op, step, what: contextlib.nullcontext(), aborted.set, timeout_s=0.2)
    stages = Stages("all_reduce", 2, "cross-host all-reduce", None, across, lambda k: None)
    with pytest.raises(RuntimeError, match=f"of piece {late_piece} took over 0.1 s"):
        pipeline.run(stages, 4, bound_s=0.1)
    assert not running and aborted.is_set(), f"the cross thread still in piece(s) {running}; aborted: {aborted.is_set()}"
    assert scratch[late_piece] == "late write", scratch  # it wrote before the call returned, not during the next
    pipeline.shutdown()
