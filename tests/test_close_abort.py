"""Close, abort and destroy from another thread while a collective runs, on both
transports and through the backend: no crash (each rank is a process of its
own, so a SIGSEGV fails the test), no hang, the documented error ([Note: group
lifetime] in ringcomm/comm/group.py), and default groups that follow torch's world."""
from __future__ import annotations

import gc
import os
import re
import threading
import time
import weakref
from pathlib import Path
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringcomm
from harness import run_ranks
from lifecycle_stress import DOCUMENTED, PATHS, resources, stress

NUMEL = 1 << 20
WAIT_S = 30.0  # the longest any step of a case waits for the event it waits on


def _call(op: str, group) -> torch.Tensor:
    """One collective of `op` on `group` (a ringcomm.Group, a ProcessGroup or None); returns its result."""
    world_size = dist.get_world_size()
    x = torch.full((NUMEL,), dist.get_rank() + 1.0)
    if op == "all_reduce":
        ringcomm.all_reduce(x, group=group)
        return x
    if op == "reduce_scatter":
        out = torch.empty(NUMEL // world_size)
        ringcomm.reduce_scatter(out, x, group=group)
        return out
    if op == "all_gather":
        out = torch.empty(NUMEL * world_size)
        ringcomm.all_gather(out, x, group=group)
        return out[::NUMEL]  # chunk r holds rank r's value
    dist.all_reduce(x, group=group)  # the backend
    return x


def _expected(op: str, world_size: int) -> list[float]:
    """The distinct values of _call's result, ascending."""
    if op == "all_gather":
        return [float(r + 1) for r in range(world_size)]
    return [world_size * (world_size + 1) / 2]


# (how the group is made, the collective, how the second thread stops it)
CASES = [("new_group", op, kill) for op in ("all_reduce", "reduce_scatter", "all_gather") for kill in ("close", "abort")]
CASES += [("default", "all_reduce", "destroy_default_group")]
CASES += [("backend", "backend", kill) for kill in ("destroy_process_group", "shutdown", "abort")]


def _make(how: str, transport: str):
    if how == "new_group":
        return ringcomm.new_group(transport=transport, timeout=20)
    if how == "default":
        ringcomm.default_group()
        return None
    return dist.new_group(backend="ringcomm", timeout=timedelta(seconds=20))


def _kill(kill: str, group) -> None:
    if kill == "destroy_default_group":
        ringcomm.destroy_default_group()
    elif kill == "destroy_process_group":
        dist.destroy_process_group(group)
    else:
        getattr(group, kill)()


def _ringcomm_group(how: str, group) -> ringcomm.Group:
    """The ringcomm Group under a case's group (the backend's is its process group's)."""
    if how == "new_group":
        return group
    return ringcomm.default_group() if how == "default" else group._group


def _wait_for(what: str, ready) -> None:
    """Polls ready() until it holds: the event itself, never a guess at how long it takes."""
    deadline = time.monotonic() + WAIT_S
    while not ready():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.001)


def _stop_inside_the_call(case: str, how: str, kill: str, group, signal_dir: Path) -> float:
    """Rank 0's second thread: once the flight recorder shows rank 0's call
    started (it waits inside for rank 1), stops the group; once the group has
    left OPEN (a graceful stop then waits for the call), tells rank 1 to join.
    Returns when the stop began."""
    inner = _ringcomm_group(how, group)
    _wait_for(f"{case}: rank 0's call to start", lambda: any(
        e["input_sizes"] == [[NUMEL]] and e["state"] == "started" for e in inner.recorder.entries()))
    stopping = threading.Thread(target=_kill, args=(kill, group))
    began = time.monotonic()
    stopping.start()
    _wait_for(f"{case}: the group to leave OPEN", lambda: inner.state is not ringcomm.GroupState.OPEN)
    (signal_dir / case.replace(" ", "-")).touch()
    stopping.join()
    return began


