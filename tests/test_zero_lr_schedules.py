"""zero's learning-rate schedules against DeepSpeed's own classes: the same lr
(and OneCycle's betas) after construction and after every step, and
interchangeable state_dicts; the config names what it rejects."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import zero_reference  # noqa: F401  (puts the repo root on sys.path)
from zero.runtime import config as cfg
from zero.optim.optimizers import scheduler_from_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed not installed (test extra)")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
FACTS = cfg.ModelFacts(world_size=2, param_dtype="float32", hidden_size=64)
NUM_STEPS = 40
CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),  # max lr: the optimizer's; one step is two
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 8}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 6}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 7, "cycle_second_step_size": 4,
                  "cycle_first_stair_count": 3, "decay_step_size": 3, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01}),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 2e-3, "cycle_first_step_size": 5, "cycle_momentum": False}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 2.5,
                     "lr_range_test_staircase": True}),
]


def optimizer(kind: str) -> torch.optim.Optimizer:
    """Two parameter groups, so per-group lrs are compared too."""
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 5e-4}]
    return torch.optim.AdamW(groups, lr=2e-3) if kind == "adamw" else torch.optim.SGD(groups, lr=2e-3, momentum=0.9)


def trace(schedule, opt: torch.optim.Optimizer, num_steps: int) -> list[tuple]:
    """(lr of every group, betas of every group) before the first step and after each."""
    out = []
    for step in range(num_steps + 1):
        if step:
            schedule.step()
        out.append(tuple((g["lr"], g.get("betas")) for g in opt.param_groups))
    return out


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("name, params", CASES)
def test_schedule_matches_deepspeed(name: str, params: dict, kind: str) -> None:
    from deepspeed.runtime import lr_schedules

    section = cfg.parse({"scheduler": {"type": name, "params": params}}, FACTS).scheduler
    ours_opt, theirs_opt = optimizer(kind), optimizer(kind)
    ours = scheduler_from_config(section, ours_opt)
    theirs = getattr(lr_schedules, name)(theirs_opt, **params)
    assert trace(ours, ours_opt, NUM_STEPS) == trace(theirs, theirs_opt, NUM_STEPS), f"{name} {params}"
    assert ours.get_last_lr() == theirs.get_last_lr() and ours.state_dict() == theirs.state_dict()
    # each resumes from the other's state_dict onto the same schedule
    for source in (ours, theirs):
        resumed_ours, resumed_theirs = optimizer(kind), optimizer(kind)
        a = scheduler_from_config(section, resumed_ours)
        b = getattr(lr_schedules, name)(resumed_theirs, **params)
        a.load_state_dict(source.state_dict())
        b.load_state_dict(source.state_dict())
        assert trace(a, resumed_ours, 5)[1:] == trace(b, resumed_theirs, 5)[1:], f"{name}: resumed schedules differ"


def test_warmup_lr_does_not_step_when_built() -> None:
    """The issue's case: DeepSpeed's lr after the first optimizer step is still warmup_min_lr."""
    opt = optimizer("adamw")
    section = cfg.parse({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                                       "warmup_num_steps": 100}}}, FACTS).scheduler
    schedule = scheduler_from_config(section, opt)
    assert opt.param_groups[0]["lr"] == 0
    schedule.step()
    assert opt.param_groups[0]["lr"] == 0 and schedule.last_batch_iteration == 0


@pytest.mark.parametrize("section, key", [
    ({"type": "CosineAnnealing"}, "scheduler.type"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 5}}, "scheduler.params.'warmup_steps'"),
    ({"type": "WarmupLR", "params": {"cycle_min_lr": 5}}, "scheduler.params.'cycle_min_lr'"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "scheduler.params.warmup_num_steps"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "scheduler.params.warmup_type"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}, "scheduler.params.total_num_steps"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}, "scheduler.params.total_num_steps"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3}}, "scheduler.params.cycle_max_lr"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": -1}}, "scheduler.params.cycle_max_lr"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 2.5}}, "scheduler.params.lr_range_test_step_size"),
])
def test_config_rejects_by_name(section: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        cfg.parse({"scheduler": section}, FACTS)
