"""Optimizers and LR schedulers: build them from the config, or point a
client optimizer at the engine's fp32 master slices."""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def from_config(section: dict, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """DeepSpeed's "Adam" is AdamW unless params.adam_w_mode is false."""
    kind = section["type"]
    params_cfg = {k: v for k, v in section["params"].items() if v != "auto"}  # "auto": torch's default
    adam_w_mode = params_cfg.pop("adam_w_mode", kind == "adam")
    params_cfg.pop("torch_adam", None)
    try:
        if kind == "sgd":
            return torch.optim.SGD(params, **params_cfg)
        cls = torch.optim.AdamW if (kind == "adamw" or adam_w_mode) else torch.optim.Adam
        return cls(params, **params_cfg)
    except TypeError as error:
        raise ValueError(f"zero config: optimizer.params {section['params']!r} rejected: {error}") from None


def check_supported(optimizer: torch.optim.Optimizer, stage: int, allow_untested: bool) -> None:
    if stage > 0 and not isinstance(optimizer, SUPPORTED) and not allow_untested:
        raise ValueError(f"zero: optimizer {type(optimizer).__name__} is untested with ZeRO stage {stage} (its "
                         f"update must be elementwise to work on shards); set zero_allow_untested_optimizer: true")


def rebind(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
           masters: list[tuple[int, torch.Tensor]]) -> None:
    """Replaces each group's model parameters by the master slices cut from
    them (same optimizer object, so a client scheduler keeps working)."""
    index_of = {id(p): i for i, p in enumerate(params)}
    slices: dict[int, list[torch.Tensor]] = defaultdict(list)
    for index, view in masters:
        slices[index].append(view)
    for group in optimizer.param_groups:
        new = []
        for p in group["params"]:
            if id(p) not in index_of:
                raise ValueError(f"zero: optimizer parameter of shape {tuple(p.shape)} is not a trainable "
                                 f"parameter of the model")
            new.extend(slices.get(index_of[id(p)], []))
        group["params"] = new
        if _may_fuse(optimizer, group):
            group["fused"] = True
    optimizer.state = defaultdict(dict)


def _may_fuse(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Adam/AdamW/SGD whose caller chose no implementation run torch's fused kernel on
    the fp32 master shard: one pass over memory instead of six (same update up
    to rounding)."""
    return (type(optimizer) in SUPPORTED and group.get("fused") is None
            and group.get("foreach") is None and not group.get("differentiable", False)
            and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in group["params"]))


def fused_everywhere(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in SUPPORTED and all(group.get("fused") for group in optimizer.param_groups)


@contextlib.contextmanager
def unscaled(optimizer: torch.optim.Optimizer, coef: float) -> Iterator[bool]:
    """Inside, optimizer.step() multiplies every gradient by `coef` within its
    fused kernel; yields False (nothing set) where the optimizer is not fused or
    coef is 1. torch's fused Adam/AdamW/SGD divide the gradient by a
    `grad_scale` inside the update (GradScaler's mechanism), so the unscale and
    clip coefficient costs no pass over the gradients of its own."""
    if coef == 1.0 or not fused_everywhere(optimizer):
        yield False
        return
    devices = {p.device for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
    if len(devices) != 1:
        yield False
        return
    optimizer.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=devices.pop())
    try:
        yield True
    finally:
        del optimizer.grad_scale


class WarmupLR:
    """DeepSpeed's WarmupLR (and WarmupDecayLR with total_num_steps): lr goes
    from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear),
    then stays (or decays linearly to warmup_min_lr at total_num_steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict, total_num_steps: int | None = None) -> None:
        self.optimizer = optimizer
        params = {k: v for k, v in params.items() if v != "auto"}
        self.min_lr = float(params.get("warmup_min_lr", 0.0))
        self.max_lr = float(params.get("warmup_max_lr", 0.001))
        self.warmup_num_steps = max(2, int(params.get("warmup_num_steps", 1000)))
        self.warmup_type = params.get("warmup_type", "log")
        self.total_num_steps = total_num_steps
        if self.warmup_type not in ("log", "linear"):
            raise ValueError(f"zero config: scheduler.params.warmup_type must be log or linear, got {self.warmup_type!r}")
        if total_num_steps is not None and total_num_steps < self.warmup_num_steps:
            raise ValueError(f"zero config: scheduler.params.total_num_steps ({total_num_steps}) < warmup_num_steps")
        self.last_batch_iteration = -1
        self.step()

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup_num_steps)
            return it / self.warmup_num_steps
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self) -> None:
        self.last_batch_iteration += 1
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma(self.last_batch_iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


def scheduler_from_config(section: dict, optimizer: torch.optim.Optimizer) -> WarmupLR:
    params = section["params"]
    if section["type"] == "WarmupDecayLR":
        if "total_num_steps" not in params:
            raise ValueError("zero config: scheduler.params.total_num_steps is required for WarmupDecayLR")
        return WarmupLR(optimizer, params, int(params["total_num_steps"]))
    return WarmupLR(optimizer, params)