def stop_mid_call(rank, world_size, transport, signal_dir):
    os.environ["RINGCOMM_TRANSPORT"] = transport  # the backend's and the default group too
    signal_dir = Path(signal_dir)
    report = []
    for how, op, kill in CASES:
        case = f"{transport} {how} {op} {kill}"
        group = _make(how, transport)
        dist.barrier()
        start = time.monotonic()
        outcome: list = []
        stop_began: list[float] = []
        if rank == 0:
            killer = threading.Thread(target=lambda: stop_began.append(
                _stop_inside_the_call(case, how, kill, group, signal_dir)))
            killer.start()
        else:  # joins the collective only once rank 0 is inside it and its group is stopping
            _wait_for(f"{case}: rank 0 to stop its group", (signal_dir / case.replace(" ", "-")).exists)
        try:
            outcome.append(_call(op, group))
        except RuntimeError as err:
            outcome.append(err)
        ended = time.monotonic()
        if rank == 0:
            killer.join()
            assert stop_began, f"{case}: rank 0's second thread failed"
            # Rank 1's call must meet rank 0's stopped group, not a rank 0 that already tore it down.
            _wait_for(f"{case}: rank 1's call to end", (signal_dir / f"{case.replace(' ', '-')}-done").exists)
        else:
            (signal_dir / f"{case.replace(' ', '-')}-done").touch()
        result = outcome[0]
        aborted = kill == "abort"
        if isinstance(result, torch.Tensor):
            # close / shutdown / destroy wait for the call in flight, which ends right
            assert not (aborted and rank == 0), f"{case}: rank 0's call was aborted but returned"
            assert result.unique().tolist() == _expected(op, world_size), f"{case}: rank {rank} got {result.unique()}"
        else:
            assert DOCUMENTED.search(str(result)), f"{case}: rank {rank}: undocumented error {result}"
            assert aborted, f"{case}: rank {rank}: a graceful {kill} failed the call in flight: {result}"
            if rank == 0 and transport == "shm":
                assert ended - stop_began[0] < 0.2, f"{case}: the call ended {ended - stop_began[0]:.2f} s after " \
                    "the abort, not at once"
        assert ended - start < 10.0, f"{case}: rank {rank}: the call took {ended - start:.1f} s"
        # Afterwards the stopped group refuses calls; the default group is made anew.
        if how == "new_group" or (how == "backend" and kill != "destroy_process_group"):
            if rank == 0:
                with pytest.raises(RuntimeError, match=r"the group is (closed|aborted)"):
                    _call(op, group)
            else:
                _kill("close" if how == "new_group" else "shutdown", group)
        if how == "backend":
            if kill != "destroy_process_group" or rank == 1:
                dist.destroy_process_group(group)
        if how == "default":
            if rank == 1:
                ringcomm.destroy_default_group()
            assert ringcomm.default_group().state is ringcomm.GroupState.OPEN, f"{case}: a stale default group"
            ringcomm.destroy_default_group()
        report.append((case, type(result).__name__, round(ended - start, 2)))
    return report


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_stop_from_another_thread_mid_call(transport, tmp_path):
    run_ranks(stop_mid_call, 2, transport, str(tmp_path), timeout=180)


def close_in_the_window(rank, world_size, transport, signal_dir):
    """A close that begins after a call passed the group's open check (the flight
    recorder shows it started) but before it entered the transport waits for
    it: the call ends right on both ranks. Rank 0's transport call is held in
    that window until the group left OPEN (the checked path: all_reduce with output=)."""
    group = ringcomm.new_group(transport=transport, timeout=20)
    joined = Path(signal_dir) / f"{transport}-join"
    x = torch.full((NUMEL,), rank + 1.0)
    out = torch.empty(NUMEL)
    if rank == 1:
        _wait_for("rank 0 to close its group", joined.exists)
        ringcomm.all_reduce(x, group=group, output=out)
        group.close()
        return out.unique().tolist()
    in_window = threading.Event()
    enter = group.transport.all_reduce

    def held(**kwargs):
        in_window.set()
        _wait_for("the group to leave OPEN", lambda: group.state is not ringcomm.GroupState.OPEN)
        joined.touch()
        return enter(**kwargs)

    group.transport.all_reduce = held
    closer = threading.Thread(target=lambda: (in_window.wait(WAIT_S), group.close()))
    closer.start()
    ringcomm.all_reduce(x, group=group, output=out)
    closer.join()
    assert group.state is ringcomm.GroupState.CLOSED, group.state
    return out.unique().tolist()


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_close_waits_for_a_call_not_yet_in_the_transport(transport, tmp_path):
    results = run_ranks(close_in_the_window, 2, transport, str(tmp_path), timeout=120)
    assert results == [[3.0], [3.0]], results


