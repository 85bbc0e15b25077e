"""fp16 loss scaling with DeepSpeed's rules, and the dtype choice of a config."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ScalerOptions:
    """fp16 section: loss_scale 0 = dynamic (initial 2**initial_scale_power)."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False


class LossScaler:
    """A static scale. fp16 (checks_overflow) skips a step whose gradients
    overflowed, as DeepSpeed does; fp32/bf16 (scale 1.0) never check."""

    dynamic = False

    def __init__(self, scale: float = 1.0, checks_overflow: bool = False) -> None:
        self.scale = float(scale)
        self.checks_overflow = checks_overflow

    def update(self, overflow: bool) -> bool:
        """Records a step's overflow; returns whether the step must be skipped."""
        return overflow and self.checks_overflow

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler.

    On overflow: the step is skipped; if the hysteresis budget is down to 1 the
    scale halves (never below min_loss_scale), else the budget drops by one.
    Without overflow: on a clean step that follows a multiple of
    loss_scale_window clean steps since the last overflow (DeepSpeed's
    stable_interval) the scale doubles and the budget refills (with
    consecutive_hysteresis it also refills on every clean step, so only
    consecutive overflows halve)."""

    dynamic = True

    def __init__(self, options: ScalerOptions) -> None:
        super().__init__(2.0 ** options.initial_scale_power, checks_overflow=True)
        self.options = options
        self.hysteresis_left = options.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> bool:
        o = self.options
        if overflow:
            if o.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, o.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if o.consecutive_hysteresis:
                self.hysteresis_left = o.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1  # clean steps before this one
            if stable > 0 and stable % o.loss_scale_window == 0:
                if not o.consecutive_hysteresis:
                    self.hysteresis_left = o.hysteresis
                self.scale *= 2.0
        self.iteration += 1
        return overflow

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration}


def make_scaler(dtype: torch.dtype, options: ScalerOptions) -> LossScaler:
    if dtype != torch.float16:
        return LossScaler(1.0)
    if options.loss_scale == 0:
        return DynamicLossScaler(options)
    return LossScaler(options.loss_scale, checks_overflow=True)
