"""Loading a checkpoint into an engine, all or nothing on every rank: each rank
checks everything it will use, the ranks agree that all of them did, and only
then does any rank change its state.

[Note: validate, agree, apply]
    every rank   stage(): resolve the tag, read the manifest, the engine state
                 (plain data; or DeepSpeed's files, deepspeed_files.py,
                 served through the same calls), check names, shapes, dtypes, the batch layout,
                 and every master slice and optimizer state this rank updates:
                 each saved tensor's crc32 and that the saved ranges cover it
    agree        (barrier.py: a deadline; carries each rank's error)
    every rank   apply(): each stateful part (parts.py) loads its staged
                 state: buffers, scaler, scheduler, counters, then the
                 shards (masters, optimizer states), which publish the masters
If any rank failed to stage, every rank raises the same ValueError naming
each failing rank's file and tensor or parameter, and no rank changed
anything. zero's own shards are read at apply straight into the masters and
optimizer states they restore (SavedRange), one range at a time, so a load
holds no second copy of the rank's states (a checkpoint of a model larger
than memory loads); what apply reads was checksummed at stage, so only an
I/O error or a file changed in between can fail it. DeepSpeed's files are
read into staging tensors (their layout is whole flat groups per rank).

[Note: what a resume restores]
As DeepSpeed: global_steps, global_samples, skipped_steps, the LR scheduler,
the loss scaler, the optimizer (fp32 masters, moments, step counts,
hyperparameters), client_state; none of these depends on the batch layout
(the scheduler and the scaler count optimizer steps). Neither engine saves
RNG states. The micro-step counter is not restored: it
only means something in the batch layout (world size, micro batch,
accumulation) it was counted in. A resume starts at an accumulation boundary,
micro_steps = global_steps * gradient_accumulation_steps (re-derived in this
engine's layout), so a changed accumulation or world size starts its first
step with a whole accumulation. A checkpoint saved between boundaries is
resumed at the boundary before it (those micro-steps' gradients are not
saved), with a warning. The scaler is restored only into the same precision
and kind of scaler it was saved from (a bf16 or fp32 checkpoint's scale 1.0
does not become an fp16 run's scale); otherwise the engine keeps the one its
config made, and says so.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .barrier import store_agree
from .deepspeed_files import DeepSpeedShards, is_deepspeed
from .deepspeed_optim import check_resumes
from .format import (ENGINE_STATE, MANIFEST, MODEL_STATES, NamedShard, SavedShards, check_file, load_plain,
                     read_engine_state, read_manifest, resolve)
from .parts import CheckpointOptions, CheckpointParts

log = logging.getLogger("zero")


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """DeepSpeed's load_checkpoint keywords."""

    strict: bool = True
    optimizer_states: bool = True
    scheduler: bool = True
    module_only: bool = False


@dataclass(slots=True)
class Staged:
    """Everything a rank will apply, read and checked."""

    directory: str
    state: dict
    masters: dict[str, torch.Tensor | SavedRange]  # shard key -> fp32 values of that master slice
    optimizer: dict[str, dict[str, torch.Tensor | SavedRange]]  # shard key -> its optimizer state
    extras: dict[str, torch.Tensor]  # buffers and frozen parameters, by state_dict key
    scaler: bool  # restore the loss scaler
    saved: SavedShards | DeepSpeedShards  # open until apply has read the SavedRanges


def load(parts: CheckpointParts, load_dir: str, tag: str | None = None, *, load_module_strict: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False, options: CheckpointOptions = CheckpointOptions()) -> tuple[str, dict]:
    """Collective: restores a checkpoint saved on any world size and stage,
    all or nothing ([Note: validate, agree, apply]); returns (path,
    client_state) like DeepSpeed. load_optimizer_states=False leaves the
    optimizer (and the loss scale, which DeepSpeed keeps in it) as they are;
    load_module_only restores the parameters only. The fp32 masters always
    come from the checkpoint (DeepSpeed rebuilds them from the 16-bit weights
    without the optimizer states); load_module_strict checks the parameter names."""
    load_options = LoadOptions(load_module_strict, load_optimizer_states and not load_module_only,
                               load_lr_scheduler_states, load_module_only)
    staged, message, error = None, None, None
    try:
        staged = stage(parts, load_dir, tag, load_options)
    except Exception as caught:  # every failure to read or check, agreed on below
        message, error = f"{type(caught).__name__}: {caught}", caught
    try:
        failures = store_agree(f"load_checkpoint {load_dir}", options.timeout_s, message)
        if failures:
            raise ValueError(f"load_checkpoint {load_dir} (tag {tag}): nothing was loaded on any rank; "
                             + "; ".join(f"rank {r}: {m}" for r, m in failures)) from error
        apply(parts, staged, load_options)
    finally:
        if staged is not None:  # open until apply has read the saved ranges
            staged.saved.close()
    return staged.directory, staged.state["client_state"]


