"""DeepSpeed's learning-rate schedules (deepspeed.runtime.lr_schedules): WarmupLR,
WarmupDecayLR, OneCycle, LRRangeTest, with the same constructor arguments, the
same learning rate after every step() and the same state_dict.

[Note: when the schedule starts]
    DeepSpeed's schedules do not step when built: a new schedule sets the
    learning rate of iteration -1 (the minimum), and the engine calls step()
    after each optimizer step, so the first optimizer step runs at the lr of
    iteration -1 and the second at iteration 0 (WarmupLR: min_lr both times).
    `last_batch_iteration` counts the step() calls, minus one.
"""
from __future__ import annotations

import math

import torch


def _per_group(optimizer: torch.optim.Optimizer, value: object, name: str) -> list:
    """A scalar for every parameter group, or a list with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}: expected {len(optimizer.param_groups)} values (one per parameter group), "
                             f"got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class Schedule:
    """step() advances `last_batch_iteration` and writes lr_at(it) into the
    optimizer's groups; subclasses say what lr_at is."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def lr_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_batch_iteration)

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr: call step() first (the schedule was built "
                               f"with last_batch_iteration={self.last_batch_iteration})")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._apply(self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupLR(Schedule):
    """lr rises from warmup_min_lr to warmup_max_lr (default: the optimizer's lr)
    over warmup_num_steps, by log(it + 1) / log(n) or it / n, then stays."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _positive_int(warmup_num_steps, "warmup_num_steps")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(1) would divide by zero
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def gamma(self, iteration: int) -> float:
        if iteration >= self.warmup_num_steps:
            return 1.0
        if self.warmup_type == "log":
            return (1.0 / math.log(self.warmup_num_steps)) * math.log(iteration + 1)  # DeepSpeed's rounding
        return iteration / self.warmup_num_steps

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        g = self.gamma(iteration)
        return [low + (high - low) * g for low, high in zip(self.min_lrs, self.max_lrs)]  # (high - low) first


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to warmup_min_lr at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class LRRangeTest(Schedule):
    """lr = min_lr * (1 + step_rate * (it + 1) / step_size), floored to whole
    intervals with staircase."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)

    def lr_at(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


class OneCycle(Schedule):
    """One triangle cycle, cycle_min_lr -> cycle_max_lr over cycle_first_step_size
    and back over cycle_second_step_size (optionally in stairs), then decay by
    1 / (1 + decay_lr_rate * k / decay_step_size). With cycle_momentum the
    optimizer's betas[0] moves the opposite way (betas[1] is set to 0.99, as
    DeepSpeed does)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = self.first_step_size if cycle_second_step_size is None else float(cycle_second_step_size)
        if self.first_step_size <= 0 or self.second_step_size < 0:
            raise ValueError(f"cycle_first_step_size must be > 0 and cycle_second_step_size >= 0, got "
                             f"{cycle_first_step_size!r}, {cycle_second_step_size!r}")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        no_decay = math.isclose(decay_step_size, 0)
        self.decay_lr_rate = 0.0 if no_decay else decay_lr_rate
        self.decay_mom_rate = 0.0 if no_decay else decay_mom_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)
            self._last_lr = None  # as DeepSpeed's: no last lr before the first step()
            if self.cycle_momentum:
                for group, betas in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def scale_factor(self, iteration: int) -> float:
        """Height in the cycle, 0 at cycle_min_lr and 1 at cycle_max_lr."""
        batch = iteration + 1
        x = 1.0 + batch / self.total_size - math.floor(1 + batch / self.total_size)
        if x <= self.step_ratio:
            factor, stairs = x / self.step_ratio, self.first_stair_count
        else:
            factor, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # from the integer position: a float factor may land just under a stair
            offset = batch % self.total_size
            position = offset * stairs / self.first_step_size if offset <= self.first_step_size \
                else (self.total_size - offset) * stairs / self.second_step_size
            factor = math.floor(position) / stairs
        return factor

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            factor = self.scale_factor(iteration)
            return [low + (high - low) * factor for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.decay_lr_rate == 0:
            return list(self.min_lrs)
        decay = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / decay for low in self.min_lrs]

    def momentum_at(self, iteration: int) -> list[tuple[float, float]]:
        if iteration < self.total_size:
            factor = self.scale_factor(iteration)
            return [(high[0] - (high[0] - low[0]) * factor, low[1]) for low, high in zip(self.min_moms, self.max_moms)]
        if self.decay_mom_rate == 0:
            return list(self.max_moms)
        decay = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [(beta0 * decay, beta1) for beta0, beta1 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.momentum_at(self.last_batch_iteration)):
                group["betas"] = betas


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, OneCycle, LRRangeTest)}
