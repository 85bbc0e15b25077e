"""Writes the checkpoint fixture that tests/test_zero_checkpoint_fixture.py
loads: a 2-rank fp16 run of the mlp at stages 2 and 3, saved after 3 steps,
with what each rank held at the save (optimizer parameters, i.e. the fp32
master slices, and their Adam states, in the optimizer's order), the scaler,
scheduler and counters, the whole fp32 parameters, and the whole parameters
after one more step. Run from tests/: python data/zero_ckpt_v1/make_fixture.py"""
from __future__ import annotations

import os
import shutil
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/

from harness import run_ranks  # noqa: E402
from zero_reference import MICRO, engine_config, loss_fn, make_batch, make_model  # noqa: E402

import zero  # noqa: E402

STAGES = (2, 3)
SAVED_STEPS = 3


def new_engine(stage: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = engine_config(stage, "fp16", 1, 2)
        cfg["zero_optimization"]["reduce_bucket_size"] = 700
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10}}
        engine, *_ = zero.initialize(model=make_model("mlp"), config=cfg)
    return engine


def train(engine, rank: int, steps: range) -> None:
    for step in steps:
        x, y = make_batch("mlp", MICRO * 2, step)
        lo = rank * MICRO
        engine.backward(loss_fn("mlp", engine(x[lo:lo + MICRO]), y[lo:lo + MICRO]))
        engine.step()


def held(engine) -> dict:
    """What this rank's engine holds, by the optimizer's order."""
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    return {"masters": [p.detach().clone() for p in params],
            "states": [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in engine.optimizer.state.get(p, {}).items()} for p in params],
            "lr": engine.get_lr(), "loss_scale": engine.loss_scale, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps}


def worker(rank: int, world_size: int, out: str) -> None:
    for stage in STAGES:
        engine = new_engine(stage)
        train(engine, rank, range(SAVED_STEPS))
        engine.save_checkpoint(os.path.join(out, f"stage{stage}"), tag="saved")
        record = held(engine)
        record["full"] = [t.clone() for t in engine.full_params_fp32()]
        train(engine, rank, range(SAVED_STEPS, SAVED_STEPS + 1))
        record["full_after_next_step"] = [t.clone() for t in engine.full_params_fp32()]
        torch.save(record, os.path.join(out, f"stage{stage}_expected_rank{rank}.pt"))


if __name__ == "__main__":
    for stage in STAGES:
        shutil.rmtree(os.path.join(HERE, f"stage{stage}"), ignore_errors=True)
    run_ranks(worker, 2, HERE, timeout=120)
