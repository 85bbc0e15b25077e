"""Fault injection: a peer stopped (SIGSTOP) or killed (SIGKILL) during each
collective kind, through the public API (inline and on the comm thread) and
through the torch.distributed backend (RINGCOMM_ASYNC inline and thread, both
forced), on both transports. Every surviving rank must raise a RuntimeError
naming the op and the peer within 2x the timeout, on every path by which the
caller can learn the result (the call, Work.wait / is_success / exception,
the future), and nothing may be left behind in /dev/shm."""
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
from harness import assert_no_new_shm, run_ranks, shm_entries
from torch.distributed.distributed_c10d import AllgatherOptions

from ringcomm.comm.group import GroupOptions
from ringcomm.backend.process_group import ProcessGroupRingcomm

TIMEOUT_S = 1.0
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")
MODES = ("inline", "comm_thread", "backend_inline", "backend_thread")
NUMEL = 1 << 20  # 4 MiB of float32: several segments, so a killed peer dies mid-op


# ---- one collective through each path ----------------------------------------------------------------------
def make_group(mode: str, store: dist.Store, rank: int, transport: str):
    """A 2-rank group of the given mode: a ringcomm.Group or the backend's ProcessGroup."""
    if mode in ("inline", "comm_thread"):
        return ringcomm.create_group(store, rank, 2, options=GroupOptions(transport=transport, timeout_s=TIMEOUT_S))
    os.environ["RINGCOMM_ASYNC"] = "thread" if mode == "backend_thread" else "inline"
    return ProcessGroupRingcomm(store, rank, 2, timedelta(seconds=TIMEOUT_S))


def close_group(group) -> None:
    if isinstance(group, ringcomm.Group):
        group.close()
    else:
        group.shutdown()


def call(mode: str, group, op: str, numel: int = NUMEL):
    """Runs `op` once; returns its Work (None when it finished inline)."""
    x, out = torch.ones(numel), torch.empty(numel // 2)
    if mode in ("inline", "comm_thread"):
        async_op = mode == "comm_thread"
        calls = {
            "all_reduce": lambda: ringcomm.all_reduce(x, group=group, async_op=async_op),
            "reduce_scatter": lambda: ringcomm.reduce_scatter(out, x, group=group, async_op=async_op),
            "all_gather": lambda: ringcomm.all_gather(x, out, group=group, async_op=async_op),
            "broadcast": lambda: ringcomm.broadcast(x, 0, group=group, async_op=async_op),
            "barrier": lambda: ringcomm.barrier(group=group, async_op=async_op),
        }
        return calls[op]()
    calls = {  # asyncOp=True, as DDP's reducer calls it: the comm thread in thread mode
        "all_reduce": lambda: group.allreduce([x], _opts(dist.AllreduceOptions())),
        "reduce_scatter": lambda: group.reduce_scatter_single(out, x, _opts(dist.ReduceScatterOptions())),
        "all_gather": lambda: group.all_gather_single(x, out, _opts(AllgatherOptions())),
        "broadcast": lambda: group.broadcast([x], _opts(dist.BroadcastOptions())),
        "barrier": lambda: group.barrier(_opts(dist.BarrierOptions())),
    }
    return calls[op]()


def _opts(options):
    options.asyncOp = True
    return options


def expect_failure(mode: str, group, op: str, *, attempts: int = 1) -> tuple[str, float]:
    """Calls `op` until it fails (at most `attempts` times); checks every way the
    failure is reported. Returns the message and the seconds the failing call took."""
    for _ in range(attempts):
        start = time.monotonic()
        work = None
        try:
            work = call(mode, group, op)
            if work is None:
                continue
            work.wait()
        except RuntimeError as err:  # inline: the call raises; async: wait() does
            elapsed = time.monotonic() - start
            if work is not None:
                check_failed_work(work, f"{op} ({mode})")
            return str(err), elapsed
    raise AssertionError(f"{op} ({mode}): {attempts} calls succeeded with a dead or stopped peer")


def check_failed_work(work, where: str) -> None:
    assert work.is_completed() and not work.is_success(), f"{where}: a failed Work reports success"
    assert work.exception() is not None, f"{where}: a failed Work has no exception()"
    with pytest.raises(RuntimeError):
        work.wait()
    for read in (lambda f: f.wait(), lambda f: f.value()):
        with pytest.raises(RuntimeError, match="rank 1"):
            read(work.get_future())


def check_message(message: str, elapsed: float, op: str, mode: str) -> None:
    where = f"{op} ({mode})"
    assert op in message, f"{where}: op not named: {message}"
    assert "rank 1" in message, f"{where}: the peer is not named: {message}"
    assert elapsed < 2 * TIMEOUT_S + 0.5, f"{where}: took {elapsed:.2f} s to fail (timeout {TIMEOUT_S} s): {message}"


# ---- SIGSTOP: one spawn per transport, every op x every mode -------------------------------------------------
def stop_peer_every_op(rank, world_size, transport):
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    peer_pid = int(store.get(f"pid/{1 - rank}"))
    failures = []
    for index, (mode, op) in enumerate((m, o) for m in MODES for o in OPS):
        group = make_group(mode, dist.PrefixStore(f"stop/{index}/", store), rank, transport)
        work = call(mode, group, op, numel=1024)  # both ranks alive: it succeeds
        if work is not None:
            work.wait()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 resumes us once it has seen the failure
        else:
            _wait_stopped(peer_pid)
            try:
                check_message(*expect_failure(mode, group, op), op, mode)
            except AssertionError as err:
                failures.append(str(err))
            finally:
                os.kill(peer_pid, signal.SIGCONT)
        close_group(group)
        dist.barrier()  # the world's gloo group: both ranks start the next case together
    assert not failures, "\n".join(failures)


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} did not stop")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_stopped_peer_fails_every_op_in_every_mode(transport):
    before = shm_entries()
    run_ranks(stop_peer_every_op, 2, transport, env={"RINGCOMM_TRANSPORT": transport}, timeout=240)
    assert_no_new_shm(before)


