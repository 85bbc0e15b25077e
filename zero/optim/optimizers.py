"""Optimizers and LR schedulers: build them from the config, or point a
client optimizer at the engine's fp32 master slices."""
from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from . import lr_schedules

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


def scheduler_from_config(section: dict, optimizer: torch.optim.Optimizer) -> lr_schedules.Schedule:
    """As DeepSpeed: type(optimizer, **params), params checked by config.py."""
    return lr_schedules.SCHEDULES[section["type"]](optimizer, **section["params"])
