"""The dynamic loss scaler's state survives a checkpoint: saved after a scale
change, loaded into a fresh scaler, both go on exactly as DeepSpeed's own
DynamicLossScaler does from the same state (the rules in closed form:
test_zero_pure.py::test_dynamic_loss_scaler_rules)."""
from __future__ import annotations

import io
import random
from unittest import mock

import pytest
import torch

from zero.runtime.precision import DynamicLossScaler, ScalerOptions

OPTIONS = {"initial_scale_power": 10, "loss_scale_window": 4, "hysteresis": 3, "min_loss_scale": 2.0}


def deepspeed_scaler(options: ScalerOptions, state: dict):
    """DeepSpeed's own DynamicLossScaler (runtime/fp16/loss_scaler.py), put in
    `state`: the oracle, independent of zero's code. It logs overflows on
    deepspeed.comm's rank 0, which needs no process group here."""
    from deepspeed.runtime.fp16 import loss_scaler

    scaler = loss_scaler.DynamicLossScaler(init_scale=state["scale"], scale_window=options.loss_scale_window,
                                           min_scale=options.min_loss_scale, delayed_shift=options.hysteresis,
                                           consecutive_hysteresis=options.consecutive_hysteresis,
                                           raise_error_at_min_scale=False)
    scaler.cur_hysteresis, scaler.cur_iter = state["hysteresis_left"], state["iteration"]
    scaler.last_overflow_iter = state["last_overflow_iteration"]
    return scaler


def run(scaler: DynamicLossScaler, pattern: str) -> list[float]:
    """Feeds x (overflow) / . (clean); each step must be skipped exactly on overflow."""
    scales = []
    for index, mark in enumerate(pattern):
        skipped = scaler.update(mark == "x")
        assert skipped == (mark == "x"), f"step {index} ({mark}): skipped={skipped}"
        scales.append(scaler.scale)
    return scales


def through_checkpoint(state: dict) -> dict:
    """state_dict -> torch.save -> torch.load, as an engine checkpoint stores it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("consecutive", [False, True])
def test_scaler_state_round_trip_past_a_scale_change(consecutive: bool) -> None:
    options = ScalerOptions(consecutive_hysteresis=consecutive, **OPTIONS)
    scaler = DynamicLossScaler(options)
    # Hysteresis 3: two overflows spend the budget, the third halves 1024 -> 512;
    # the budget stays at 1 (it refills on growth, or on any clean step when
    # consecutive), so a resumed scaler that forgot it would not halve next time.
    assert run(scaler, "xxx..") == [1024, 1024, 512, 512, 512]
    state = scaler.state_dict()
    assert state == {"scale": 512.0, "hysteresis_left": options.hysteresis if consecutive else 1, "iteration": 5,
                     "last_overflow_iteration": 2}, state
    fresh = DynamicLossScaler(options)
    fresh.load_state_dict(through_checkpoint(state))
    # Then, from the saved state: runs of overflows down to the floor
    # min_loss_scale=2, long clean runs back up (past several windows), and
    # random updates; both scalers in step with each other and DeepSpeed's.
    oracle = deepspeed_scaler(options, state)
    rng = random.Random(7)
    pattern = "x...." + "x" * 12 + "." * 13 + "".join("x" if rng.random() < 0.2 else "." for _ in range(400))
    with mock.patch("deepspeed.comm.get_rank", lambda: 1):
        for index, mark in enumerate(pattern):
            oracle.update_scale(mark == "x")
            assert scaler.update(mark == "x") == fresh.update(mark == "x") == (mark == "x"), \
                f"consecutive={consecutive}, update {index} ({mark}): a step is skipped exactly on overflow"
            assert scaler.scale == fresh.scale == oracle.cur_scale, \
                f"consecutive={consecutive}, update {index} ({mark}): saved {scaler.scale}, loaded {fresh.scale}, " \
                f"DeepSpeed {oracle.cur_scale}"
            assert scaler.state_dict() == fresh.state_dict(), f"consecutive={consecutive}, update {index}"
    assert min(run(DynamicLossScaler(options), "x" * 40)) == options.min_loss_scale  # the floor is reached