# ---- SIGKILL: rank 0 against one victim per case (global ranks 1..5), mid-op ---------------------------------
KILL_CASES = [  # (op, mode): every op, every mode at least once
    ("all_reduce", "backend_thread"), ("reduce_scatter", "backend_inline"), ("all_gather", "comm_thread"),
    ("broadcast", "inline"), ("barrier", "backend_thread"),
]


def kill_peer_every_op(rank, world_size, transport, cases):
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        failures = []
        for victim, (op, mode) in enumerate(cases, start=1):
            store.set(f"turn/{victim}", "go")
            group = make_group(mode, dist.PrefixStore(f"kill/{victim}/", store), 0, transport)
            try:
                check_message(*expect_failure(mode, group, op, attempts=10_000), op, mode)
            except AssertionError as err:
                failures.append(str(err))
            close_group(group)
        assert not failures, "\n".join(failures)
        return
    op, mode = cases[rank - 1]
    store.wait([f"turn/{rank}"], timedelta(seconds=120))
    group = make_group(mode, dist.PrefixStore(f"kill/{rank}/", store), 1, transport)
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    while True:  # the timer kills this process in the middle of one of these
        work = call(mode, group, op)
        if work is not None:
            work.wait()


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_killed_peer_fails_every_op(transport):
    before = shm_entries()
    victims = frozenset(range(1, len(KILL_CASES) + 1))
    run_ranks(kill_peer_every_op, len(KILL_CASES) + 1, transport, KILL_CASES, env={"RINGCOMM_TRANSPORT": transport},
              may_die=victims, timeout=240)
    assert_no_new_shm(before)


# ---- training steps: DDP and the ZeRO engine on the backend, a peer killed during backward ------------------
def kill_during_training(rank, world_size, trainer, async_mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    step = _ddp_step(model) if trainer == "ddp" else _zero_step(model, overlap_comm=async_mode == "thread")
    batch = torch.randn(32, 256)
    for _ in range(3):
        step(batch)  # all ranks alive
    if rank == 1:
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        for _ in range(10_000):
            step(batch)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1" in message, f"{trainer}: the dead peer is not named: {message}"
    assert elapsed < 2 * TIMEOUT_S + 1.0, f"{trainer}: took {elapsed:.2f} s to fail: {message}"


def _ddp_step(model):
    pg = dist.new_group(backend="ringcomm", timeout=timedelta(seconds=TIMEOUT_S))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=0.25)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step(batch):
        optimizer.zero_grad()
        ddp(batch).square().mean().backward()
        optimizer.step()

    return step


def _zero_step(model, overlap_comm: bool):
    import zero

    config = {"train_micro_batch_size_per_gpu": 32,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 65536, "overlap_comm": overlap_comm},
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=config,
                                 comm_backend="ringcomm")

    def step(batch):
        engine.backward(engine(batch).square().mean())
        engine.step()

    return step


@pytest.mark.parametrize("async_mode", ["inline", "thread"])
@pytest.mark.parametrize("trainer", ["ddp", "zero"])
def test_killed_peer_during_training_step(trainer, async_mode):
    """DDP on the backend (RINGCOMM_ASYNC forced); the ZeRO engine on ringcomm
    (thread: overlap_comm, its buckets on the comm thread)."""
    before = shm_entries()
    env = {"RINGCOMM_ASYNC": async_mode, "RINGCOMM_TIMEOUT": str(TIMEOUT_S)}
    run_ranks(kill_during_training, 2, trainer, async_mode, env=env, may_die=frozenset({1}), timeout=120)
    assert_no_new_shm(before)
