"""Group lifetime: nothing leaks across create/close cycles, closed groups and
foreign `group=` objects are refused clearly, a second thread on a busy group
is refused, and a peer that never arrives fails set-up within the timeout."""
from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringcomm
from harness import run_ranks

CYCLES = 30


def resources() -> dict[str, int]:
    with open("/proc/self/maps") as maps:
        mappings = sum("ringcomm-" in line for line in maps)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "mappings": mappings}


def create_and_close(rank, world_size, transport):
    def cycle():
        group = ringcomm.new_group(transport=transport, timeout=30)
        x = ringcomm.empty(64, group=group) if transport == "shm" else torch.empty(64)
        x.fill_(1.0)
        ringcomm.all_reduce(x, group=group, async_op=True).wait()  # starts the comm thread too
        group.close()
        del x

    def backend_cycle():
        pg = dist.new_group(backend="ringcomm", timeout=timedelta(seconds=30))
        dist.all_reduce(torch.ones(8), group=pg)
        dist.destroy_process_group(pg)

    for run in (cycle, backend_cycle):
        run()  # first use loads what stays loaded (thread pools, libraries)
        dist.barrier()
        before = resources()
        for _ in range(CYCLES):
            run()
        dist.barrier()
        after = resources()
        grown = {k: after[k] - before[k] for k in after if after[k] > before[k] + 2}
        assert not grown, f"rank {rank} {transport} {run.__name__}: {CYCLES} cycles grew {grown} ({before} -> {after})"


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_create_and_close_leaks_nothing(transport):
    run_ranks(create_and_close, 2, transport, timeout=240)


def misuse(rank, world_size):
    group = ringcomm.new_group(timeout=10)
    for bad in (dist.group.WORLD, "world"):
        with pytest.raises(TypeError, match="ringcomm.Group"):
            ringcomm.all_reduce(torch.ones(4), group=bad)
    # A second thread while the first is inside a collective (rank 1 arrives late).
    if rank == 0:
        errors = []
        inside = threading.Thread(target=lambda: ringcomm.all_reduce(torch.ones(1 << 16), group=group), name="first")
        inside.start()
        # Until the flight recorder shows the first thread's call started (it
        # waits inside for rank 1, which joins only after the barrier below).
        deadline = time.monotonic() + 30
        while not any(e["input_sizes"] == [[1 << 16]] and e["state"] == "started" for e in group.recorder.entries()):
            assert time.monotonic() < deadline, "the first thread's all_reduce never started"
            time.sleep(0.001)
        try:
            ringcomm.all_reduce(torch.ones(4), group=group)
        except RuntimeError as err:
            errors.append(str(err))
        dist.barrier()  # now rank 1 joins the first thread's all_reduce
        inside.join()
        assert errors and "thread 'first'" in errors[0] and "one thread at a time" in errors[0], errors
    else:
        dist.barrier()
        ringcomm.all_reduce(torch.ones(1 << 16), group=group)
    y = torch.ones(8)
    ringcomm.all_reduce(y, group=group)  # the group is still usable
    assert torch.all(y == world_size)
    group.close()
    group.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ringcomm.all_reduce(torch.ones(4), group=group)
    with pytest.raises(RuntimeError, match="closed"):
        ringcomm.barrier(group=group)


def test_misuse_is_refused_clearly():
    run_ranks(misuse, 2)


def peer_never_arrives(rank, world_size, transport):
    if rank == 1:
        return  # never creates the group
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ringcomm.new_group(transport=transport, timeout=2)
    elapsed = time.monotonic() - start
    assert elapsed < 4.0, f"{transport}: set-up took {elapsed:.1f} s to fail with timeout 2 s: {info.value}"


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_setup_without_a_peer_fails_within_the_timeout(transport):
    run_ranks(peer_never_arrives, 2, transport)


def peer_dies_in_gloo_setup(rank, world_size, when):
    """Rank 1 is killed when it builds the gloo group of a torch_dist ringcomm group:
    right after building it ("after": rank 0 may still be connecting, and gloo
    sees only a closed connection), or instead of building it ("before")."""
    if rank == 1:
        real = dist.ProcessGroupGloo

        def build_then_die(*args, **kwargs):
            if when == "after":
                real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.ProcessGroupGloo = dist.distributed_c10d.ProcessGroupGloo = build_then_die  # this process only
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ringcomm.new_group(transport="torch_dist", timeout=2)
    elapsed = time.monotonic() - start
    assert elapsed < 4.0, f"set-up took {elapsed:.1f} s to fail with timeout 2 s: {info.value}"
    assert "[1]" in str(info.value), f"the dead rank is not named: {info.value}"


@pytest.mark.parametrize("when", ["after", "before"])
def test_peer_killed_during_setup_fails_within_the_timeout(when):
    run_ranks(peer_dies_in_gloo_setup, 2, when, may_die=frozenset({1}))
