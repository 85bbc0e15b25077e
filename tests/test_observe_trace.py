"""The flight recorder and its analyzer ([Note: flight recorder]) on 3 ranks: a
rank that skips a collective, a rank that is stopped, and ranks that call
different collectives of equal byte counts are each named by
`python -m ringcomm.trace DIR`; a signal dumps a rank stuck in a collective."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import ringcomm
from ringcomm import trace

TIMEOUT_S = 3.0  # the group's: how long the waiting ranks wait before they fail and dump


def analyzer_output(directory: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "ringcomm.trace", directory], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def skip_worker(rank: int, world_size: int) -> str:
    """Rank 2 skips the third all_reduce and calls the all_gather that follows it."""
    group = ringcomm.new_group(timeout=TIMEOUT_S)
    tensor = torch.ones(4)
    try:
        for step in range(3):
            if not (rank == 2 and step == 2):
                ringcomm.all_reduce(tensor, group=group)
        ringcomm.all_gather(torch.empty(12), torch.ones(4), group=group)
        ringcomm.barrier(group=group)
    except (RuntimeError, ValueError) as err:  # a timeout, or the ranks' check of the call
        return str(err).splitlines()[0]
    return "no error"


def test_a_rank_that_skips_an_all_reduce_is_named(tmp_path) -> None:
    errors = run_ranks(skip_worker, 3, timeout=120, env={"RINGCOMM_TRACE_DIR": str(tmp_path)})
    assert "no error" not in errors, errors
    reports = trace.analyze(trace.load(str(tmp_path)))
    assert len(reports) == 1, reports
    report = reports[0]
    assert report.mismatches, report
    first = report.mismatches[0]
    assert first.startswith("seq 3: all_reduce in [[4]] out [[4]] float32 on ranks 0, 1; "
                            "all_gather in [[4]] out [[12]] float32 on rank 2"), first
    assert report.last_completed == {0: 2, 1: 2, 2: 2}, report
    printed = analyzer_output(str(tmp_path))
    assert "MISMATCH seq 3" in printed and "on rank 2" in printed, printed


def stop_worker(rank: int, world_size: int, directory: str) -> dict:
    """Rank 1 stops itself before the second all_reduce; the others wait, time out
    and dump. Rank 0 also dumps by signal while it waits, then kills rank 1."""
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    group = ringcomm.new_group(timeout=TIMEOUT_S)
    ringcomm.all_reduce(torch.ones(5), group=group)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    seen: dict = {}
    if rank == 0:
        threading.Thread(target=signal_while_waiting, args=(directory, seen), daemon=True).start()
    try:
        ringcomm.all_reduce(torch.ones(5), group=group)
    except RuntimeError as err:
        seen["error"] = str(err).splitlines()[0]
    if rank == 0:
        os.kill(pids[1], signal.SIGKILL)
    return seen


def signal_while_waiting(directory: str, seen: dict) -> None:
    """SIGUSR1 to this process while its main thread waits in the collective."""
    time.sleep(TIMEOUT_S / 3)
    os.kill(os.getpid(), signal.SIGUSR1)
    path = os.path.join(directory, "ringcomm_trace_rank_0.json")
    deadline = time.monotonic() + TIMEOUT_S / 3
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(path) as src:
        dump = json.load(src)
    seen["signal_dump"] = (dump["reason"], dump["groups"][-1]["entries"][-1]["state"])


def test_a_stopped_rank_is_named_behind(tmp_path) -> None:
    env = {"RINGCOMM_TRACE_DIR": str(tmp_path), "RINGCOMM_TRACE_SIGNAL": "USR1"}
    results = run_ranks(stop_worker, 3, str(tmp_path), timeout=120, env=env, may_die=frozenset({1}))
    assert results[0]["signal_dump"] == ("signal SIGUSR1", "started"), results[0]
    assert all("error" in results[r] for r in (0, 2)), results
    dumps = trace.load(str(tmp_path))
    assert sorted(dumps) == [0, 2], sorted(dumps)
    report = trace.analyze(dumps)[-1]
    assert report.behind == [1] and report.missing == [1], report
    assert report.last_completed == {0: 1, 2: 1}, report
    printed = analyzer_output(str(tmp_path))
    assert "behind: rank 1" in printed and "rank 1: no dump" in printed, printed


def mismatch_worker(rank: int, world_size: int) -> str:
    """Rank 0 all-gathers 4 -> 12 floats where the others reduce-scatter 12 -> 4."""
    group = ringcomm.new_group(timeout=TIMEOUT_S)
    try:
        if rank == 0:
            ringcomm.all_gather(torch.empty(12), torch.ones(4), group=group)
        else:
            ringcomm.reduce_scatter(torch.empty(4), torch.ones(12), group=group)
    except (RuntimeError, ValueError) as err:  # a timeout, or the ranks' check of the call
        return str(err).splitlines()[0]
    return "no error"


def test_different_collectives_of_equal_bytes_are_named(tmp_path) -> None:
    errors = run_ranks(mismatch_worker, 3, timeout=120, env={"RINGCOMM_TRACE_DIR": str(tmp_path)})
    assert "no error" not in errors, errors
    report = trace.analyze(trace.load(str(tmp_path)))[-1]
    assert report.mismatches == ["seq 1: reduce_scatter in [[12]] out [[4]] float32 on ranks 1, 2; "
                                 "all_gather in [[4]] out [[12]] float32 on rank 0"], report


def recorder_worker(rank: int, world_size: int, directory: str) -> list:
    group = ringcomm.new_group()
    for _ in range(5):
        ringcomm.all_reduce(torch.ones(3), group=group)  # the lean path
    ringcomm.all_reduce(torch.ones(3), group=group, async_op=True).wait()
    ringcomm.reduce_scatter(torch.empty(2, dtype=torch.float64), torch.ones(4, dtype=torch.float64), group=group)
    path = ringcomm.dump_trace(directory)
    if path is None:  # no group records
        group.close()
        return None
    with open(path) as src:
        entries = json.load(src)["groups"][-1]["entries"]
    group.close()
    return [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"], e["input_dtypes"], e["reduce_op"],
             e["state"]) for e in entries]


@pytest.mark.parametrize("buffer_size", ["4", "0"])
def test_the_recorder_keeps_the_last_n_calls(tmp_path, buffer_size) -> None:
    env = {"RINGCOMM_TRACE_BUFFER_SIZE": buffer_size}
    if buffer_size == "0":
        assert run_ranks(recorder_worker, 2, str(tmp_path), timeout=60, env=env) == [None, None]
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
        return
    for rank, entries in enumerate(run_ranks(recorder_worker, 2, str(tmp_path), timeout=60, env=env)):
        assert entries == [(4, "ringcomm:all_reduce", [[3]], ["float32"], "SUM", "completed"),
                           (5, "ringcomm:all_reduce", [[3]], ["float32"], "SUM", "completed"),
                           (6, "ringcomm:all_reduce", [[3]], ["float32"], "SUM", "completed"),
                           (7, "ringcomm:reduce_scatter", [[4]], ["float64"], "SUM", "completed")], \
            f"rank {rank}: {entries}"
