"""[Note: memory guard] (zero/runtime/memory_guard.py): ranks under a memory
cgroup too small for their model states get zero's own MemoryError at
initialize, the same on every rank, instead of the kernel's OOM kill; a model
that fits trains under the same limit. Runs the ranks in a cgroup v1 memory
controller this test makes (root, as on the project's machines)."""
from __future__ import annotations

import os
import uuid
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks

import zero
from ringcomm.core import host

LIMIT = 400 * 2**20


def own_memory_cgroup() -> str | None:
    """This process's cgroup v1 memory folder, when there is one to make children in."""
    found = host.memory_cgroup_folder()
    return found[0] if found is not None and found[1] == 1 and os.access(found[0], os.W_OK) else None


@pytest.fixture
def cgroup():
    parent = own_memory_cgroup()
    if parent is None:
        pytest.skip("no writable cgroup v1 memory controller (needs root)")
    folder = os.path.join(parent, f"ringcomm-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(folder)
    try:
        with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
            f.write(str(LIMIT))
        yield folder
    finally:
        try:
            os.rmdir(folder)
        except OSError:
            pass


def config(stage: int) -> dict:
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}


def guarded_worker(rank: int, world_size: int, folder: str) -> dict:
    big = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])  # 32M parameters: 128 MiB
    with open(os.path.join(folder, "cgroup.procs"), "w") as f:  # from here on this rank is charged there
        f.write(str(os.getpid()))
    path, limit, _ = host.memory_cgroup()
    assert path == folder and limit == LIMIT, (path, limit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(MemoryError) as refused:  # Adam's states and buffers: ~0.4 GiB per rank more
            zero.initialize(model=big, config=config(0))
        del big
        small = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        engine, *_ = zero.initialize(model=small, config=config(2))
    engine.backward(engine(torch.randn(1, 256)).square().mean())
    engine.step()
    loss = engine(torch.randn(1, 256)).square().mean()
    dist.all_reduce(loss.detach())
    return {"error": str(refused.value), "trained": bool(torch.isfinite(loss))}


def test_a_cgroup_too_small_is_zeros_error_not_an_oom_kill(cgroup) -> None:
    results = run_ranks(guarded_worker, 2, cgroup, timeout=180)
    assert results[0]["error"] == results[1]["error"], results
    message = results[0]["error"]
    assert f"ranks [0, 1] on host {host_name()} share the memory cgroup {cgroup}" in message, message
    assert "limited to 0.39 GiB" in message and "need about" in message, message
    assert all(r["trained"] for r in results), results


def host_name() -> str:
    from ringcomm.transport.placement import host_name as name
    return name()
