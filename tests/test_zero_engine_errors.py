"""The engine's lifecycle and error paths: destroy() releases the swap files,
I/O threads and hooks (idempotent); GatheredParameters re-shards whatever fails."""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator

import pytest
import torch

from harness import run_ranks
from test_zero_offload import new_engine, run_steps
from zero_reference import MICRO, make_batch

import zero


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


class Injected(RuntimeError):
    pass


def assert_resharded(engine, masters: list[torch.Tensor], case: str) -> None:
    """No non-resident bucket is left gathered and the fp32 masters are `masters`."""
    gathered = [b.full is not None for b in engine.parts.group.buckets if not b.span.resident]
    assert not any(gathered), f"{case}: buckets left gathered: {gathered}"
    assert all(p.numel() == 0 for p in engine.module.parameters() if not p.ds_bucket[1].span.resident), \
        f"{case}: parameters left whole"
    for i, (a, b) in enumerate(zip(engine.full_params_fp32(), masters, strict=True)):
        assert torch.equal(a, b), f"{case}: master {i} changed"


@contextlib.contextmanager
def failing(obj: object, name: str, *, on_call: int = 1) -> Iterator[None]:
    """obj.name raises Injected from its `on_call`-th call on (earlier calls go through)."""
    original, calls, own = getattr(obj, name), [], name in vars(obj)

    def replacement(*args, **kwargs):
        calls.append(args)
        if len(calls) >= on_call:
            raise Injected(f"{name} call {len(calls)}")
        return original(*args, **kwargs)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        setattr(obj, name, original) if own else delattr(obj, name)


def gathered_errors_worker(rank: int, world_size: int, root: str) -> None:
    """GatheredParameters re-shards whatever fails (the body, the publish on
    exit, the third gather on entry) and a failed body publishes nothing; see
    [Note: leaving GatheredParameters]. Stage 3 under each offload."""
    nvme_path = os.path.join(root, f"nvme-rank{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    for optimizer, param in (("none", "none"), ("cpu", "cpu"), ("nvme", "none"), ("none", "nvme"), ("nvme", "nvme")):
        case = f"rank {rank}/{world_size} stage 3 offload_optimizer {optimizer} offload_param {param}"
        engine = new_engine(3, optimizer, world_size, nvme_path, param=param, init=True)
        run_steps(engine, rank, world_size, range(1))
        params, masters = list(engine.module.parameters()), engine.full_params_fp32()
        with pytest.raises(Injected):
            with zero.GatheredParameters(params, modifier_rank=0):
                if rank == 0:
                    for p in params:
                        p.data.fill_(3.0)
                raise Injected("body")
        assert_resharded(engine, masters, f"{case}, the body raised")
        with pytest.raises(Injected), failing(engine.parts.group.comm, "broadcast"):
            with zero.GatheredParameters(params, modifier_rank=0):
                pass
        assert_resharded(engine, masters, f"{case}, the exit raised")
        with pytest.raises(Injected), failing(engine.parts.group, "unshard", on_call=3):
            with zero.GatheredParameters(params):
                pass
        assert_resharded(engine, masters, f"{case}, the entry raised")
        with zero.GatheredParameters(params, modifier_rank=0):  # and the context still works
            if rank == 0:
                params[-1].data.fill_(0.5)
        assert torch.equal(engine.full_params_fp32()[-1], torch.full_like(masters[-1], 0.5)), case
        engine.destroy()


def test_gathered_parameters_reshards_on_errors() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-errors-") as root:
        run_ranks(gathered_errors_worker, 2, root, timeout=60)
