"""Run a benchmark worker on every rank: under torchrun (or any launcher that
sets RANK/WORLD_SIZE/MASTER_ADDR) use its ranks, else spawn local ranks.

A rank that fails or exceeds the deadline ends the whole run with a message
naming it; surviving ranks are killed, never left hanging."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta


def under_launcher() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(worker: Callable, rank: int, world_size: int, port: int, args, timeout_s: float, backend: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        _init_and_run(worker, args, timeout_s, backend)
    except BaseException:
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


def _init_and_run(worker: Callable, args, timeout_s: float, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "ringcomm":
        import ringcomm  # noqa: F401  (registers the backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    try:
        worker(args)
    finally:
        dist.destroy_process_group()


def launch(worker: Callable, args, *, nproc: int, timeout_s: float, deadline_s: float, backend: str = "gloo") -> int:
    """Runs worker(args) on every rank, the default group on `backend`;
    returns the exit code for the whole run."""
    if under_launcher():
        _init_and_run(worker, args, timeout_s, backend)
        return 0
    context = mp.get_context("spawn")
    port = _free_port()
    procs = [context.Process(target=_entry, args=(worker, r, nproc, port, args, timeout_s, backend), name=f"rank{r}")
             for r in range(nproc)]
    for proc in procs:
        proc.start()
    end = time.monotonic() + deadline_s
    failed = None
    while any(p.is_alive() for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
        if failed is not None or time.monotonic() > end:
            break
        time.sleep(0.05)
    failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), failed)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
    if failed is not None:
        print(f"benchmark failed: rank {failed} exited with code {procs[failed].exitcode} "
              f"(see its error above); other ranks stopped", file=sys.stderr)
        return 1
    if hung:
        print(f"benchmark failed: ranks {hung} still running after {deadline_s:.0f} s; killed", file=sys.stderr)
        return 1
    return 0
