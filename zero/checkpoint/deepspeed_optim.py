"""The optimizer states inside DeepSpeed's checkpoints: which optimizer wrote
them, read into torch.optim's terms (zero runs torch's Adam, AdamW and SGD),
and written in the layout of the optimizer DeepSpeed resumes with
([Note: DeepSpeed's optimizer layouts]).

[Note: DeepSpeed's optimizer layouts]
DeepSpeed saves its base optimizer's own state_dict, one "parameter" per flat
group (deepspeed_layout.py). The optimizer follows from the config, as
DeepSpeed 0.19.8's _configure_basic_optimizer builds it (built_by):

    optimizer            built for                           param-group keys ("params" aside)    per flat group
    torch.optim.AdamW    Adam/AdamW, params.torch_adam true  lr betas eps weight_decay amsgrad    step: float32 tensor,
    (Adam: adam_w_mode                                       maximize decoupled_weight_decay,     exp_avg, exp_avg_sq
    false)                                                   foreach capturable differentiable fused
    FusedAdam            Adam/AdamW (the CPU accelerator     lr bias_correction betas eps         step: int,
                         too: its fused_adam op)             weight_decay, step (0, never moved)  exp_avg, exp_avg_sq
    DeepSpeedCPUAdam     Adam/AdamW with offload_optimizer   lr betas eps weight_decay            step: int,
                         on cpu or nvme                      bias_correction amsgrad              exp_avg, exp_avg_sq
    the client's         no "optimizer" section              its own state_dict

FusedAdam and DeepSpeedCPUAdam update as torch's Adam or AdamW when
bias_correction is true, and neither runs amsgrad. Their adamw_mode is a
constructor argument, in neither state_dict: the config a run resumes with
decides it, on either side, as in DeepSpeed. Read, their states become torch's
(step a float32 tensor; hyperparameters lr, betas, eps, weight_decay);
written, zero's torch Adam/AdamW states (amsgrad and maximize off) become
theirs. torch.optim's own states pass through: torch's load_state_dict reads
them. Any other optimizer (DeepSpeedCPUAdagrad, FusedLion, FusedLamb, Muon,
...; zero offers none of them), or states that are not their optimizer's
layout, is a ValueError naming it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FUSED_ADAM, CPU_ADAM = "FusedAdam", "DeepSpeedCPUAdam"
ADAM_STATES = frozenset({"step", "exp_avg", "exp_avg_sq"})
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")  # the same meaning in torch's Adam and DeepSpeed's
UPDATE = {"bias_correction": True, "amsgrad": False}  # what torch's Adam/AdamW update is, in DeepSpeed's keys
TORCH_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})  # how torch runs a step
# DeepSpeed's other optimizer types: the class built (without, with offload_optimizer)
OTHER_TYPES = {"adagrad": ("torch.optim.Adagrad", "DeepSpeedCPUAdagrad"), "lion": ("FusedLion", "DeepSpeedCPULion"),
               "lamb": ("FusedLamb", "FusedLamb"), "muon": ("MuonWithAuxAdam", "MuonWithAuxAdam"),
               "muadam": ("mup.MuAdam", "mup.MuAdam"), "muadamw": ("mup.MuAdamW", "mup.MuAdamW"),
               "musgd": ("mup.MuSGD", "mup.MuSGD")}


@dataclass(frozen=True, slots=True)
class AdamLayout:
    """One of DeepSpeed's Adam classes as its state_dict holds it."""

    keys: tuple[str, ...]  # each param group's, in the class's order
    written: dict  # the keys torch's Adam has not, as zero writes them
    optional: frozenset[str] = frozenset()  # absent before the first step()


ADAM = {FUSED_ADAM: AdamLayout(("lr", "bias_correction", "betas", "eps", "weight_decay", "step"),
                               {"bias_correction": True, "step": 0}, frozenset({"step"})),
        CPU_ADAM: AdamLayout(("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad"),
                             {"bias_correction": True, "amsgrad": False})}


