"""Unmodified DDP, DDP + ZeroRedundancyOptimizer, FSDP2 fully_shard and DeepSpeed
ZeRO 1-3 train a small model on backend "ringcomm" to the same parameters as
on gloo."""
from __future__ import annotations

import collections
import copy
import importlib.util
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import run_ranks

NUM_STEPS = 4
LR = 1e-2
TRANSPORT_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
LEAN_OPS = ("all_reduce_tensor", "reduce_scatter_tensors", "all_gather_tensors")  # ringcomm.comm.collectives' lean path


def count_transport_calls() -> collections.Counter:
    """Counts the calls that reach ringcomm's shm transport from now on, through
    its methods or the lean path (proof that a wrapper's collectives ran on
    ringcomm, not on a gloo fallback)."""
    from ringcomm import _C
    from ringcomm.transport.shm import ShmTransport

    calls: collections.Counter = collections.Counter()
    for name in TRANSPORT_OPS:
        def counted(self, *args, _name=name, _original=getattr(ShmTransport, name), **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)
        setattr(ShmTransport, name, counted)
    for name in LEAN_OPS:
        def counted_lean(*args, _name=name, _original=getattr(_C, name)):
            ran = _original(*args)
            calls[_name] += ran  # False: refused, the call goes on to the transport's methods
            return ran
        setattr(_C, name, counted_lean)
    return calls


def reinit(rank: int, world_size: int, init_method: str, backend: str) -> None:
    """Swaps the harness's gloo default group for `backend` at `init_method`."""
    dist.barrier()  # every rank has finished connecting the harness's gloo group before any leaves it
    dist.destroy_process_group()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    for step in range(NUM_STEPS):
        inputs, targets = batch(step, rank)
        loss = ((model(inputs) - targets) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def train_ddp(base: nn.Module, pg: dist.ProcessGroup, rank: int, *, zero: bool) -> list[torch.Tensor]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(copy.deepcopy(base), process_group=pg, bucket_cap_mb=0.002)  # several buckets
    if zero:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=pg, lr=LR)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, optimizer, rank)
    return [p.detach().clone() for p in model.parameters()]


