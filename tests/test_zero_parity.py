"""Multi-process parity: every stage x dtype x accumulation x model (x backend)
trains like single-process plain torch on the same global batch."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from zero_reference import CLIP, DTYPES, LR, MICRO, STEPS, engine_config, loss_fn, make_batch, make_model, reference_train

import zero

# Tolerances follow the arithmetic. fp32 differs from the reference only by
# summation order (ranks, micro-batches, buckets): relative 1e-7 per sum. AdamW
# divides each gradient element by its own running magnitude, so an element
# whose gradient is within rounding of zero can move by anything up to lr per
# step, while every other element follows the order change (relative ~1e-7,
# a few ulps after 5 steps). Hence, for fp32, per element: at most lr * STEPS
# (the flip bound) everywhere, and within 1e-5 + 1e-3 * |update| on all but
# FLIP_FRACTION of the elements. bf16/fp16 gradients are rounded to 8/11 bits
# before the reduction, so flips are common: those compare per tensor (L2),
# |p - ref| <= update_rtol * |ref - initial|.
TOLERANCE = {"fp32": (1e-5, None), "bf16": (3e-2, 0.35), "fp16": (5e-3, 0.1)}  # (loss rtol, update rtol)
FLIP_BOUND = LR * STEPS
FLIP_FRACTION = 0.01


def engine_train(rank: int, world_size: int, kind: str, stage: int, dtype_name: str, accumulation: int,
                 backend: str) -> tuple[list[float], list[torch.Tensor], object]:
    config = engine_config(stage, dtype_name, accumulation, world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = zero.initialize(model=make_model(kind), comm_backend=backend, config=config)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = make_batch(kind, MICRO * accumulation * world_size, step)
        total = 0.0
        for k in range(accumulation):
            lo = (k * world_size + rank) * MICRO
            loss = loss_fn(kind, engine(x[lo:lo + MICRO]), y[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        norms.append(engine.get_global_grad_norm())
        mean = torch.tensor([total / accumulation])
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    assert engine.global_steps == STEPS and engine.skipped_steps == 0, f"rank {rank}: {engine.skipped_steps=}"
    assert max(norms) > CLIP or kind not in ("mlp", "transformer"), f"rank {rank} {kind}: clipping never acted {norms}"
    return losses, engine.full_params_fp32(), engine


def check_case(rank: int, world_size: int, kind: str, stage: int, dtype_name: str, accumulation: int,
               backend: str, reference: dict) -> None:
    case = f"rank {rank}/{world_size} {kind} stage {stage} {dtype_name} accumulation {accumulation} {backend}"
    key = (kind, dtype_name, MICRO * accumulation * world_size)
    if key not in reference:
        reference[key] = reference_train(kind, DTYPES[dtype_name], key[2])
    losses, params, _ = engine_train(rank, world_size, kind, stage, dtype_name, accumulation, backend)
    compare_with_reference(case, kind, dtype_name, losses, params, reference[key])


def compare_with_reference(case: str, kind: str, dtype_name: str, losses: list[float], params: list[torch.Tensor],
                           reference: tuple[list[float], list[torch.Tensor]]) -> None:
    """Losses and final fp32 parameters against reference_train's, with TOLERANCE."""
    ref_losses, ref_params = reference
    loss_rtol, update_rtol = TOLERANCE[dtype_name]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_rtol, atol=loss_rtol,
                               msg=lambda m: f"{case}: losses {losses} vs reference {ref_losses}: {m}")
    initial = [p.detach().float() for p in make_model(kind).to(DTYPES[dtype_name]).parameters()]
    for i, (p, r, p0) in enumerate(zip(params, ref_params, initial, strict=True)):
        if update_rtol is None:
            check_fp32_elements(p, r, p0, f"{case}: parameter {i}")
            continue
        error, update = float((p - r).norm()), float((r - p0).norm())
        assert error <= update_rtol * update + 1e-6, f"{case}: parameter {i}: |p - ref| {error:.3g} > " \
                                                     f"{update_rtol} * |ref - initial| {update:.3g}"


def check_fp32_elements(p: torch.Tensor, ref: torch.Tensor, initial: torch.Tensor, where: str) -> None:
    """See the tolerance note at the top."""
    difference = (p - ref).abs()
    assert float(difference.max()) <= FLIP_BOUND, f"{where}: max |p - ref| {float(difference.max()):.3g} > {FLIP_BOUND}"
    off = difference > 1e-5 + 1e-3 * (ref - initial).abs()
    assert int(off.sum()) <= max(1, FLIP_FRACTION * off.numel()), \
        f"{where}: {int(off.sum())} of {off.numel()} elements differ beyond summation order (max {float(difference.max()):.3g})"


def parity_worker(rank: int, world_size: int, stages: tuple[int, ...]) -> None:
    reference: dict = {}
    for kind in ("mlp", "transformer"):
        for stage in stages:
            for dtype_name in DTYPES:
                for accumulation in (1, 3):
                    check_case(rank, world_size, kind, stage, dtype_name, accumulation, "ringcomm", reference)
            check_case(rank, world_size, kind, stage, "bf16", 3, "torch", reference)
    for stage in (2, 3):  # a weight shared by two modules: sharded once at stage 3, gathered by both
        check_case(rank, world_size, "tied", stage, "fp32", 3, "ringcomm", reference)
    check_case(rank, world_size, "torch_attention", 3, "fp32", 1, "ringcomm", reference)  # one unit per MHA


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_parity(world_size: int) -> None:
    run_ranks(parity_worker, world_size, (0, 1, 2, 3), timeout=240)