def is_torch(name: str) -> bool:
    return name.startswith("torch.optim")


def built_by(config: dict | None) -> str | None:
    """The optimizer DeepSpeed builds from `config` ("torch.optim.AdamW",
    "FusedAdam", "DeepSpeedCPUAdam", ...); None without an "optimizer"
    section (the client's optimizer)."""
    section = (config or {}).get("optimizer")
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        return None
    kind, params = section["type"].lower(), section.get("params") or {}
    offload = (((config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
               in ("cpu", "nvme"))
    if kind in ("adam", "adamw"):
        if params.get("torch_adam"):
            return "torch.optim.AdamW" if kind == "adamw" or params.get("adam_w_mode", True) else "torch.optim.Adam"
        return CPU_ADAM if offload else FUSED_ADAM
    if kind in OTHER_TYPES:
        return OTHER_TYPES[kind][offload]
    classes = [n for n, c in vars(torch.optim).items() if isinstance(c, type) and n.lower() == kind]
    return f"torch.optim.{classes[0] if classes else section['type']}"  # DeepSpeed: getattr(torch.optim, type)


def config_for(name: str, adamw: bool) -> dict:
    """The DeepSpeed config sections that build `name` (built_by's inverse);
    `adamw`: FusedAdam's or DeepSpeedCPUAdam's adamw_mode."""
    if name in ("torch.optim.Adam", "torch.optim.AdamW"):
        kind = name.removeprefix("torch.optim.")
        return {"optimizer": {"type": kind, "params": {"torch_adam": True, "adam_w_mode": kind == "AdamW"}}}
    if is_torch(name):
        return {"optimizer": {"type": name.removeprefix("torch.optim.")}}
    config = {"optimizer": {"type": "AdamW" if adamw else "Adam", "params": {"adam_w_mode": adamw}}}
    return config | ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}} if name == CPU_ADAM else {})


# ---- reading ------------------------------------------------------------------------------------------
def saved_optimizer(config: dict | None, groups: list[dict], states: list[dict], where: str) -> str:
    """The optimizer whose layout `groups` and `states` (one flat group's
    state each) are in: its config's, checked against them; a ValueError
    naming it where zero maps no such layout."""
    keys = set().union(*(g.keys() for g in groups)) - {"params"}
    name = built_by(config) or client(keys, where)
    if name in ADAM:
        check_adam(name, groups, states, where)
    elif not is_torch(name):
        section = (config or {}).get("optimizer")
        raise ValueError(f"{where}: optimizer states of {name} (the checkpoint's config: {section}): zero maps "
                         f"those of torch.optim's optimizers, {FUSED_ADAM} and {CPU_ADAM} only")
    elif not keys & TORCH_IMPLEMENTATION or "bias_correction" in keys:
        raise ValueError(f"{where}: the checkpoint's config builds {name}, but its optimizer states hold "
                         f"param-group keys {sorted(keys)}, not torch.optim's: the files do not agree")
    return name


def client(keys: set[str], where: str) -> str:
    """A client optimizer (no config section names it), told by its param-group keys."""
    if "bias_correction" in keys:
        return CPU_ADAM if "amsgrad" in keys else FUSED_ADAM
    if keys & TORCH_IMPLEMENTATION:
        return "torch.optim"
    raise ValueError(f"{where}: optimizer states with param-group keys {sorted(keys)} and no 'optimizer' in the "
                     f"checkpoint's config to name their optimizer: zero maps those of torch.optim's optimizers, "
                     f"{FUSED_ADAM} and {CPU_ADAM} only")


