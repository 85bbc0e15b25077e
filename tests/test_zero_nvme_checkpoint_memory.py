"""Checkpoints of a run whose masters and Adam moments are swapped to NVMe
read and write them one sub-group at a time: save_checkpoint's,
save_16bit_model's and load_checkpoint's peak resident memory (VmHWM, reset
through /proc/self/clear_refs) rises by a fraction of the rank's swapped
states, where holding them all in memory (as they did) raises it by all of
them. The 16-bit model agrees with the consolidated shard files; that the
values are right is test_zero_offload.py's (checkpoints across offload
settings) and test_zero_offload_matrix.py's."""
from __future__ import annotations

import ctypes
import os
import tempfile
import warnings

import pytest
import torch
from torch import nn

from harness import run_ranks

import zero
from zero.checkpoint import to_fp32

WIDTH, LAYERS = 1024, 6


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_rise_kib(fn) -> int:
    """How far fn raises this process's peak resident memory above its resident memory before."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS")
    fn()
    return status_kib("VmHWM") - before


def nvme_engine(rank: int, world_size: int, root: str, width: int, layers: int, **zero_options):
    """Stage 3, bf16, optimizer and parameters on NVMe; trained two steps."""
    nvme = os.path.join(root, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    offload = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "pipeline_read": True, "pipeline_write": True}
    config = {"train_batch_size": 2 * world_size, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_optimizer": offload,
                                    "offload_param": {**offload, "buffer_count": 4}, **zero_options}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zero.Init(config_dict_or_path=config):
            model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        engine, *_ = zero.initialize(model=model, config=config)
    for step in range(2):
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(step * world_size + rank))
        engine.backward(engine(x.bfloat16()).float().square().mean())
        engine.step()
    return engine


def save_worker(rank: int, world_size: int, root: str) -> dict:
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks go back at once
    engine = nvme_engine(rank, world_size, root, WIDTH, LAYERS, sub_group_size=1 << 18)
    states_kib = 12 * WIDTH * WIDTH * LAYERS // world_size // 1024  # fp32 master, exp_avg, exp_avg_sq
    rises = {"save_checkpoint": peak_rise_kib(lambda: engine.save_checkpoint(os.path.join(root, "ckpt"))),
             "save_16bit_model": peak_rise_kib(lambda: engine.save_16bit_model(os.path.join(root, "z16"))),
             "load_checkpoint": peak_rise_kib(lambda: engine.load_checkpoint(os.path.join(root, "ckpt")))}
    engine.destroy()

    # Two read paths agree: the 16-bit model (one bucket's master pages at a time, from the middle of the one
    # sub-group of DeepSpeed's default sub_group_size) and the shard files (whole sub-groups), consolidated.
    engine = nvme_engine(rank, world_size, root, 512, 3)
    engine.save_checkpoint(os.path.join(root, "small"))
    engine.save_16bit_model(os.path.join(root, "small16"))
    engine.destroy()
    if rank == 0:
        bit16 = torch.load(os.path.join(root, "small16", "pytorch_model.bin"))
        fp32 = torch.load(to_fp32.convert(os.path.join(root, "small"), os.path.join(root, "small32.bin")))
        assert bit16.keys() == fp32.keys() and len(fp32) == 3, (bit16.keys(), fp32.keys())
        for key, master in fp32.items():
            assert torch.equal(bit16[key], master.to(torch.bfloat16)), f"{key}: the 16-bit model differs"
    return {"states_kib": states_kib, **rises}


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
def test_nvme_checkpoints_hold_one_sub_group_at_a_time() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-nvme-save-") as root:
        results = run_ranks(save_worker, 2, root, timeout=160)
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
        states = result["states_kib"]
        # save_16bit_model gathers one bucket's fp32 master and writes 16-bit tensors: a bucket here is one
        # layer (4 MiB fp32 whole), a twelfth of the rank's states; a quarter leaves room for the allocator
        for phase in ("save_checkpoint", "save_16bit_model", "load_checkpoint"):
            assert result[phase] < 0.25 * states, \
                f"rank {rank}: {phase} raised peak memory by {result[phase]} KiB; the rank's states are {states} KiB"
