"""The optimizer and scheduler sections of a DeepSpeed config, checked: the
optimizers zero builds (optimizers.py) and the arguments of DeepSpeed's LR
schedules (lr_schedules.py), so a wrong one is named here, not as a TypeError later."""
from __future__ import annotations

from ..parsing.values import AUTO, as_float, as_int

_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
SCHEDULER_PARAMS = {  # type -> (required, optional) params: deepspeed.runtime.lr_schedules' constructor arguments
    "WarmupLR": ((), _WARMUP), "WarmupDecayLR": (("total_num_steps",), _WARMUP),
    "OneCycle": (("cycle_min_lr", "cycle_max_lr"), (
        "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",
        "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
        "decay_mom_rate", "last_batch_iteration")),
    "LRRangeTest": ((), ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                         "lr_range_test_staircase", "last_batch_iteration")),
}
SCHEDULER_INTS = {  # integer params and their minimum
    "warmup_num_steps": 1, "total_num_steps": 1, "cycle_first_step_size": 1, "cycle_second_step_size": 0,
    "lr_range_test_step_size": 1, "cycle_first_stair_count": 0, "cycle_second_stair_count": 0, "decay_step_size": 0,
    "last_batch_iteration": -1}
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULERS = tuple(SCHEDULER_PARAMS)


def parse_optimizer(section: object) -> dict | None:
    """{"type" (lower case), "params"}, or None without a section."""
    if section is None:
        return None
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise ValueError(f"zero config: optimizer must be an object with a string 'type', got {section!r}")
    if section["type"].lower() not in OPTIMIZERS:
        raise ValueError(f"zero config: optimizer.type {section['type']!r} is not one of Adam, AdamW, SGD")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"zero config: optimizer.params must be an object, got {params!r}")
    return {"type": section["type"].lower(), "params": dict(params)}


def parse_scheduler(section: object) -> dict | None:
    """DeepSpeed builds the schedule as type(optimizer, **params): an unknown or
    missing argument is a mistake, named here rather than as a TypeError later.
    "auto" (a Hugging Face placeholder) leaves the schedule's default."""
    if section is None:
        return None
    if not isinstance(section, dict) or section.get("type") not in SCHEDULERS:
        raise ValueError(f"zero config: scheduler.type must be one of {SCHEDULERS}, got {section!r}")
    kind, params = section["type"], section.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"zero config: scheduler.params must be an object, got {params!r}")
    required, optional = SCHEDULER_PARAMS[kind]
    for key in params:
        if key not in required + optional:
            raise ValueError(f"zero config: scheduler.params.{key!r} is not an argument of {kind} "
                             f"(it takes {', '.join(required + optional)})")
    for key in required:
        if params.get(key, AUTO) == AUTO:
            raise ValueError(f"zero config: scheduler.params.{key} is required for {kind}")
    given = {k: v for k, v in params.items() if v != AUTO}
    for key, value in given.items():
        if value is None:  # DeepSpeed's default for the *_second_* sizes and warmup_max_lr
            continue
        if key in SCHEDULER_INTS:
            given[key] = as_int(value, f"scheduler.params.{key}", SCHEDULER_INTS[key])
        elif key.endswith(("_lr", "_rate", "_mom")) and not isinstance(value, (list, tuple)):
            as_float(value, f"scheduler.params.{key}")
    if given.get("warmup_type", "log") not in ("log", "linear"):
        raise ValueError(f"zero config: scheduler.params.warmup_type must be log or linear, got {given['warmup_type']!r}")
    return {"type": kind, "params": given}
