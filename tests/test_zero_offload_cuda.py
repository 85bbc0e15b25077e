"""Offload with the model on a GPU: offload_optimizer cpu keeps fp32 masters and
Adam's states in pinned host memory and trains like the run without offload;
offload_param cpu keeps stage-3 shards pinned on the host; NVMe offload runs
from the GPU too. Skipped without CUDA devices (benchmarks/gpu_check.py runs it
as its "offload" part)."""
from __future__ import annotations

import os
import warnings

import torch

from harness import run_ranks
from test_zero_cuda import PROCESS_GROUP, needs_cuda, use_process_group
from test_zero_offload import compare, offload_sections
from zero_reference import MICRO, STEPS, engine_config, loss_fn, make_batch, make_model

import zero


def train_on_gpu(device: torch.device, kind: str, stage: int, dtype_name: str, offload: str, nvme_path: str):
    config = engine_config(stage, dtype_name, 1, 1, **offload_sections(offload, stage, nvme_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=make_model(kind).to(device), config=config)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in make_batch(kind, MICRO, step))
        loss = loss_fn(kind, engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, [p.cpu() for p in engine.full_params_fp32()], engine


def check_placement(engine, offload: str, stage: int, case: str) -> None:
    """Parameters on the GPU; masters and states on the pinned host (cpu offload)."""
    group = engine.parts.group
    assert all(p.device.type == "cuda" for p in engine.parameters()), f"{case}: a parameter left the GPU"
    if offload != "cpu":
        return
    for bucket in group.buckets:
        assert bucket.master.device.type == "cpu" and bucket.master.is_pinned(), f"{case}: master not pinned host"
    for state in engine.optimizer.state.values():
        for name in ("exp_avg", "exp_avg_sq"):
            assert state[name].device.type == "cpu", f"{case}: {name} on {state[name].device}"
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

