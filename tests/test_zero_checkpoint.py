"""save_checkpoint / load_checkpoint: a run resumed from a checkpoint continues
exactly like the uninterrupted run, at every stage."""
from __future__ import annotations

import os
import tempfile
import warnings

import torch
import torch.distributed as dist

from harness import run_ranks
from zero_reference import MICRO, engine_config, loss_fn, make_batch, make_model

import zero


def new_engine(stage: int, dtype_name: str, world_size: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = engine_config(stage, dtype_name, 1, world_size)
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10}}
        engine, *_ = zero.initialize(model=make_model("transformer"), config=cfg)
    return engine


def train(engine, rank: int, world_size: int, steps: range) -> None:
    for step in steps:
        x, y = make_batch("transformer", MICRO * world_size, step)
        lo = rank * MICRO
        engine.backward(loss_fn("transformer", engine(x[lo:lo + MICRO]), y[lo:lo + MICRO]))
        engine.step()


def checkpoint_worker(rank: int, world_size: int, directory: str) -> None:
    for stage in (0, 1, 2, 3):
        for dtype_name in ("fp32", "fp16"):
            case = f"rank {rank} stage {stage} {dtype_name}"
            save_dir = os.path.join(directory, f"s{stage}{dtype_name}")
            engine = new_engine(stage, dtype_name, world_size)
            train(engine, rank, world_size, range(2))
            engine.save_checkpoint(save_dir, client_state={"epoch": 7})
            train(engine, rank, world_size, range(2, 4))
            expected = engine.full_params_fp32()
            resumed = new_engine(stage, dtype_name, world_size)
            path, client = resumed.load_checkpoint(save_dir)
            assert client == {"epoch": 7} and path.endswith("global_step2"), f"{case}: {path} {client}"
            assert resumed.global_steps == 2, f"{case}: {resumed.global_steps=}"
            train(resumed, rank, world_size, range(2, 4))
            for i, (a, b) in enumerate(zip(resumed.full_params_fp32(), expected)):
                assert torch.equal(a, b), f"{case}: parameter {i} differs after resuming"
            assert resumed.get_lr() == engine.get_lr(), f"{case}: lr {resumed.get_lr()} != {engine.get_lr()}"
            assert (resumed.loss_scale, resumed.global_steps) == (engine.loss_scale, engine.global_steps), case
            if rank == 0:
                states = torch.load(os.path.join(path, "model_states.pt"))
                assert "embed.weight" in states and states["embed.weight"].shape == (32, 16), f"{case}"
            resumed.save_16bit_model(save_dir, "model16.bin")
            dist.barrier()
            saved = torch.load(os.path.join(save_dir, "model16.bin"))
            reference = make_model("transformer").state_dict()
            assert saved.keys() == reference.keys(), f"{case}: {sorted(saved)}"
            for (name, value), whole in zip(resumed.module.named_parameters(), expected):
                assert saved[name].shape == reference[name].shape and saved[name].dtype == resumed.parts.dtype, name
                assert torch.equal(saved[name].float(), whole.to(resumed.parts.dtype).float()), f"{case}: {name}"
            dist.barrier()


def test_checkpoint_resume() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-ckpt-") as directory:
        run_ranks(checkpoint_worker, 2, directory, timeout=120)
