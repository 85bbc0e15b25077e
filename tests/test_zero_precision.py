"""The dynamic loss scaler's state survives a checkpoint: saved after a scale
change, loaded into a fresh scaler, both go on exactly as DeepSpeed's rules say
(the rules themselves: test_zero_pure.py::test_dynamic_loss_scaler_rules)."""
from __future__ import annotations

import io
import random

import pytest
import torch

from zero.runtime.precision import DynamicLossScaler, ScalerOptions

OPTIONS = {"initial_scale_power": 10, "loss_scale_window": 4, "hysteresis": 3, "min_loss_scale": 2.0}


class Expected:
    """DeepSpeed's DynamicLossScaler.update_scale (runtime/fp16/loss_scaler.py),
    written out as the rules read: the oracle for long random runs."""

    def __init__(self, options: ScalerOptions, state: dict) -> None:
        self.o = options
        self.scale, self.budget = state["scale"], state["hysteresis_left"]
        self.iteration, self.last_overflow = state["iteration"], state["last_overflow_iteration"]

    def step(self, overflow: bool) -> float:
        o = self.o
        if overflow:
            if o.hysteresis == 1 or self.budget == 1:
                self.scale = max(self.scale / 2, o.min_loss_scale)
            else:
                self.budget -= 1
            self.last_overflow = self.iteration
        else:
            if o.consecutive_hysteresis:
                self.budget = o.hysteresis
            if (self.iteration - self.last_overflow) % o.loss_scale_window == 0:
                if not o.consecutive_hysteresis:
                    self.budget = o.hysteresis
                self.scale *= 2
        self.iteration += 1
        return self.scale


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
    # Next: an overflow (halves unless consecutive refilled the budget), 4 clean
    # steps (the 4th doubles: the window counts from the last overflow), 12
    # overflows down to the floor min_loss_scale=2, and clean steps back up.
    tail = "x...." + "x" * 12 + "." * 9
    after_overflow = 256 if not consecutive else 512  # consecutive: a clean step refilled the budget
    grown = 2 * after_overflow
    # Hysteresis 3 again after the growth: two overflows spent, then each one
    # halves (no clean step between to refill), clamped at min_loss_scale.
    floor_run = [grown, grown] + [max(grown / 2 ** k, 2.0) for k in range(1, 11)]
    top = floor_run[-1]
    expected_tail = [after_overflow] * 4 + [grown] + floor_run + [top] * 3 + [2 * top] * 4 + [4 * top] * 2
    assert run(scaler, tail) == expected_tail, f"consecutive={consecutive}: the saved scaler"
    assert run(fresh, tail) == expected_tail, f"consecutive={consecutive}: the loaded scaler"
    # Then many more random updates: both scalers in step with each other and the rules.
    oracle = Expected(options, scaler.state_dict())
    rng = random.Random(7)
    pattern = "".join("x" if rng.random() < 0.2 else "." for _ in range(400))
    for index, mark in enumerate(pattern):
        want = oracle.step(mark == "x")
        scaler.update(mark == "x")
        fresh.update(mark == "x")
        assert scaler.scale == fresh.scale == want, \
            f"consecutive={consecutive}, update {index} ({mark}): saved {scaler.scale}, loaded {fresh.scale}, rules {want}"
        assert scaler.state_dict() == fresh.state_dict(), f"consecutive={consecutive}, update {index}"
