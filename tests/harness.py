"""run_ranks: run a function on N CPU ranks, each a separate process joined by a
file-based rendezvous. The first failing rank fails the call with every rank's
traceback; a deadline kills ranks that hang."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

_CONTEXT = mp.get_context("forkserver")
# Imported once per test process, in the server the ranks fork from, instead of once per rank:
# torch._dynamo is imported by the first torch.optim optimizer a process makes (1.7 CPU-s here),
# zero's engine by zero.initialize (0.3 CPU-s more).
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "ringcomm", "zero.runtime.build"])


def _worker(fn: Callable, rank: int, world_size: int, init_file: str, args: tuple, env: dict, conn) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        try:
            import ringcomm

            ringcomm.destroy_default_group()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        conn.close()


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 120.0, env: dict | None = None,
              may_die: frozenset[int] = frozenset()) -> list:
    """Runs fn(rank, world_size, *args) on `world_size` processes; returns each rank's
    result. Ranks in `may_die` may end without a result (killed on purpose)."""
    with tempfile.TemporaryDirectory(prefix="ringcomm-test-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        pipes, procs = [], []
        for rank in range(world_size):
            parent, child = _CONTEXT.Pipe(duplex=False)
            proc = _CONTEXT.Process(target=_worker, args=(fn, rank, world_size, init_file, args, env or {}, child),
                                    name=f"rank{rank}")
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        grace_end = None
        while len(results) < world_size:
            for rank, (pipe, proc) in enumerate(zip(pipes, procs)):
                if rank in results:
                    continue
                if pipe.poll():
                    try:
                        results[rank] = pipe.recv()
                    except EOFError:
                        results[rank] = ("died", f"exit code {proc.exitcode}")
                elif not proc.is_alive() and not pipe.poll():
                    results[rank] = ("died", f"exited with code {proc.exitcode} without a result")
            failed = any(status != "ok" and not (status == "died" and r in may_die) for r, (status, _) in results.items())
            now = time.monotonic()
            if failed and grace_end is None:
                grace_end = now + 10.0  # let the other ranks report their own errors
            if now > deadline or (grace_end is not None and now > grace_end):
                break
            time.sleep(0.005)
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # it exited just now
                    pass
                results.setdefault(rank, ("hung", f"killed after {timeout} s without finishing"))
            proc.join()
    failures = {r: v for r, v in sorted(results.items()) if v[0] != "ok" and not (v[0] == "died" and r in may_die)}
    if failures:
        report = "\n".join(f"--- rank {r}: {status}\n{detail}" for r, (status, detail) in failures.items())
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed running {fn.__name__}:\n{report}")
    return [results[r][1] if results[r][0] == "ok" else None for r in range(world_size)]


def shm_entries() -> set[str]:
    """ringcomm's names in /dev/shm now."""
    return set(glob.glob("/dev/shm/ringcomm-*"))


def assert_no_new_shm(before: set[str], grace_s: float = 3.0) -> None:
    """Nothing was left in /dev/shm since `before`. Names live there only during
    a group's set-up, so a name that goes within `grace_s` belongs to a set-up
    still running elsewhere on this host (another test run), not to a leak."""
    deadline = time.monotonic() + grace_s
    while shm_entries() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = shm_entries() - before
    assert not left, f"left in /dev/shm: {left}"
