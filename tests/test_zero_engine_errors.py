"""The engine's lifecycle and error paths: destroy() releases the swap files,
I/O threads and hooks (idempotent); GatheredParameters re-shards whatever fails;
save_checkpoint's barriers time out on every backend, naming the missing rank."""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from test_zero_offload import new_engine, run_steps
from zero_reference import MICRO, make_batch

import zero
from zero.checkpoint.parts import CheckpointOptions


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


def barrier_worker(rank: int, world_size: int, root: str) -> None:
    """On the ringcomm backend (whose dist.barrier() waits for the transport's
    300 s), rank 1 fails between save_checkpoint's barriers: rank 0 fails within
    the checkpoint's barrier timeout, naming rank 1. Rank 1 stays alive until
    then, so that nothing but the timeout can end rank 0's wait."""
    dist.destroy_process_group()
    zero.init_distributed(dist_backend="ringcomm", init_method=f"file://{root}/rendezvous-ringcomm", rank=rank,
                          world_size=world_size)
    assert dist.get_backend() == "ringcomm", f"rank {rank}: {dist.get_backend()}"
    engine = new_engine(2, "none", world_size, root)
    run_steps(engine, rank, world_size, range(1))
    store = dist.distributed_c10d._get_default_store()

    def hook(phase: str, at_rank: int) -> None:
        if rank == 1 and phase == "written":
            raise Injected("rank 1 fails after writing its shards")
    engine.checkpoint_options = CheckpointOptions(timeout_s=2.0, on_phase=hook)
    start = time.monotonic()
    try:
        if rank == 1:
            with pytest.raises(Injected):
                engine.save_checkpoint(os.path.join(root, "ckpt"))
            store.wait(["test/rank0-done"], timedelta(seconds=60))
            return
        with pytest.raises(RuntimeError, match=r"shards written: rank 0 waited 2.0 s .* rank\(s\) \[1\] of 2 did not"):
            engine.save_checkpoint(os.path.join(root, "ckpt"))
        elapsed = time.monotonic() - start
        assert elapsed < 10.0, f"rank 0: the barrier failed after {elapsed:.1f} s, not within its 2 s timeout"
        store.set("test/rank0-done", "1")
    finally:
        engine.destroy()


def test_checkpoint_barrier_times_out_on_any_backend() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-barrier-") as root:
        run_ranks(barrier_worker, 2, root, timeout=40)