def close_while_a_call_is_queued(rank, world_size, transport):
    """A close that begins after an async call passed the open check but before
    it was queued lets it run on the group's one comm thread, after the call
    queued before it (it once started a second comm thread, racing the first:
    out of order across ranks). Rank 0's first call is held until the second
    was queued."""
    group = ringcomm.new_group(transport=transport, timeout=20)
    x, y = torch.full((NUMEL,), rank + 1.0), torch.full((NUMEL,), 10.0 * (rank + 1))
    if rank == 1:
        works = [ringcomm.all_reduce(t, group=group, async_op=True) for t in (x, y)]
        for work in works:
            work.wait()
        group.close()
        return [x.unique().tolist(), y.unique().tolist(), True]
    release = threading.Event()
    threads, closers = [], []
    enter, transport_all_reduce = group._enter, group.transport.all_reduce

    def held(**kwargs):
        threads.append(threading.get_ident())
        if len(threads) == 1:
            assert release.wait(WAIT_S), "the second call was never queued"
        return transport_all_reduce(**kwargs)

    def entered_then_closed(op, async_op):
        inline = enter(op, async_op)
        closers.append(threading.Thread(target=group.close))
        closers[0].start()
        _wait_for("close to begin", lambda: group.state is ringcomm.GroupState.CLOSED)
        return inline

    group.transport.all_reduce = held
    first = ringcomm.all_reduce(x, group=group, async_op=True)
    group._enter = entered_then_closed
    second = ringcomm.all_reduce(y, group=group, async_op=True)
    release.set()
    first.wait()
    second.wait()
    closers[0].join(WAIT_S)
    assert not closers[0].is_alive(), "close did not finish"
    return [x.unique().tolist(), y.unique().tolist(), len(set(threads)) == 1]


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_close_lets_a_call_being_queued_run_in_order(transport):
    results = run_ranks(close_while_a_call_is_queued, 2, transport, timeout=120)
    assert results == [[[3.0], [30.0], True]] * 2, results


def torch_dist_close_error(rank, world_size):
    """A closed torch_dist group refuses a call clearly (it raised AttributeError)."""
    group = ringcomm.new_group(transport="torch_dist", timeout=10)
    group.transport.close()  # the transport alone, under the group: a call in flight sees this
    with pytest.raises(RuntimeError, match=f"all_reduce: rank {rank}: the group is closed"):
        ringcomm.all_reduce(torch.ones(4), group=group)
    group.close()


def test_closed_torch_dist_transport_refuses_clearly():
    run_ranks(torch_dist_close_error, 2)


CYCLES = 50