# ---- stage: read and check, change nothing ---------------------------------------------------------
def stage(parts: CheckpointParts, load_dir: str, tag: str | None, options: LoadOptions) -> Staged:
    """zero's own checkpoint, or DeepSpeed's (deepspeed_files.py), read and checked."""
    directory = resolve(load_dir, tag)
    if not os.path.isfile(os.path.join(directory, MANIFEST)) and is_deepspeed(directory):
        saved = DeepSpeedShards(directory, optimizer_states=options.optimizer_states)
        state, where = saved.engine_state(), saved.model_path

        def module_states() -> tuple[str, dict]:
            return saved.model_path, saved.extras()
    else:
        manifest = read_manifest(directory)
        state = read_engine_state(directory, manifest)
        saved, where = SavedShards(directory, state["world_size"], manifest), f"{directory}/{ENGINE_STATE}"

        def module_states() -> tuple[str, dict]:
            path = check_file(directory, manifest, MODEL_STATES, crc=True)
            return path, load_plain(path, mmap=True)
    try:
        check_engine(parts, where, directory, state, options)
        masters, optimizer = stage_shards(parts, saved, options)
        extras = stage_extras(parts, module_states, strict=options.strict)
    except BaseException:
        saved.close()
        raise
    return Staged(directory, state, masters, optimizer, extras, scaler=restores_scaler(parts, state, options),
                  saved=saved)


def check_engine(parts: CheckpointParts, where: str, directory: str, state: dict, options: LoadOptions) -> None:
    """Parameter names and shapes, optimizer groups, scheduler kind, batch layout."""
    optimizer = parts.optimizer
    if options.optimizer_states and len(state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"{where}: {len(state['param_groups'])} optimizer param groups, this engine "
                         f"{len(optimizer.param_groups)}")
    if options.optimizer_states:
        check_hyperparameters(optimizer, where, state["param_groups"])
        if state.get("optimizer"):  # DeepSpeed's: the optimizer that saved it (deepspeed_optim.py)
            check_resumes(optimizer, state["optimizer"]["name"], set(state["optimizer"]["kinds"]), where)
    check_params(parts, where, state["params"], strict=options.strict)
    scheduler = parts.scheduler
    if restores_scheduler(parts, state, options):
        saved, own = set(state["scheduler"]), set(scheduler.state_dict())
        if saved != own:
            raise ValueError(f"{where}: the saved LR scheduler's state has keys {sorted(saved)}, this engine's "
                             f"{type(scheduler).__name__} {sorted(own)}: another kind of scheduler")
    if not options.module_only:
        warn_mid_accumulation(directory, state)


def check_hyperparameters(optimizer: torch.optim.Optimizer, where: str, saved: list[dict]) -> None:
    """The saved optimizer hyperparameters are values of the kinds this
    optimizer's groups hold; keys it does not have are not applied (warned)."""
    unknown = set()
    for g, (own, theirs) in enumerate(zip(optimizer.param_groups, saved)):
        for key, value in theirs.items():
            if key not in own or key == "params":
                unknown.add(key)
            elif not same_kind(own[key], value):
                raise ValueError(f"{where}: optimizer param group {g}: {key} is {value!r}, this optimizer holds "
                                 f"a {type(own[key]).__name__} ({own[key]!r})")
    if unknown:
        log.warning(f"zero: {where}: optimizer hyperparameters {sorted(unknown)} are not this optimizer's; not applied")


