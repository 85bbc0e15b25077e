"""The flight recorder and its analyzer ([Note: flight recorder]) on 3 ranks: a
rank that skips a collective, a rank that is stopped, and ranks that call
different collectives of equal byte counts are each named by
`python -m ringcomm.observe.trace DIR`; a signal dumps a rank stuck in a collective."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import ringcomm
from ringcomm.observe import recorder, trace

TIMEOUT_S = 3.0  # the group's: how long the waiting ranks wait before they fail and dump


def analyzer_output(directory: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "ringcomm.observe.trace", directory], capture_output=True, text=True,
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
        threading.Thread(target=signal_while_waiting, args=(directory, seen, group.recorder), daemon=True).start()
    try:
        ringcomm.all_reduce(torch.ones(5), group=group)
    except RuntimeError as err:
        seen["error"] = str(err).splitlines()[0]
    if rank == 0:
        os.kill(pids[1], signal.SIGKILL)
    return seen


def signal_while_waiting(directory: str, seen: dict, group: recorder.FlightRecorder) -> None:
    """SIGUSR1 to this process while its main thread waits in the collective:
    once the flight recorder shows that call (the second all_reduce) started."""
    deadline = time.monotonic() + TIMEOUT_S / 2
    while not any(e["collective_seq_id"] == 2 and e["state"] == "started" for e in group.entries()):
        assert time.monotonic() < deadline, "the second all_reduce never started"
        time.sleep(0.001)
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


# ---- the analyzer's input: runs kept apart, damaged files named ([Note: run id]) ----
def dumping_worker(rank: int, world_size: int, directory: str, dumping: tuple[int, ...]) -> dict:
    """Two all_reduces, then the ranks in `dumping` dump into `directory` and into
    the default folder under `directory`/tmp."""
    group = ringcomm.new_group()
    for _ in range(2):
        ringcomm.all_reduce(torch.ones(4), group=group)
    seen = {}
    if rank in dumping:
        tempfile.tempdir = os.path.join(directory, "tmp")  # the default folder's parent, here
        seen["default"] = ringcomm.dump_trace()
        seen["path"] = ringcomm.dump_trace(directory)
        with open(seen["path"]) as src:
            seen["run_id"] = json.load(src).get("run_id")
    group.close()
    return seen


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> dict:
    """Run A (2 ranks, a run id they agree on) dumps ranks 0 and 1; run B (torchrun's
    job id "job-b") then dumps rank 1 over A's file in the same folder."""
    directory = str(tmp_path_factory.mktemp("two_runs"))
    run_a = run_ranks(dumping_worker, 2, directory, (0, 1), timeout=60, env={"TORCHELASTIC_RUN_ID": "none"})
    run_b = run_ranks(dumping_worker, 2, directory, (1,), timeout=60, env={"TORCHELASTIC_RUN_ID": "job-b"})
    return {"directory": directory, "a": run_a, "b": run_b}


def analyzer(capsys, *args: str) -> tuple[int, str, str]:
    """`python -m ringcomm.observe.trace ARGS`, in this process: (exit status, stdout, stderr)."""
    status = trace.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_dumps_of_two_runs_are_not_merged(two_runs, capsys) -> None:
    directory, run_a, run_b = two_runs["directory"], two_runs["a"], two_runs["b"]
    run_id = run_a[0]["run_id"]
    assert run_a[1]["run_id"] == run_id and run_id not in (None, "", "none", "job-b"), run_a
    assert run_b[1]["run_id"] == "job-b", run_b
    uid = os.getuid()
    assert run_a[0]["default"] == os.path.join(directory, "tmp", f"ringcomm-trace-{uid}", run_id,
                                               "ringcomm_trace_rank_0.json"), run_a
    assert run_b[1]["default"] == os.path.join(directory, "tmp", f"ringcomm-trace-{uid}", "job-b",
                                               "ringcomm_trace_rank_1.json"), run_b
    status, _, err = analyzer(capsys, directory)
    assert status == 2 and "2 runs, which are never merged" in err, (status, err)
    assert f"run {run_id} (rank 0; " in err and f"): {run_a[0]['path']}\n" in err, err
    assert "run job-b (rank 1; " in err and err.rstrip().endswith(run_b[1]["path"]), err
    with pytest.raises(trace.MixedRunsError, match="--run"):
        trace.load(directory)
    status, out, _ = analyzer(capsys, directory, "--run", "job-b")
    assert status == 0 and "run job-b, dumps from ranks 1\n" in out, (status, out)
    assert analyzer(capsys, directory, "--run", "job-c")[0] == 2


