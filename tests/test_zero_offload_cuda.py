"""Offload with the model on a GPU: offload_optimizer cpu keeps fp32 masters and
Adam's states in pinned host memory and trains like the run without offload;
offload_param cpu keeps stage-3 shards pinned on the host; NVMe offload runs
from the GPU too. On two GPUs under NCCL, which carries no host tensors, the
offloaded runs' norms, steps and saves (host masters gathered) match the runs
without offload. Skipped without CUDA devices (benchmarks/gpu_check.py runs it
as its "offload" part)."""
from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import pytest
import torch

from harness import run_ranks
from test_zero_cuda import PROCESS_GROUP, needs_cuda, use_process_group
from test_zero_offload import compare, offload_sections
from zero_reference import CLIP, MICRO, STEPS, engine_config, loss_fn, make_batch, make_model

import zero

# NCCL (2.5 and later) refuses two ranks of one communicator on one device ("Duplicate GPU detected")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA devices: NCCL refuses two ranks on one device")


class GpuRun(NamedTuple):
    losses: list[float]
    params: list[torch.Tensor]  # the fp32 masters, whole, on the CPU
    engine: object
    norms: list[float]


def gpu_engine(device: torch.device, kind: str, stage: int, dtype_name: str, offload: str, nvme_path: str, *,
               world_size: int = 1, ratio: float = 1.0):
    """ratio: offload_optimizer.ratio."""
    sections = offload_sections(offload, stage, nvme_path)
    if ratio != 1.0:
        sections["offload_optimizer"]["ratio"] = ratio
    config = engine_config(stage, dtype_name, 1, world_size, **sections)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=make_model(kind).to(device), config=config)
    return engine