def check_adam(name: str, groups: list[dict], states: list[dict], where: str) -> None:
    layout = ADAM[name]
    for g, group in enumerate(groups):
        keys = set(group) - {"params"}
        if not set(layout.keys) - layout.optional <= keys <= set(layout.keys):
            raise ValueError(f"{where}: {name}'s param group {g} holds {sorted(keys)}, {name} keeps "
                             f"{list(layout.keys)}: not {name}'s states")
    for g, state in enumerate(states):
        if state and (set(state) != ADAM_STATES or not isinstance(state["step"], int)):
            raise ValueError(f"{where}: {name}'s state of flat group {g} holds {sorted(state)} (step "
                             f"{state.get('step')!r}), {name} keeps {sorted(ADAM_STATES)} with an int step")


def read_group(name: str, group: dict, where: str) -> dict:
    """A saved param group's hyperparameters, as torch's optimizer holds them."""
    if is_torch(name):
        return {k: v for k, v in group.items() if k != "params" and k not in TORCH_IMPLEMENTATION}
    other = {k: group[k] for k, v in UPDATE.items() if k in group and group[k] != v}
    if other:
        raise ValueError(f"{where}: {name} with {other}: zero's torch Adam/AdamW always corrects the bias and runs "
                         f"no amsgrad; zero does not map this {name}")
    return {k: group[k] for k in HYPERPARAMETERS}


def read_state(name: str, state: dict) -> dict:
    """A flat group's saved state as torch's Adam keeps it (step a float32 tensor)."""
    if is_torch(name) or "step" not in state:
        return state
    return {**state, "step": torch.tensor(float(state["step"]), dtype=torch.float32)}


def check_resumes(optimizer: torch.optim.Optimizer, saved: str, kinds: set[str], where: str) -> None:
    """This engine's optimizer keeps the states `saved` wrote (kinds, steps
    taken): an Adam or AdamW an Adam's (torch's, FusedAdam's,
    DeepSpeedCPUAdam's), an SGD an SGD's. Other optimizers are the client's."""
    if isinstance(optimizer, torch.optim.Adam):
        fits = not kinds or ADAM_STATES <= kinds <= ADAM_STATES | {"max_exp_avg_sq"}
    elif isinstance(optimizer, torch.optim.SGD):
        fits = kinds <= {"momentum_buffer"}
    else:
        return
    if not fits:
        raise ValueError(f"{where}: optimizer states of {saved} ({sorted(kinds)}); this engine's "
                         f"{type(optimizer).__name__} keeps other states: zero does not map one into the other")


# ---- writing ------------------------------------------------------------------------------------------
def check_target(name: str) -> str:
    if name not in ADAM and not is_torch(name):
        raise ValueError(f"to_deepspeed: optimizer {name!r}: zero writes the states of torch.optim's optimizers, "
                         f"{FUSED_ADAM} and {CPU_ADAM} only")
    return name


def write_group(name: str, group: dict, where: str) -> dict:
    """zero's torch param group (no "params") as `name` holds it."""
    if is_torch(name):
        return dict(group)
    missing = [k for k in HYPERPARAMETERS if k not in group]
    other = {k: group[k] for k in ("amsgrad", "maximize") if group.get(k)}
    if missing or other:
        raise ValueError(f"{where}: zero's optimizer (param-group keys {sorted(group)}) has no {name} layout: "
                         f"{name} keeps Adam's states, of a torch Adam/AdamW with amsgrad and maximize off "
                         f"(missing {missing}, set {other})")
    values = {**{k: group[k] for k in HYPERPARAMETERS}, **ADAM[name].written}
    values["betas"] = list(values["betas"])  # as DeepSpeed builds the class: from the JSON config's list
    return {k: values[k] for k in ADAM[name].keys}


def write_state(name: str, state: dict, where: str) -> dict:
    """One flat group's state of zero's torch optimizer, as `name` keeps it (step an int)."""
    if is_torch(name) or not state:
        return state
    step = state.get("step")
    if set(state) != ADAM_STATES or not isinstance(step, torch.Tensor) or step.numel() != 1 or step != step.round():
        raise ValueError(f"{where}: zero's optimizer states {sorted(state)} (step {step}) have no {name} layout, "
                         f"which keeps {sorted(ADAM_STATES)} with an integral step")
    return {"step": int(step), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