def same_kind(own: object, saved: object) -> bool:
    """Numbers for numbers (an int lr for a float one), bools for bools, sequences element by element."""
    if own is None:  # torch's "not set" (foreach, fused)
        return saved is None or isinstance(saved, bool)
    if isinstance(own, bool):
        return isinstance(saved, bool)
    if isinstance(own, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool)
    if isinstance(own, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(own) and all(map(same_kind, own, saved))
    return type(saved) is type(own)


def check_params(parts: CheckpointParts, where: str, saved: dict[str, tuple[int, ...]], *, strict: bool) -> None:
    """The saved trainable parameters match the engine's by shape, and (strict) by name."""
    shapes = parts.param_shapes()
    wrong = [(name, tuple(saved[name]), shape) for name, shape in shapes.items()
             if name in saved and tuple(saved[name]) != shape]
    if wrong:
        raise ValueError(f"{where}: (parameter, saved shape, model shape) differ: {wrong[:8]}")
    missing, unexpected = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if strict and (missing or unexpected):
        raise ValueError(f"{where} does not match the module (load_module_strict): missing parameters "
                         f"{missing[:8]}, unexpected {unexpected[:8]}")


def warn_mid_accumulation(directory: str, state: dict) -> None:
    counters, layout = state["counters"], state["layout"]
    within = counters["micro_steps"] - counters["global_steps"] * layout["gradient_accumulation_steps"]
    if within > 0:
        log.warning(f"zero: load_checkpoint {directory}: saved {within} micro-steps into an accumulation of "
                    f"{layout['gradient_accumulation_steps']}; their gradients are not in the checkpoint: training "
                    f"resumes at the boundary after global step {counters['global_steps']}")


@dataclass(frozen=True, slots=True)
class SavedRange:
    """Elements [offset, offset + numel) of a saved fp32 tensor: checked (crc32,
    coverage) when staged, read at apply straight into the tensor it restores,
    so a load holds no second copy of the rank's states ([Note: validate, agree, apply])."""

    saved: SavedShards
    name: str
    kind: str
    offset: int
    numel: int

    def read_into(self, out: torch.Tensor) -> torch.Tensor:
        self.saved.read(self.name, self.kind, out.view(-1), self.offset)
        return out


def stage_shards(parts: CheckpointParts, saved: SavedShards | DeepSpeedShards,
                 options: LoadOptions) -> tuple[dict, dict]:
    """This rank's master slices (and optimizer states): zero's own checked,
    to be read at apply (SavedRange; scalars read now); DeepSpeed's read into new tensors."""
    masters, optimizer = {}, {}
    deferred = isinstance(saved, SavedShards)
    for shard in parts.shards.state_dict().values():  # names and ranges only: the views are not touched here
        if shard.name not in saved.by_name:  # not saved, and load_module_strict is off
            continue
        if deferred:
            kinds = saved.check(shard.name, "master", shard.offset, shard.numel)
            masters[shard.key] = SavedRange(saved, shard.name, "master", shard.offset, shard.numel)
        else:
            masters[shard.key] = torch.empty(shard.numel, dtype=torch.float32)
            kinds = saved.read(shard.name, "master", masters[shard.key], shard.offset)
        if options.optimizer_states and shard.group is not None:
            optimizer[shard.key] = {kind: stage_state(saved, shard, kind, deferred) for kind in sorted(kinds - {"master"})}
    return masters, optimizer


def stage_state(saved: SavedShards | DeepSpeedShards, shard: NamedShard, kind: str,
                deferred: bool) -> torch.Tensor | SavedRange:
    if deferred and saved.elementwise(shard.name, shard.offset, shard.numel, kind) == torch.float32:
        saved.check(shard.name, kind, shard.offset, shard.numel)
        return SavedRange(saved, shard.name, kind, shard.offset, shard.numel)
    return saved.state(shard.name, shard.offset, shard.numel, kind)


def stage_extras(parts: CheckpointParts, module_states: Callable[[], tuple[str, dict]], *, strict: bool) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters (not in any bucket) from the saved module states, checked."""
    trainable = set(parts.param_names)
    trainable_ids = {id(p) for p in parts.trainable}
    tied = {name for name, p in parts.module.named_parameters(remove_duplicate=False) if id(p) in trainable_ids}
    extras = {k: v for k, v in parts.module.state_dict().items() if k not in trainable and k not in tied}
    if not extras:
        return {}
    path, saved = module_states()
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: a {type(saved).__name__}, not a state_dict")
    missing = [k for k in extras if k not in saved]
    if missing and strict:
        raise ValueError(f"{path} lacks {missing[:8]} (load_module_strict)")
    out = {}
    for key, tensor in extras.items():
        if key not in saved:
            continue
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{path}: {key} is {got}, the module's {tuple(tensor.shape)}")
        out[key] = value
    return out


def restores_scheduler(parts: CheckpointParts, state: dict, options: LoadOptions) -> bool:
    return (options.scheduler and not options.module_only and state["scheduler"] is not None
            and parts.scheduler is not None and hasattr(parts.scheduler, "load_state_dict"))


def restores_scaler(parts: CheckpointParts, state: dict, options: LoadOptions) -> bool:
    """[Note: what a resume restores]: only into the precision and kind of scaler it was saved from."""
    if not options.optimizer_states:
        return False
    dtype = str(parts.dtype).removeprefix("torch.")
    own = parts.scaler.state_dict()
    if state["dtype"] != dtype or set(state["scaler"]) != set(own):
        log.warning(f"zero: load_checkpoint: the checkpoint's loss scaler ({state['dtype']}, {state['scaler']}) "
                    f"is not this engine's kind ({dtype}, {own}): the engine keeps its own")
        return False
    return True


# ---- apply: nothing here reads a file -----------------------------------------------------------
def apply(parts: CheckpointParts, staged: Staged, options: LoadOptions) -> None:
    """Each stateful part loads its own state; the shards last (they publish the masters)."""
    state = staged.state
    with torch.no_grad():
        module_state = parts.module.state_dict()
        for key, value in staged.extras.items():
            module_state[key].copy_(value)
    if options.optimizer_states:
        for group, hyper in zip(parts.optimizer.param_groups, state["param_groups"]):
            group.update({key: value for key, value in hyper.items() if key in group and key != "params"})
    if not options.module_only:
        if staged.scaler:
            parts.scaler.load_state_dict(state["scaler"])
        if restores_scheduler(parts, state, options):
            parts.scheduler.load_state_dict(state["scheduler"])
        parts.progress.load_state_dict(state["counters"])
    shards = {key: {"master": master, **staged.optimizer.get(key, {})} for key, master in staged.masters.items()}
    parts.shards.load_state_dict(shards, optimizer_states=options.optimizer_states)