def default_group_cycles(rank, world_size, folder):
    """init / use the default group / destroy, CYCLES times: nothing accumulates,
    and each world gets a group of its own."""
    # Closed by hand while the world lives on: nothing keeps the closed group (its finalizer is detached).
    closed = weakref.ref(ringcomm.default_group())
    ringcomm.destroy_default_group()
    gc.collect()
    assert closed() is None, f"rank {rank}: a default group closed by hand is still referenced"
    dist.destroy_process_group()  # the harness's world; each cycle makes its own

    def cycle(index: int) -> ringcomm.Group:
        dist.init_process_group("gloo", init_method=f"file://{folder}/world{index}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=30))
        x = torch.ones(8)
        ringcomm.all_reduce(x)
        assert torch.all(x == world_size), f"rank {rank} cycle {index}: {x}"
        group = ringcomm.default_group()
        dist.destroy_process_group()
        return group

    previous = cycle(0)  # first use loads what stays loaded
    before = resources()
    for index in range(1, CYCLES + 1):
        group = cycle(index)
        assert group is not previous, f"rank {rank} cycle {index}: the last world's default group came back"
        assert previous.state is ringcomm.GroupState.CLOSED, f"rank {rank}: the destroyed world's group is open"
        previous = group
    after = resources()
    grown = {k: (before[k], after[k]) for k in after if after[k] > before[k] + 2}
    assert not grown, f"rank {rank}: {CYCLES} init/destroy cycles grew {grown}"
    return before, after


def test_default_group_follows_the_world(tmp_path):
    run_ranks(default_group_cycles, 2, str(tmp_path), timeout=240)


STRESS_CYCLES = {"shm": 25, "torch_dist": 6}  # per path; benchmarks/lifecycle_soak.py runs 200


def stress_every_path(rank, world_size, transport):
    results = {}
    for seed, path in enumerate(PATHS):
        results[path] = stress(rank, world_size, path, transport, STRESS_CYCLES[transport], seed)
    for path, result in results.items():
        outcome = result["outcome"]
        assert not outcome["failures"], f"rank {rank} {transport} {path}: {outcome['failures'][:3]}"
        assert outcome["cycles"] == STRESS_CYCLES[transport] + 1
        grown = {k: v for k, v in result["after"].items() if v > result["before"][k] + 2}
        assert not grown, f"rank {rank} {transport} {path}: grew {grown}: {result}"
    return results


@pytest.mark.parametrize("transport", ["shm", pytest.param("torch_dist", marks=pytest.mark.slow)])
def test_close_and_abort_at_random_moments(transport):
    run_ranks(stress_every_path, 2, transport, timeout=240)


def windows_freed_while_in_use(rank, world_size):
    """Window tensors die (their finalizers unregister them, on this thread) while
    the comm thread runs collectives on another window: no crash, right results."""
    group = ringcomm.new_group(transport="shm", timeout=20)
    spare = [ringcomm.empty(1 << 12, group=group) for _ in range(40)]
    used = ringcomm.empty(1 << 16, group=group)
    for round_ in range(40):
        used.fill_(rank + 1.0)
        works = [ringcomm.all_reduce(part, group=group, async_op=True) for part in used.split(1 << 12)]
        spare.pop()  # unregisters a window while the comm thread reads the registry
        for work in works:
            work.wait()
        assert torch.all(used == world_size * (world_size + 1) / 2), f"rank {rank} round {round_}"
    group.close()


def test_window_freed_while_the_comm_thread_reads_the_registry():
    run_ranks(windows_freed_while_in_use, 2)


def test_documented_errors_are_what_the_code_says():
    """The stress tests' pattern matches the messages the code raises."""
    for message in ("all_reduce: rank 0: the group is closed", "all_reduce: rank 0: the group is aborted",
                    "all_reduce: rank 1 at step 0/1 (round 4): aborted (the group was aborted, ...)",
                    "all_reduce: rank 0 ... waiting for rank 1 to post its data: rank 1 closed the group"):
        assert DOCUMENTED.search(message), message
    assert not DOCUMENTED.search("all_reduce: rank 0 ...: Timed out after 10 s")
    assert not re.search(DOCUMENTED, "'NoneType' object has no attribute 'rank'")


class _DeadStore:
    """A store across a dead link: every call blocks (as TCPStore's do until their own timeout)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def _block(self, *args):
        self.release.wait(30)
        raise RuntimeError("store gone")

    set = get = check = _block


def test_failure_diagnosis_is_bounded_when_the_store_hangs():
    from ringcomm.transport import link

    store = _DeadStore()
    diagnosis = link.Diagnosis(None, 0, 2)
    diagnosis.store = store  # after start-up, when the link to the store's host died
    start = time.monotonic()
    note = diagnosis.explain("all_reduce: rank 0 failed")
    elapsed = time.monotonic() - start
    store.release.set()
    limit = link.EXPLAIN_WAIT_S + link.EXPLAIN_STORE_S
    assert elapsed < limit + 0.5, f"the diagnosis took {elapsed:.1f} s (bound {limit} s)"
    assert "store did not answer" in note, note


def abort_during_close(rank, world_size, transport):
    """A close waiting for a stuck call does not hold up an abort from a third
    thread: the call fails at once, and close and abort both return."""
    group = ringcomm.new_group(transport=transport, timeout=30)
    dist.barrier()
    if rank == 1:
        time.sleep(3.0)  # rank 0's call waits for this rank meanwhile
        with pytest.raises(RuntimeError, match=DOCUMENTED):
            _call("all_reduce", group)
        group.close()
        return
    closer = threading.Timer(0.1, group.close)
    aborter = threading.Timer(0.3, group.abort)
    closer.start()
    aborter.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted"):
        _call("all_reduce", group)
    elapsed = time.monotonic() - start
    closer.join(5)
    aborter.join(5)
    assert not closer.is_alive() and not aborter.is_alive(), f"{transport}: close or abort still waits"
    assert elapsed < 1.5, f"{transport}: the call ended {elapsed:.2f} s after start (abort at 0.3 s)"


def test_abort_is_not_held_up_by_a_waiting_close():
    run_ranks(abort_during_close, 2, "shm")