def train_fsdp2(base: nn.Module, pg: dist.ProcessGroup, rank: int, *, bf16: bool = False) -> list[torch.Tensor]:
    """fully_shard per Linear and at the root; bf16: parameters all-gathered and
    gradients reduce-scattered in bfloat16 (MixedPrecisionPolicy)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = copy.deepcopy(base)
    mesh = DeviceMesh.from_group(pg, "cpu")
    precision = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=precision)
    fully_shard(model, mesh=mesh, mp_policy=precision)
    train(model, torch.optim.Adam(model.parameters(), lr=LR), rank)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def torch_models_worker(rank: int, world_size: int, init_method: str) -> dict[str, float]:
    """Trains each wrapper on a gloo group, then on the ringcomm default group;
    returns the largest parameter difference per wrapper."""
    reinit(rank, world_size, init_method, "ringcomm")
    gloo, ours = dist.new_group(backend="gloo"), dist.group.WORLD
    base = small_model()
    runs = {
        "ddp": lambda pg: train_ddp(base, pg, rank, zero=False),
        "ddp+zero_redundancy_optimizer": lambda pg: train_ddp(base, pg, rank, zero=True),
        "fsdp2": lambda pg: train_fsdp2(base, pg, rank),
        "fsdp2 bf16": lambda pg: train_fsdp2(base, pg, rank, bf16=True),
    }
    diffs = {}
    for name, run in runs.items():
        want = run(gloo)
        calls = count_transport_calls()
        got = run(ours)
        assert sum(calls.values()) >= NUM_STEPS, f"rank {rank}: {name} made only {dict(calls)} ringcomm calls"
        diffs[name] = max((g - w).abs().max().item() for g, w in zip(got, want))
        trained = any((w - p).abs().max() > 0 for w, p in zip(want, base.parameters()))
        assert trained, f"rank {rank}: {name} did not change the parameters"
    return diffs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_wrappers_match_gloo(world_size: int, tmp_path) -> None:
    env = {"RINGCOMM_ASYNC": "thread" if world_size == 3 else "inline"}  # DDP's and FSDP2's async calls both ways
    diffs = run_ranks(torch_models_worker, world_size, f"file://{tmp_path}/rdv", timeout=100, env=env)
    # 2 ranks: a + b is the same sum in any order (and rounds once in bf16 too), so
    # the result is bitwise gloo's.
    # 3 ranks: ringcomm and gloo add in different orders, 1 ulp per fp32 gradient
    # element (~3e-8 here) that 4 optimizer steps carry into the parameters. In bf16
    # gloo rounds the 3-term sum twice and ringcomm once: gradients differ by a bf16
    # ulp, and Adam, which normalizes the gradient, turns that into up to 2 lr per step
    # where it flips the sign of a tiny gradient: 2 * NUM_STEPS * lr at most.
    for rank, rank_diffs in enumerate(diffs):
        for name, diff in rank_diffs.items():
            limit = 0.0 if world_size == 2 else 2 * NUM_STEPS * LR if "bf16" in name else 1e-6
            assert diff <= limit, f"rank {rank}: {name} on ringcomm differs from gloo by {diff} > {limit}"


def deepspeed_worker(rank: int, world_size: int, init_method: str, backend: str) -> dict[int | str, object]:
    """Trains the model with DeepSpeed ZeRO stages 1, 2, 3 on `backend`; returns the
    full parameters per stage, flat, as floats (tensors would travel back by
    shared memory that the finished rank no longer serves)."""
    from deepspeed_cpu import import_deepspeed

    deepspeed = import_deepspeed()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))  # what a launcher sets
    reinit(rank, world_size, init_method, backend)
    deepspeed.init_distributed(dist_backend=backend)
    assert dist.get_backend() == backend, f"rank {rank}: DeepSpeed runs on {dist.get_backend()}, not {backend}"
    params, calls = {}, count_transport_calls()
    for stage in (1, 2, 3):
        config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500,
                                        "stage3_param_persistence_threshold": 0}}
        model = small_model()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR),
                                          config=config)
        train_deepspeed(engine, rank)
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            params[stage] = torch.cat([p.detach().flatten() for p in engine.module.parameters()]).tolist()
        engine.destroy()
        params[f"calls {stage}"] = sum(calls.values())
    return params


def train_deepspeed(engine, rank: int) -> None:
    for step in range(NUM_STEPS):
        inputs, targets = batch(step, rank)
        loss = ((engine(inputs) - targets) ** 2).mean()
        engine.backward(loss)
        engine.step()


@pytest.mark.timeout(150)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed (test extra)")
@pytest.mark.slow
def test_deepspeed_zero_matches_gloo(tmp_path) -> None:
    env = {"DS_ACCELERATOR": "cpu"}
    want = run_ranks(deepspeed_worker, 2, f"file://{tmp_path}/gloo", "gloo", timeout=120, env=env)
    got = run_ranks(deepspeed_worker, 2, f"file://{tmp_path}/ringcomm", "ringcomm", timeout=120, env=env)
    for rank in range(2):
        assert want[rank]["calls 3"] == 0, f"rank {rank}: the gloo run reached ringcomm: {want[rank]}"
        for stage in (1, 2, 3):
            made = got[rank][f"calls {stage}"] - got[rank].get(f"calls {stage - 1}", 0)
            assert made >= NUM_STEPS, f"rank {rank}: ZeRO stage {stage} made only {made} ringcomm calls"
            g, w = torch.tensor(got[rank][stage]), torch.tensor(want[rank][stage])
            # 2 ranks: every reduction is a + b, so ringcomm must match gloo bitwise.
            assert torch.equal(g, w), f"rank {rank}: ZeRO stage {stage}: max parameter diff {(g - w).abs().max()}"
