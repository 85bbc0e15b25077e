"""The engine's lifecycle and error paths: destroy() releases the swap files,
I/O threads and hooks (idempotent)."""
from __future__ import annotations

import os
import tempfile
import threading

import pytest

from harness import run_ranks
from test_zero_offload import new_engine, run_steps
from zero_reference import MICRO, make_batch


def swap_fds() -> list[str]:
    """This process's open descriptors on NVMe swap files (already unlinked)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if "zero-swap-" in target:
            out.append(target)
    return out


def io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("zero-nvme")]


def destroy_worker(rank: int, world_size: int, root: str) -> None:
    nvme_path = os.path.join(root, f"nvme-rank{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    engine = new_engine(3, "nvme", world_size, nvme_path)  # optimizer states and parameter shards swapped
    run_steps(engine, rank, world_size, range(1))
    assert len(swap_fds()) == 2 and io_threads(), f"rank {rank}: {swap_fds()} {io_threads()}"
    comm, closed = engine.parts.comm, []
    close = comm.close
    comm.close = lambda: closed.append(True) or close()
    scheduler, gatherer = engine.parts.group.scheduler, engine.parts.gatherer
    for _ in range(2):
        engine.destroy()
        assert swap_fds() == [] and io_threads() == [], f"rank {rank}: left open: {swap_fds()} {io_threads()}"
        assert closed == [True], f"rank {rank}: comm.close() called {len(closed)} times"
        assert scheduler._hooks == [] and gatherer.handles == [], f"rank {rank}: hooks left registered"
    x, _ = make_batch("transformer", MICRO, 0)
    for call in (lambda: engine(x), engine.step):
        with pytest.raises(RuntimeError, match=rf"after engine\.destroy\(\) on rank {rank}"):
            call()


def test_destroy_releases_files_threads_and_hooks() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-destroy-") as root:
        run_ranks(destroy_worker, 2, root, timeout=60)
