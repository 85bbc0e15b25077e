"""ZeRO-Infinity's promise at test size: a model whose states are three times
the memory its ranks may use trains inside that limit at stage 3 with the
optimizer states and the parameters on NVMe, saves, resumes and consolidates
inside it, and ends bit for bit where the same run without offload ends.

The ranks join a cgroup v1 memory controller (root, as on the project's
machines) once their interpreter and torch are loaded, so the limit bounds
what training allocates: model states, buffers, activations. Going over it is
the kernel's OOM kill (a rank dies, the test fails). A limit too small for
the configuration is zero's MemoryError at initialize ([Note: memory guard]).
Slow tier: ~1 minute; the README's test section names it.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import uuid
import warnings

import pytest
import torch
from safetensors import safe_open
from torch import nn

from harness import run_ranks
from test_zero_memory_guard import own_memory_cgroup

import zero

WIDTH, LAYERS = 2048, 36  # 151M parameters
STATES = 16 * WIDTH * WIDTH * LAYERS  # bf16 parameters and gradients, fp32 masters and Adam's moments: 2.25 GiB
LIMIT = STATES // 3  # for both ranks together
SHARD = "256MB"  # the consolidated files' max_shard_size
STEPS = 2  # then a new engine resumes for one more

pytestmark = pytest.mark.slow


def config(root: str, rank: int, offload: bool) -> dict:
    section = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 10**7,
               "stage3_prefetch_bucket_size": 5 * 10**6, "reduce_bucket_size": 5 * 10**6, "sub_group_size": 4 * 10**6}
    if offload:
        nvme = {"device": "nvme", "nvme_path": os.path.join(root, f"nvme{rank}")}
        section.update(offload_optimizer={**nvme, "buffer_count": 2},
                       offload_param={**nvme, "max_in_cpu": 0, "buffer_count": 4, "buffer_size": WIDTH * WIDTH})
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "zero_optimization": section}


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def build(cfg: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zero.Init(config_dict_or_path=cfg):  # every rank builds layer by layer, keeping its shards
            torch.manual_seed(0)
            model = nn.Sequential(*[Residual() for _ in range(LAYERS)])
        engine, *_ = zero.initialize(model=model, config=cfg)
    return engine


def train(engine, rank: int, steps: range) -> list[float]:
    """Learns the identity on fixed data: the loss falls."""
    losses = []
    for step in steps:
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(100 * rank + step % 2))
        loss = (engine(x.bfloat16()).float() - x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def join(folder: str | None) -> None:
    """From here on this process is charged to `folder`; freed blocks go back to
    the kernel at once (glibc's dynamic mmap threshold would keep them)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    if folder is not None:
        with open(os.path.join(folder, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def status_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) // 1024


def worker(rank: int, world_size: int, folder: str | None, root: str, offload: bool) -> dict:
    """With offload: STEPS steps, save, a new engine resumes, one step, save. Without
    (the reference, outside the cgroup): the same steps in one go."""
    join(folder)
    joined = status_mib("VmRSS")
    cfg = config(root, rank, offload)
    os.makedirs(os.path.join(root, f"nvme{rank}"), exist_ok=True)
    engine = build(cfg)
    if not offload:
        losses = train(engine, rank, range(STEPS + 1))
        engine.save_checkpoint(os.path.join(root, "ckpt"), tag="resumed")
        engine.destroy()
        return {"losses": losses, "peak_rise_mib": status_mib("VmHWM") - joined}
    losses = train(engine, rank, range(STEPS))
    engine.save_checkpoint(os.path.join(root, "ckpt"), tag="first")
    engine.destroy()
    del engine
    gc.collect()
    engine = build(cfg)  # a new engine resumes
    engine.load_checkpoint(os.path.join(root, "ckpt"), tag="first")
    losses += train(engine, rank, range(STEPS, STEPS + 1))
    engine.save_checkpoint(os.path.join(root, "ckpt"), tag="resumed")
    engine.destroy()
    return {"losses": losses, "peak_rise_mib": status_mib("VmHWM") - joined}


def consolidate(root: str, folder: str | None) -> str:
    """python -m zero.to_fp32 of the resumed checkpoint, in its own process charged to `folder`."""
    out = os.path.join(root, "fp32")

    def charged() -> None:  # in the child, before it runs python
        if folder is not None:
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    subprocess.run([sys.executable, "-m", "zero.to_fp32", os.path.join(root, "ckpt"), out + "/", "--tag", "resumed",
                    "--format", "safetensors", "--max-shard-size", SHARD], check=True, timeout=300,
                   preexec_fn=charged, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 16)})  # as join()
    return out


