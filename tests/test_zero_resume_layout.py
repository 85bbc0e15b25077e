"""A resume in another batch layout trains as DeepSpeed's resume does: saved
after 5 steps of accumulation 2 on 2 ranks (10 micro-steps, not a multiple
of 4), resumed with accumulation 4 on 2 ranks and on 1 rank (the global batch
doubled, then kept), every resumed step accumulates whole: losses and
gradient norms equal plain torch continuing from the same state."""
from __future__ import annotations

import math
import os
import tempfile
import warnings

import torch
import torch.distributed as dist

from harness import run_ranks
from zero_reference import CLIP, LR, MICRO, engine_config, loss_fn, make_batch, make_model

import zero

KIND, SAVED_STEPS, MORE_STEPS, SAVED_ACCUMULATION = "tied", 5, 3, 2
# fp32: zero and plain torch sum the same gradients in other orders (see test_zero_parity's TOLERANCE)
RTOL = 1e-5


def new_engine(stage: int, accumulation: int, world_size: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=make_model(KIND), config=engine_config(stage, "fp32", accumulation,
                                                                                  world_size))
    return engine


def train(engine, rank: int, world_size: int, steps: range) -> tuple[list[float], list[float]]:
    """Each step: the global batch of the step, cut into accumulation x ranks
    micro-batches; returns the mean loss and the gradient norm of each step."""
    accumulation, losses, norms = engine.gradient_accumulation_steps(), [], []
    for step in steps:
        x, y = make_batch(KIND, MICRO * accumulation * world_size, step)
        total = torch.zeros(1)
        for micro in range(accumulation):
            lo = (micro * world_size + rank) * MICRO
            loss = loss_fn(KIND, engine(x[lo:lo + MICRO]), y[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(float(total) / (accumulation * world_size))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def reference(world_size: int, accumulation: int) -> tuple[list[float], list[float]]:
    """Plain torch on whole global batches: SAVED_STEPS of the saved layout's, then MORE_STEPS of the new one's."""
    model = make_model(KIND)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for step in range(SAVED_STEPS + MORE_STEPS):
        numel = MICRO * (SAVED_ACCUMULATION * 2 if step < SAVED_STEPS else accumulation * world_size)
        x, y = make_batch(KIND, numel, step)
        opt.zero_grad()
        loss = loss_fn(KIND, model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses[SAVED_STEPS:], norms[SAVED_STEPS:]


def save_worker(rank: int, world_size: int, directory: str) -> dict:
    """Saves at every stage, then resumes on these 2 ranks with accumulation 4."""
    out = {}
    for stage in (1, 3):
        engine = new_engine(stage, SAVED_ACCUMULATION, world_size)
        train(engine, rank, world_size, range(SAVED_STEPS))
        engine.save_checkpoint(os.path.join(directory, f"stage{stage}"))
        engine.destroy()
        out[stage] = resume(rank, world_size, directory, stage, 4)
    return out


def resume(rank: int, world_size: int, directory: str, stage: int, accumulation: int) -> tuple:
    engine = new_engine(stage, accumulation, world_size)
    engine.load_checkpoint(os.path.join(directory, f"stage{stage}"))
    case = f"rank {rank}/{world_size} stage {stage} accumulation {accumulation}"
    assert (engine.global_steps, engine.global_samples) == (SAVED_STEPS, SAVED_STEPS * MICRO * 4), case
    assert engine.micro_steps == SAVED_STEPS * accumulation, f"{case}: {engine.micro_steps=} is not a boundary"
    result = train(engine, rank, world_size, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    engine.destroy()
    return result


def one_rank_worker(rank: int, world_size: int, directory: str) -> dict:
    return {stage: resume(rank, world_size, directory, stage, 4) for stage in (1, 3)}


def test_resume_with_another_accumulation() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-layout-") as directory:
        runs = {2: run_ranks(save_worker, 2, directory, timeout=120)[0],
                1: run_ranks(one_rank_worker, 1, directory, timeout=120)[0]}
    for world_size, by_stage in runs.items():
        want_losses, want_norms = reference(world_size, 4)
        for stage, (losses, norms) in by_stage.items():
            case = f"stage {stage}, 2 ranks x accumulation 2 -> {world_size} rank(s) x 4"
            assert all(math.isclose(a, b, rel_tol=RTOL) for a, b in zip(losses, want_losses)), \
                f"{case}: losses {losses} != {want_losses}"
            assert all(math.isclose(a, b, rel_tol=RTOL) for a, b in zip(norms, want_norms)), \
                f"{case}: grad norms {norms} != {want_norms}"