def test_damaged_dumps_are_named_and_the_others_analyzed(two_runs, tmp_path, capsys) -> None:
    with open(two_runs["a"][0]["path"]) as src:
        good = src.read()
    damaged = {1: good[:len(good) // 2].encode(), 2: b"\xff\xd8\xff\xe0 a picture",
               3: json.dumps({**json.loads(good), "groups": [{"group_id": 0}]}).encode()}
    paths = {rank: tmp_path / f"ringcomm_trace_rank_{rank}.json" for rank in range(4)}
    for rank, data in damaged.items():
        paths[rank].write_bytes(data)
    status, _, err = analyzer(capsys, str(tmp_path))  # nothing readable yet
    assert status == 1 and "none of the 3 dumps" in err and str(paths[3]) in err, (status, err)
    paths[0].write_text(good)
    status, out, _ = analyzer(capsys, str(tmp_path))
    assert status == 0, (status, out)
    reasons = {1: "not valid JSON, truncated or not a dump", 2: "not text, so not a dump",
               3: "JSON of another shape than a flight recorder dump: groups[0] has no 'global_ranks'"}
    for rank, reason in reasons.items():
        assert f"left out {paths[rank]}: {reason}" in out, (rank, out)
    assert "3 files left out, the analysis below is of the other dumps" in out, out
    assert "dumps from ranks 0\n" in out and "rank 1: its file was left out" in out, out


# ---- group ids across ranks: subgroups that some ranks never see ----
def subgroups_worker(rank: int, world_size: int, directory: str) -> None:
    """Two disjoint pairs that call different collectives, a pair across them, and
    a backend subgroup per pair; every rank dumps its groups."""
    pairs = [ringcomm.new_group([0, 1]), ringcomm.new_group([2, 3])]
    pair = pairs[rank // 2]
    if rank < 2:
        ringcomm.all_reduce(torch.ones(4), group=pair)
    else:
        ringcomm.all_gather(torch.empty(8), torch.ones(4), group=pair)
    across = ringcomm.new_group([0, 2])  # ranks 1 and 3 get None and make no Group
    if across is not None:
        ringcomm.all_reduce(torch.ones(3), group=across)
    backend = [dist.new_group([0, 1], backend="ringcomm"), dist.new_group([2, 3], backend="ringcomm")][rank // 2]
    dist.all_reduce(torch.ones(6), group=backend)
    ringcomm.dump_trace(directory)
    dist.barrier()  # every rank dumped before any group goes away
    for group in (pair, across):
        if group is not None:
            group.close()


def test_group_ids_name_the_same_group_on_every_rank(tmp_path) -> None:
    run_ranks(subgroups_worker, 4, str(tmp_path), timeout=120)
    reports = trace.analyze(trace.load(str(tmp_path)))
    seen = sorted((tuple(r.global_ranks), tuple(sorted(r.last_completed)), tuple(r.missing), tuple(r.mismatches))
                  for r in reports)
    # Per pair: its ringcomm group (1 call) and its backend group (1 call); the cross pair once.
    assert seen == [((0, 1), (0, 1), (), ()), ((0, 1), (0, 1), (), ()), ((0, 2), (0, 2), (), ()),
                    ((2, 3), (2, 3), (), ()), ((2, 3), (2, 3), (), ())], "\n".join(map(str, reports))
    os.remove(tmp_path / "ringcomm_trace_rank_3.json")  # rank 3 left no dump: only its groups miss it
    reports = trace.analyze(trace.load(str(tmp_path)))
    missing = sorted((tuple(r.global_ranks), tuple(r.missing)) for r in reports)
    assert missing == [((0, 1), ()), ((0, 1), ()), ((0, 2), ()), ((2, 3), (3,)), ((2, 3), (3,))], \
        "\n".join(map(str, reports))
