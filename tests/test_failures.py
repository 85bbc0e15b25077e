"""Caller mistakes, dead and stalled peers, and shared-memory hygiene."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import ringcomm
from harness import assert_no_new_shm, run_ranks, shm_entries

TIMEOUT_S = 3.0


def check_bad_input(rank, world_size, transport):
    group = ringcomm.new_group(transport=transport, timeout=30)
    x = torch.zeros(8)
    cases = [
        (ValueError, lambda: ringcomm.all_reduce(torch.zeros(4, 4).t(), group=group), "contiguous"),
        (TypeError, lambda: ringcomm.all_reduce(torch.zeros(4, dtype=torch.uint8), group=group), "dtype"),
        (TypeError, lambda: ringcomm.all_reduce([1.0], group=group), "torch.Tensor"),
        (ValueError, lambda: ringcomm.all_reduce(x, op="median", group=group), "reduce op"),
        (ValueError, lambda: ringcomm.reduce_scatter(torch.zeros(3), torch.zeros(7), group=group), "world_size"),
        (ValueError, lambda: ringcomm.all_gather(torch.zeros(7), torch.zeros(3), group=group), "world_size"),
        (TypeError, lambda: ringcomm.reduce_scatter(torch.zeros(2), torch.zeros(4, dtype=torch.float64), group=group),
         "dtype"),
        (ValueError, lambda: ringcomm.broadcast(x, src=world_size, group=group), "src"),
    ]
    if transport == "shm":
        cases.append((ValueError, lambda: ringcomm.all_reduce(torch.zeros(4, device="meta"), group=group), "meta"))
    for error, call, word in cases:
        with pytest.raises(error, match=word) as info:
            call()
        assert f"rank {rank}" in str(info.value), str(info.value)
    # Ranks that disagree on sizes all get the same ValueError naming both calls, and the group stays usable.
    word = torch.int32 if rank else torch.float32
    messages = []
    for call in (
        lambda: ringcomm.all_reduce(torch.ones(5 + rank), group=group),
        lambda: ringcomm.reduce_scatter(torch.empty(2 + rank), torch.ones((2 + rank) * world_size), group=group),
        lambda: ringcomm.all_gather(torch.empty((3 + rank) * world_size), torch.ones(3 + rank), group=group),
        lambda: ringcomm.all_reduce(torch.ones(4, dtype=torch.float64 if rank else torch.float32), group=group),
        lambda: ringcomm.all_reduce(torch.ones(4), op="max" if rank else "sum", group=group),
        # as many bytes, another dtype: compared too
        lambda: ringcomm.all_gather(torch.empty(2 * world_size, dtype=word), torch.ones(2, dtype=word), group=group),
        lambda: group.transport.all_to_all(output=torch.empty(2 * world_size, dtype=word),
                                           input=torch.ones(2 * world_size, dtype=word)),
    ):
        with pytest.raises(ValueError, match="disagree") as info:
            call()
        messages.append(str(info.value))
        y = torch.ones(100)
        ringcomm.all_reduce(y, group=group)
        assert torch.all(y == world_size), f"rank {rank}: group unusable after a mismatch"
    return messages


def killed_in_all_reduce(rank: int, group: ringcomm.Group, numel: int) -> tuple[str, float]:
    """Rank 1 starts an all-reduce of `numel` floats and is killed inside it: once
    its comm thread has started the call (Work.started_at), before the call can
    end (the other ranks' halves of it are not there yet). The other ranks' one
    matching all_reduce must raise: it proves the kill landed inside the call.
    Returns (its message, seconds)."""
    big = torch.ones(numel)
    ringcomm.barrier(group=group)
    if rank == 1:
        work = ringcomm.all_reduce(big, group=group, async_op=True)
        deadline = time.monotonic() + 30
        while work.started_at is None and time.monotonic() < deadline:
            time.sleep(0.0005)  # polls the call's own state; the kill does not depend on how long this takes
        assert work.started_at is not None and not work.is_completed(), "rank 1: the call did not start, or ended"
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ringcomm.all_reduce(big, group=group)
    return str(info.value), time.monotonic() - start


def die_during_all_reduce(rank, world_size, transport):
    group = ringcomm.new_group(transport=transport, timeout=TIMEOUT_S)
    message, elapsed = killed_in_all_reduce(rank, group, 16 << 20)  # 64 MiB, many segments
    assert "rank 1" in message and "all_reduce" in message, message
    assert elapsed < 2 * TIMEOUT_S, f"rank {rank} took {elapsed:.1f} s to notice: {message}"
    return message


def stall_past_timeout(rank, world_size, transport):
    group = ringcomm.new_group(transport=transport, timeout=1.0)
    ringcomm.barrier(group=group)
    if rank == 1:
        time.sleep(2.5)
        try:  # rank 0 gave up already; whether this late call still completes depends on how far rank 0 got
            ringcomm.all_reduce(torch.ones(1000), group=group)
        except RuntimeError:
            pass
        return None
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ringcomm.all_reduce(torch.ones(1000), group=group)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 2.0, f"timeout of 1 s took {elapsed:.1f} s: {message}"
    assert "all_reduce" in message and "rank 0" in message and "step 0" in message, message
    if transport == "shm":
        assert "waiting for rank 1" in message and "timed out" in message.lower(), message
    with pytest.raises(RuntimeError, match="unusable"):  # a broken group refuses further work
        ringcomm.all_reduce(torch.ones(10), group=group)
    return message


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_bad_input_raises_clear_errors(transport):
    messages = run_ranks(check_bad_input, 2, transport)
    assert messages[0] == messages[1], messages
    assert "rank 0 has numel 4, dtype float32" in messages[0][3] and "dtype float64" in messages[0][3], messages[0][3]


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_sigkill_of_a_rank_is_reported_by_every_other_rank(transport):
    before = shm_entries()
    messages = run_ranks(die_during_all_reduce, 3, transport, may_die=frozenset({1}), timeout=60)
    assert messages[1] is None
    assert_no_new_shm(before)


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_stalled_peer_times_out(transport):
    run_ranks(stall_past_timeout, 2, transport)


def test_full_dev_shm_is_a_clear_error():
    from ringcomm import _C

    name = f"/ringcomm-{os.getpid()}-fulltest"
    with pytest.raises(RuntimeError, match="/dev/shm"):
        _C.ShmComm(name, 0, 1, 1 << 42, 2, 0, 16, True)  # 8 TiB of slots: more than any /dev/shm
    assert not os.path.exists("/dev/shm" + name)


def test_new_group_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ringcomm.new_group()


def test_expired_segments_are_removed_and_live_ones_kept():
    from ringcomm.transport.shm_names import remove_stale_segments

    now = int(time.time())
    expired = f"/dev/shm/ringcomm-exp{now - 5}-{os.getpid():x}0"
    live = f"/dev/shm/ringcomm-exp{now + 600}-{os.getpid():x}1"  # another job's set-up, whatever its creator's pid
    for path in (expired, live):
        open(path, "wb").close()
    try:
        assert expired in remove_stale_segments()
        assert not os.path.exists(expired) and os.path.exists(live)
    finally:
        for path in (expired, live):
            if os.path.exists(path):
                os.unlink(path)
