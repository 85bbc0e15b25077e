"""ZeRO-Offload's gradient copies to host, on CPU ranks with a stand-in for the
CUDA side stream (zero/offload/cuda.py) put where the engine keeps it
(HostParamGroup.grad_copies): LateCopies lands a copy only when finished, as a
stream that has not run yet. Whatever reads a host gradient buffer before its
copy landed (the norm, the clip coefficient, fp16's overflow check, the step)
reads NaN or the previous step's gradient, and the run leaves the plain-torch
reference (zero_reference.reference_train)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from test_zero_offload import offload_sections
from test_zero_parity import compare_with_reference
from zero_reference import CLIP, DTYPES, MICRO, STEPS, engine_config, loss_fn, make_batch, make_model, reference_train

import zero


class LateCopies:
    """zero.offload.host.GradCopies as a side stream that runs only when waited
    for: start() hands out the host buffers (kept per slot, as
    cuda.StreamGradCopies keeps them; NaN when new, as fresh pinned memory may
    hold anything) and copies nothing; finish() lands every copy started. A
    gradient changed between its start() and finish() is an error: on a GPU
    the copy would have read the new values."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.landed = 0

    def start(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for slot, grad in enumerate(grads):
            if grad is None:
                out.append(None)
                continue
            host = self.buffers.get(slot)
            if host is None or host.numel() != grad.numel():
                host = self.buffers[slot] = torch.full((grad.numel(),), math.nan)
            self.pending.append((slot, grad, grad.detach().clone(), host))
            out.append(host)
        return out

    def finish(self) -> None:
        for slot, grad, at_start, host in self.pending:
            same = torch.equal(grad.reshape(-1).view(torch.uint8), at_start.reshape(-1).view(torch.uint8))
            assert same, f"LateCopies: the gradient of slot {slot} changed before its copy to host landed"
            host.copy_(grad.reshape(-1))
            self.landed += 1
        self.pending = []


def late_engine(kind: str, stage: int, dtype_name: str, world_size: int, **config_keys):
    """An engine with offload_optimizer cpu (and offload_param cpu at stage 3) whose gradient copies are LateCopies."""
    config = engine_config(stage, dtype_name, 1, world_size, **offload_sections("cpu", stage, ""))
    config.update(config_keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=make_model(kind), config=config)
    group = engine.parts.group
    assert group.on_host and group.grad_copies is None, "a CPU model's offload copies no gradient"
    group.grad_copies = LateCopies()
    return engine


def train_step(engine, kind: str, rank: int, world_size: int, step: int, poison: bool = False) -> float:
    """One step on rank's part of the global batch of `step`; returns the mean loss over the ranks.
    poison: the batch holds an infinity (fp16: the step overflows)."""
    x, y = make_batch(kind, MICRO * world_size, step)
    if poison:
        x[:, 0] = math.inf
    loss = loss_fn(kind, engine(x[rank * MICRO:(rank + 1) * MICRO]), y[rank * MICRO:(rank + 1) * MICRO])
    engine.backward(loss)
    engine.step()
    mean = loss.detach().float().reshape(1)
    dist.all_reduce(mean)
    return float(mean) / world_size


def ordering_worker(rank: int, world_size: int, cases: list[tuple[str, int, str]]) -> None:
    for kind, stage, dtype_name in cases:
        case = f"rank {rank}/{world_size} {kind} stage {stage} {dtype_name} offload cpu, late copies"
        engine = late_engine(kind, stage, dtype_name, world_size)
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(train_step(engine, kind, rank, world_size, step))
            norms.append(engine.get_global_grad_norm())
        assert all(math.isfinite(n) for n in norms), f"{case}: gradient norms {norms}"
        assert engine.skipped_steps == 0, f"{case}: {engine.skipped_steps} steps skipped as overflowed, norms {norms}"
        assert max(norms) > CLIP, f"{case}: clipping never acted, norms {norms}"
        copies = engine.parts.group.grad_copies
        assert copies.landed > 0 and not copies.pending, f"{case}: {copies.landed=} {len(copies.pending)=}"
        reference = reference_train(kind, DTYPES[dtype_name], MICRO * world_size)
        compare_with_reference(case, kind, dtype_name, losses, engine.full_params_fp32(), reference)


ORDERING_CASES = {
    1: [("mlp", 1, "fp32"), ("mlp", 2, "fp16")],
    2: [("mlp", 2, "fp32"), ("transformer", 3, "fp32"), ("mlp", 1, "fp16"), ("transformer", 2, "bf16")],
}


@pytest.mark.parametrize("world_size", [1, 2])
def test_reads_wait_for_late_copies(world_size: int) -> None:
    run_ranks(ordering_worker, world_size, ORDERING_CASES[world_size], timeout=180)


def overflow_worker(rank: int, world_size: int) -> None:
    """fp16: an overflowed step is skipped (the parameters stay as they were,
    bit for bit) and zeroes the gradients only after their copies landed; the
    steps around it train."""
    case = f"rank {rank}/{world_size} mlp stage 2 fp16 offload cpu, late copies, step 1 overflows"
    engine = late_engine("mlp", 2, "fp16", world_size)
    train_step(engine, "mlp", rank, world_size, 0)
    before = [p.clone() for p in engine.full_params_fp32()]
    train_step(engine, "mlp", rank, world_size, 1, poison=True)
    assert engine.skipped_steps == 1 and not math.isfinite(engine.get_global_grad_norm()), \
        f"{case}: {engine.skipped_steps=} {engine.get_global_grad_norm()=}"
    for i, (p, q) in enumerate(zip(engine.full_params_fp32(), before, strict=True)):
        assert torch.equal(p, q), f"{case}: parameter {i} changed in the skipped step"
    train_step(engine, "mlp", rank, world_size, 2)
    assert engine.skipped_steps == 1 and math.isfinite(engine.get_global_grad_norm()), f"{case}: {engine.skipped_steps=}"
    moved = [float((p - q).abs().max()) for p, q in zip(engine.full_params_fp32(), before)]
    assert min(moved) > 0, f"{case}: a parameter did not move in the step after the skipped one: {moved}"


def test_overflow_skip_waits_for_late_copies() -> None:
    run_ranks(overflow_worker, 2, timeout=120)