def train_on_gpu(device: torch.device, kind: str, stage: int, dtype_name: str, offload: str, nvme_path: str, *,
                 rank: int = 0, world_size: int = 1, ratio: float = 1.0) -> GpuRun:
    """Trains on rank's micro-batches of the global batches."""
    engine = gpu_engine(device, kind, stage, dtype_name, offload, nvme_path, world_size=world_size, ratio=ratio)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = (t.to(device) for t in make_batch(kind, MICRO * world_size, step))
        lo = rank * MICRO
        loss = loss_fn(kind, engine(x[lo:lo + MICRO]), y[lo:lo + MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    return GpuRun(losses, [p.cpu() for p in engine.full_params_fp32()], engine, norms)


def check_placement(engine, offload: str, stage: int, case: str) -> None:
    """Parameters on the GPU; the offloaded buckets' masters and states on the
    pinned host, the others' on the GPU (cpu offload)."""
    group = engine.parts.group
    assert all(p.device.type == "cuda" for p in engine.parameters()), f"{case}: a parameter left the GPU"
    if offload != "cpu":
        return
    assert any(group.offloaded(b) for b in group.buckets), f"{case}: no bucket offloaded"
    for bucket in group.buckets:
        host = group.offloaded(bucket)
        where = f"{case}: bucket {bucket.span.index} (offloaded: {host})"
        assert (bucket.master.device.type == "cpu") == host, f"{where}: master on {bucket.master.device}"
        assert not host or bucket.master.is_pinned(), f"{where}: master not pinned"
        for view, _, _ in bucket.master_views:
            for name in ("exp_avg", "exp_avg_sq"):
                state = engine.optimizer.state[view][name]
                assert state.device == bucket.master.device, f"{where}: {name} on {state.device}"
    if stage == 3:
        assert group.host_shards and all(t.is_pinned() for t in group.host_shards.values()), f"{case}: shards"
    assert engine.memory_report().host_nbytes > 0, f"{case}: {engine.memory_report()}"


def offload_gpu_worker(rank: int, world_size: int, init_file: str, nvme_path: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    use_process_group(PROCESS_GROUP["torch"], rank, world_size, init_file)
    for kind, stage, dtype_name in (("mlp", 1, "fp32"), ("transformer", 2, "bf16"), ("transformer", 3, "bf16")):
        expected = train_on_gpu(device, kind, stage, dtype_name, "none", nvme_path)
        for offload in ("cpu", "nvme"):
            case = f"{device} {kind} stage {stage} {dtype_name} offload {offload}"
            got = train_on_gpu(device, kind, stage, dtype_name, offload, nvme_path)
            check_placement(got[2], offload, stage, case)
            if dtype_name != "fp32":
                compare(case, kind, dtype_name, got[:2], expected[:2])
                continue
            # the device run steps with torch's AdamW on the GPU, the offloaded one with the host
            # kernel: the same update rounded in another order (a few ulps per step)
            torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(expected[0]), rtol=1e-5, atol=1e-6)
            for i, (p, q) in enumerate(zip(got[1], expected[1], strict=True)):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: parameter {i}: {m}")
    assert os.listdir(nvme_path) == [], "swap files left with names"


@needs_cuda
def test_offload_on_one_gpu(tmp_path) -> None:
    nvme_path = tmp_path / "nvme"
    nvme_path.mkdir()
    run_ranks(offload_gpu_worker, 1, str(tmp_path / "rendezvous"), str(nvme_path), timeout=180)


TWO_GPU_CASES = (("mlp", 1, "fp32", 1.0), ("transformer", 2, "bf16", 0.5), ("transformer", 3, "bf16", 1.0))


def offload_two_gpus_worker(rank: int, world_size: int, init_file: str, root: str) -> None:
    """Under NCCL: the gradient norm (read while the copies to host run), the
    steps and a save (the host masters all-gathered through the gloo group
    beside NCCL) as without offload; ratio 0.5 keeps some buckets on the GPU."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    use_process_group(PROCESS_GROUP["torch"], rank, world_size, init_file)
    for kind, stage, dtype_name, ratio in TWO_GPU_CASES:
        case = f"rank {rank}/{world_size} {device} {kind} stage {stage} {dtype_name} offload cpu ratio {ratio}"
        expected = train_on_gpu(device, kind, stage, dtype_name, "none", "", rank=rank, world_size=world_size)
        got = train_on_gpu(device, kind, stage, dtype_name, "cpu", "", rank=rank, world_size=world_size, ratio=ratio)
        assert got.engine.parts.comm.host is not None, f"{case}: no gloo group beside NCCL for host tensors"
        check_placement(got.engine, "cpu", stage, case)
        assert got.engine.skipped_steps == 0 and max(got.norms) > CLIP, f"{case}: {got.engine.skipped_steps=} {got.norms}"
        # the first step's gradients are the same values in both runs: so is their norm (summation order aside)
        torch.testing.assert_close(got.norms[0], expected.norms[0], rtol=1e-6, atol=0.0,
                                   msg=lambda m: f"{case}: first step's norm: {m}")
        if dtype_name != "fp32":
            compare(case, kind, dtype_name, got[:2], expected[:2])
        else:  # as the one-GPU test: torch's AdamW on the GPU against the host kernel, a few ulps per step
            torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(expected.losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case}: losses: {m}")
            for i, (p, q) in enumerate(zip(got.params, expected.params, strict=True)):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: parameter {i}: {m}")
        save_dir = os.path.join(root, f"stage{stage}-{kind}")
        got.engine.save_checkpoint(save_dir)
        resumed = gpu_engine(device, kind, stage, dtype_name, "cpu", "", world_size=world_size, ratio=ratio)
        resumed.load_checkpoint(save_dir)
        for i, (p, q) in enumerate(zip(resumed.full_params_fp32(), got.params, strict=True)):
            assert torch.equal(p.cpu(), q), f"{case}: parameter {i} differs after a save and a load"
        for engine in (expected.engine, got.engine, resumed):
            engine.destroy()


@needs_two_gpus
def test_offload_on_two_gpus(tmp_path) -> None:
    run_ranks(offload_two_gpus_worker, 2, str(tmp_path / "rendezvous"), str(tmp_path), timeout=240)

