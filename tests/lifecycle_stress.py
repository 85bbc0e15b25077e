"""Close or abort a group from a second thread while the first runs a loop of
collectives, at a random moment, cycle after cycle: the rank worker shared by
tests/test_close_abort.py (a few cycles) and benchmarks/lifecycle_soak.py (the
soak). Every cycle must end with the loop stopped by a documented error (see
[Note: group lifetime] in ringcomm/comm/group.py), no wrong result, no hang."""
from __future__ import annotations

import gc
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm

PATHS = ("api-sync", "api-async", "backend-inline", "backend-thread")
KILLS = {"api": ("close", "abort"), "backend": ("shutdown", "abort", "destroy_process_group")}
# What a loop may end with: its own group refused or aborted the call, or a peer
# closed or aborted its side (shm names the rank; under torch_dist, gloo says the
# peer's connection closed: [Note: torch_dist abort] in ringcomm/algorithms/flat_ring.py).
DOCUMENTED = re.compile(r"the group is (closed|aborted)|: aborted|(closed|aborted) the group|"
                        r"Connection (closed|reset) by peer")
# torch's own refusals of a group that destroy_process_group removed (from another
# thread: which one depends on how far torch got), before any backend sees the call
DESTROYED = re.compile(r"is not initialized in the world group map|is not registered, please create group")
LOOP_JOIN_S = 20.0  # a loop still running this long after the kill is a hang
TIMEOUT_S = 10.0  # the groups' timeout


@dataclass
class Outcome:
    cycles: int = 0
    ops: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # documented errors by kind
    failures: list[str] = field(default_factory=list)  # hangs, wrong results, undocumented errors
    seconds: float = 0.0


def resources() -> dict[str, int]:
    """Open fds, threads and ringcomm shared-memory mappings of this process, once
    the garbage collector ran (a failed call's traceback holds its frames in a cycle)."""
    gc.collect()
    with open("/proc/self/maps") as maps:
        mappings = sum("ringcomm-" in line for line in maps)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "mappings": mappings}


def _make(path: str, transport: str):
    if path.startswith("api"):
        return ringcomm.new_group(transport=transport, timeout=TIMEOUT_S)
    return dist.new_group(backend="ringcomm", timeout=timedelta(seconds=TIMEOUT_S))


def _one_op(path: str, group, x: torch.Tensor) -> None:
    if path == "api-sync":
        ringcomm.all_reduce(x, group=group)
    elif path == "api-async":
        works = [ringcomm.all_reduce(part, group=group, async_op=True) for part in x.split(max(1, x.numel() // 3))]
        for work in works:
            work.wait()
    elif path == "backend-inline":
        dist.all_reduce(x, group=group)
    else:
        dist.all_reduce(x, group=group, async_op=True).wait()


def _kill(kind: str, group) -> None:
    if kind == "destroy_process_group":
        dist.destroy_process_group(group)
    else:
        getattr(group, kind)()


def _kind(message: str) -> str:
    match = DOCUMENTED.search(message)
    return match[0].strip(": ") if match else ""


def cycle(rank: int, world_size: int, path: str, transport: str, rngs: tuple[random.Random, random.Random],
          outcome: Outcome) -> None:
    """`rngs`: one seeded alike on every rank (the call), one of this rank (when and how it stops)."""
    shared, own = rngs
    group = _make(path, transport)
    numel = shared.choice((1, 1000, 1 << 18))  # one-shot, staged, segmented
    kill = own.choice(KILLS["api" if path.startswith("api") else "backend"])
    ended: list[BaseException] = []
    ops = [0]

    def loop() -> None:
        x = torch.empty(numel)
        try:
            while True:
                x.fill_(rank + 1.0)
                _one_op(path, group, x)
                expected = world_size * (world_size + 1) / 2
                if not bool((x == expected).all()):
                    outcome.failures.append(f"{path}/{kill}: rank {rank} got a wrong result after {ops[0]} ops: "
                                            f"{x.unique()[:4].tolist()} != {expected}")
                    return
                ops[0] += 1
        except BaseException as err:  # noqa: BLE001 - classified below
            ended.append(err)

    thread = threading.Thread(target=loop, name=f"loop-{path}")
    thread.start()
    time.sleep(own.uniform(0.0, 0.004))
    _kill(kill, group)
    thread.join(LOOP_JOIN_S)
    outcome.cycles += 1
    outcome.ops += ops[0]
    if thread.is_alive():
        outcome.failures.append(f"{path}/{kill}: rank {rank}: the loop still runs {LOOP_JOIN_S} s after {kill}")
        return
    if ended:
        message = f"{type(ended[0]).__name__}: {ended[0]}"
        kind = _kind(message) if isinstance(ended[0], RuntimeError) else ""
        if kill == "destroy_process_group" and isinstance(ended[0], ValueError) and DESTROYED.search(message):
            kind = "destroyed (torch refuses the call)"
        if kind:
            outcome.errors[kind] = outcome.errors.get(kind, 0) + 1
        else:
            outcome.failures.append(f"{path}/{kill}: rank {rank}: undocumented error {message[:400]}")
    if kill != "destroy_process_group" and not path.startswith("api"):
        dist.destroy_process_group(group)


def stress(rank: int, world_size: int, path: str, transport: str, cycles: int, seed: int) -> dict:
    """Runs `cycles` cycles on one path; returns the Outcome and the resources
    before and after (as a dict: it crosses a pipe)."""
    os.environ["RINGCOMM_TRANSPORT"] = transport  # the backend's groups too
    os.environ["RINGCOMM_ASYNC"] = "thread" if path == "backend-thread" else "inline"
    rngs = (random.Random(seed), random.Random(seed * 1000 + rank + 1))
    outcome = Outcome()
    cycle(rank, world_size, path, transport, rngs, outcome)  # first use loads what stays loaded
    dist.barrier()
    before = resources()
    start = time.perf_counter()
    for _ in range(cycles):
        cycle(rank, world_size, path, transport, rngs, outcome)
    outcome.seconds = time.perf_counter() - start
    dist.barrier()
    time.sleep(0.05)  # comm threads of aborted groups exit once their queue drained
    return {"outcome": outcome.__dict__, "before": before, "after": resources()}