def read_all(out: str) -> dict[str, torch.Tensor]:
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for name in files:
        with safe_open(os.path.join(out, name), "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def cgroup_read(folder: str, name: str) -> str:
    with open(os.path.join(folder, name)) as f:
        return f.read()


@pytest.fixture
def limited():
    parent = own_memory_cgroup()
    if parent is None:
        pytest.skip("no writable cgroup v1 memory controller (needs root)")
    folders = []

    def make(limit: int) -> str:
        folder = os.path.join(parent, f"zero-infinity-{uuid.uuid4().hex[:8]}")
        os.mkdir(folder)
        folders.append(folder)
        with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        return folder

    yield make
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            pass


@pytest.mark.timeout(900)
def test_states_three_times_the_limit_train_save_resume_consolidate_inside_it(limited) -> None:
    folder = limited(LIMIT)
    with tempfile.TemporaryDirectory(prefix="zero-infinity-", dir="/var/tmp") as root:
        offloaded = run_ranks(worker, 2, folder, os.path.join(root, "offload"), True, timeout=600)
        peak = int(cgroup_read(folder, "memory.max_usage_in_bytes"))
        got = read_all(consolidate(os.path.join(root, "offload"), folder))
        consolidated_peak = int(cgroup_read(folder, "memory.max_usage_in_bytes"))
        plain = run_ranks(worker, 2, None, os.path.join(root, "plain"), False, timeout=600)
        expected = read_all(consolidate(os.path.join(root, "plain"), None))
    print(f"states {STATES / 2**20:.0f} MiB, limit {LIMIT / 2**20:.0f} MiB for both ranks; cgroup peak (page cache "
          f"included) {peak / 2**20:.0f} MiB training, {consolidated_peak / 2**20:.0f} MiB consolidating; each rank's "
          f"peak resident memory above its start: {[r['peak_rise_mib'] for r in offloaded]} MiB (without offload: "
          f"{[r['peak_rise_mib'] for r in plain]} MiB); losses {[r['losses'] for r in offloaded]}")
    assert STATES >= 3 * LIMIT  # the limit held: a rank or the consolidation over it is OOM-killed
    for rank in range(2):
        losses = offloaded[rank]["losses"]
        assert losses == plain[rank]["losses"], (rank, losses, plain[rank]["losses"])  # bit for bit
        assert all(map(torch.isfinite, torch.tensor(losses))) and losses[2] < losses[0], losses
    assert got.keys() == expected.keys() and len(got) == LAYERS, (sorted(got)[:4], sorted(expected)[:4])
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{key}: the offloaded run's fp32 weights differ"


def refused_worker(rank: int, world_size: int, folder: str, root: str) -> str:
    join(folder)
    with pytest.raises(MemoryError) as refused:
        build(config(root, rank, offload=False))
    return str(refused.value)


def test_a_limit_too_small_for_the_run_is_zeros_error(limited) -> None:
    folder = limited(LIMIT)
    with tempfile.TemporaryDirectory(prefix="zero-infinity-", dir="/var/tmp") as root:
        errors = run_ranks(refused_worker, 2, folder, root, timeout=300)
    assert errors[0] == errors[1], errors
    assert f"share the memory cgroup {folder}" in errors[0] and "need about" in errors[0], errors[0]
    assert "offload_param none" in errors[0], errors[0]
