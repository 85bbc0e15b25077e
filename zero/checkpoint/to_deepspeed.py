"""Writes a zero checkpoint in DeepSpeed's layout (deepspeed_layout.py), for
the world size and ZeRO stage it was saved with, so that DeepSpeed's
load_checkpoint continues the training and its zero_to_fp32.py (written
beside, as DeepSpeed does) consolidates the weights:

    python -m zero.to_deepspeed ZERO_CKPT OUT [--tag TAG] [--overwrite] [--ds-config FILE | --optimizer NAME]

ZERO_CKPT is a save_dir (its `latest`, or --tag, picks the checkpoint) or a
checkpoint directory; OUT receives OUT/TAG/ and OUT/latest, written through
OUT/.TAG.partial and renamed (the atomic commit of zero's own saves). OUT is
never the checkpoint, inside it or around it, and a non-empty OUT is written
into only with --overwrite ([Note: a converter's output] in output.py). zero's
files are read as plain data and checked as load_checkpoint checks them. The
output holds DeepSpeed's own classes (its loss scaler and stage enum), so
this needs deepspeed installed, as the DeepSpeed that reads it has.

The optimizer states are written in the layout of the optimizer DeepSpeed
builds when it resumes ([Note: DeepSpeed's optimizer layouts] in
deepspeed_optim.py): that of the DeepSpeed config zero ran with (the same
file, as a drop-in), recorded in the checkpoint; --ds-config names the config
DeepSpeed resumes with instead, --optimizer the optimizer itself.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections import OrderedDict

import torch

from .deepspeed_layout import DS_VERSION, Layout, flat_layout, model_states_name, optim_states_name
from .deepspeed_optim import CPU_ADAM, FUSED_ADAM, built_by, check_target, config_for, write_group, write_state
from .format import MODEL_STATES, SavedShards, check_file, load_plain, read_engine_state, read_manifest
from .output import check_empty, check_outside, first_missing, partial_file, remove_made
from .parts import CheckpointOptions
from .save import commit, writing
from .tensorfile import fsync_dir
from .to_fp32 import checkpoint_directory


def deepspeed_classes():
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError as error:
        raise RuntimeError(f"to_deepspeed: DeepSpeed's layout holds DeepSpeed's own classes; install deepspeed "
                           f"(pip install deepspeed): {error}") from None
    return LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address


class Source:
    """A zero checkpoint, as the DeepSpeed writer needs it; `optimizer`: the
    optimizer DeepSpeed resumes with (None: the one of the config zero ran with)."""

    def __init__(self, directory: str, optimizer: str | None = None) -> None:
        self.directory = directory
        self.manifest = read_manifest(directory)
        self.state = read_engine_state(directory, self.manifest)
        self.facts = self.state.get("deepspeed")
        if not isinstance(self.facts, dict):
            raise ValueError(f"{directory}: saved by a zero without DeepSpeed's layout facts (buffer names, "
                             f"clipping); save it again with this zero to convert it")
        self.stage, self.world_size = int(self.state["stage"]), int(self.state["world_size"])
        if self.stage not in (1, 2, 3):
            raise ValueError(f"{directory}: a stage-{self.stage} checkpoint; DeepSpeed's ZeRO layout has stages 1-3")
        self.optimizer = check_target(optimizer or self._optimizer())
        self.saved = SavedShards(directory, self.world_size, self.manifest)
        self.module = load_plain(check_file(directory, self.manifest, MODEL_STATES, crc=True), mmap=True)
        self.groups = self._groups()
        self.layout = flat_layout(self.stage, self.world_size,
                                  [[(n, math.prod(self.state["params"][n])) for n in g] for g in self.groups],
                                  sub_group_size=int(self.facts["sub_group_size"]))

    def _optimizer(self) -> str:
        if "optimizer" not in self.facts:
            raise ValueError(f"{self.directory}: saved by a zero that did not record its DeepSpeed optimizer; name "
                             f"the one DeepSpeed resumes with (--optimizer, or --ds-config with its config)")
        return self.facts["optimizer"]

    def _groups(self) -> list[list[str]]:
        """Each optimizer param group's parameters, in module order (DeepSpeed's flat-group order)."""
        groups = [[] for _ in self.state["param_groups"]]
        seen = set()
        for _, param in self.state["state_dict"]:
            if param is None or param in seen:
                continue
            seen.add(param)
            saved = self.saved.by_name.get(param)
            if not saved or saved[0][1].group is None or not 0 <= saved[0][1].group < len(groups):
                raise ValueError(f"{self.directory}: parameter {param} has no shard in an optimizer param group")
            groups[saved[0][1].group].append(param)
        return groups

    def aliases(self) -> dict[str, str]:
        first, out = {}, {}
        for key, param in self.state["state_dict"]:
            if param is not None:
                if param in first:
                    out[key] = first[param]
                else:
                    first[param] = key
        return out

    def flat(self, rank: int, group: int, kind: str) -> torch.Tensor:
        """Rank `rank`'s flat group `group` of `kind` (master or an elementwise optimizer state), padded."""
        out = torch.zeros(self.layout.sizes[group], dtype=torch.float32)
        for piece in self.layout.pieces[rank]:
            if piece.group == group:
                self.saved.read(piece.name, kind, out[piece.offset:piece.offset + piece.numel], piece.begin)
        return out

    def optimizer_state(self, rank: int, group: int) -> dict[str, torch.Tensor]:
        pieces = [p for p in self.layout.pieces[rank] if p.group == group] or \
                 [p for pieces in self.layout.pieces for p in pieces if p.group == group]
        first = pieces[0]
        reader, shard, _, _ = next(self.saved.overlaps(first.name, first.begin, first.begin + first.numel))
        kinds = sorted(self.saved.kinds_of(reader, shard) - {"master"})
        out = {}
        for kind in kinds:
            value = self.saved.state(first.name, first.begin, first.numel, kind)
            out[kind] = value if value.dim() == 0 else self.flat(rank, group, kind)
        return out


def convert(checkpoint_dir: str, out_dir: str, *, tag: str | None = None, overwrite: bool = False,
            ds_config: str | dict | None = None, optimizer: str | None = None) -> str:
    """Writes OUT/TAG in DeepSpeed's layout, with OUT/latest and DeepSpeed's
    zero_to_fp32.py beside it; returns its path. The optimizer states are in
    the layout of `optimizer` ("torch.optim.AdamW", "FusedAdam",
    "DeepSpeedCPUAdam"), or of the one DeepSpeed builds from `ds_config` (a
    dict or a JSON file), or of the config zero ran with. ValueError when OUT
    is, is inside or contains the checkpoint, or (unless `overwrite`) is not
    empty, or when zero's optimizer states have no such layout."""
    directory = checkpoint_directory(checkpoint_dir, tag)
    check_outside("to_deepspeed", out_dir, (checkpoint_dir, directory))
    check_empty("to_deepspeed", out_dir, folder=True, overwrite=overwrite)
    classes = deepspeed_classes()
    source = Source(directory, optimizer or resumed_with(ds_config))
    tag = tag or os.path.basename(os.path.normpath(directory))
    target, partial = os.path.join(out_dir, tag), os.path.join(out_dir, f".{tag}.partial")
    made = first_missing(out_dir)
    try:
        with writing("to_deepspeed", out_dir):
            os.makedirs(out_dir, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        write_all(source, partial, classes)
        with writing("to_deepspeed", partial):
            fsync_dir(partial)
        copy_recovery_script(out_dir)
        with writing("to_deepspeed", target):
            commit(out_dir, tag, partial, target, save_latest=True, options=CheckpointOptions())
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        remove_made(made)
        raise
    finally:
        source.saved.close()
    return target


def resumed_with(ds_config: str | dict | None) -> str | None:
    """The optimizer DeepSpeed builds from `ds_config` (None without one)."""
    if ds_config is None:
        return None
    if not isinstance(ds_config, dict):
        try:
            with open(ds_config) as f:
                ds_config = json.load(f)
        except (OSError, ValueError) as error:
            raise ValueError(f"to_deepspeed: --ds-config {ds_config}: {error}") from None
    name = built_by(ds_config)
    if name is None:
        raise ValueError(f"to_deepspeed: the DeepSpeed config has no 'optimizer' section to name the optimizer it "
                         f"resumes with; pass --optimizer (torch.optim.AdamW, {FUSED_ADAM} or {CPU_ADAM})")
    return name


def write_all(source: Source, partial: str, classes) -> None:
    bf16 = source.state["dtype"] == "bfloat16"
    for rank in range(source.world_size):
        if rank == 0 or source.stage == 3:
            save(model_states(source, rank), os.path.join(partial, model_states_name(source.stage, rank)))
        save({"optimizer_state_dict": optim_states(source, rank, classes), "ds_config": ds_config(source),
              "ds_version": DS_VERSION}, os.path.join(partial, optim_states_name(rank, bf16)))


def save(state: dict, path: str) -> None:
    with writing("to_deepspeed", path), open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def ds_config(source: Source) -> dict:
    layout, dtype = source.state["layout"], source.state["dtype"]
    optimizer_config = config_for(source.optimizer, source.facts.get("adamw", True))
    return {"train_micro_batch_size_per_gpu": layout["micro_batch_size"],
            "gradient_accumulation_steps": layout["gradient_accumulation_steps"],
            "gradient_clipping": source.facts["clip_grad"],
            "bf16": {"enabled": dtype == "bfloat16"}, "fp16": {"enabled": dtype == "float16"},
            **optimizer_config,
            "zero_optimization": {"stage": source.stage, "sub_group_size": source.facts["sub_group_size"],
                                  **optimizer_config.get("zero_optimization", {})}}


def model_states(source: Source, rank: int) -> dict:
    state, buffers, stage = source.state, set(source.facts["buffers"]), source.stage
    trainable = {key for key, param in state["state_dict"] if param is not None}
    frozen = [key for key, param in state["state_dict"] if param is None and key not in buffers]
    module = OrderedDict()
    for key, _ in state["state_dict"]:
        value = source.module[key]
        module[key] = value.new_empty(0) if stage == 3 and key in trainable else value  # stage 3: partitioned
    out = {
        "module": module, "buffer_names": [k for k, _ in state["state_dict"] if k in buffers], "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(state["params"][n])) for n in g) for g in source.groups],
        "frozen_param_shapes": None, "frozen_param_fragments": None, "shared_params": source.aliases(),
        "lr_scheduler": state["scheduler"], "data_sampler": None, "random_ltd": None,
        "skipped_steps": state["counters"]["skipped_steps"], "global_steps": state["counters"]["global_steps"],
        "global_samples": state["counters"]["global_samples"], "dp_world_size": source.world_size,
        "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config(source), "ds_version": DS_VERSION,
    }
    if stage >= 2:
        out["frozen_param_shapes"] = OrderedDict((k, source.module[k].shape) for k in frozen)
        out["frozen_param_fragments"] = OrderedDict((k, fragment(source.module[k], rank, source.world_size, stage))
                                                    for k in frozen)
    out.update(state["client_state"])
    return out


def fragment(value: torch.Tensor, rank: int, world_size: int, stage: int) -> torch.Tensor:
    """A frozen parameter as DeepSpeed keeps it on `rank`: whole, or (stage 3) its zero-padded partition."""
    if stage < 3:
        return value
    part = math.ceil(value.numel() / world_size)
    flat = torch.zeros(part * world_size, dtype=value.dtype)
    flat[:value.numel()] = value.reshape(-1)
    return flat[rank * part:(rank + 1) * part].clone()


def optim_states(source: Source, rank: int, classes) -> dict:
    loss_scaler, dynamic_loss_scaler, stage_enum, fragment_address = classes
    layout: Layout = source.layout
    where = f"to_deepspeed {source.directory}"
    hyper = [write_group(source.optimizer, g, where) for g in source.state["param_groups"]]
    states = {g: write_state(source.optimizer, source.optimizer_state(rank, g), where)
              for g in range(len(layout.sizes))}
    scaler = make_scaler(source, loss_scaler, dynamic_loss_scaler)
    common = {"loss_scaler": scaler, "dynamic_loss_scale": bool(scaler.dynamic), "overflow": False}
    if source.stage == 3:
        for g, group in enumerate(hyper):
            group["params"] = [s for s, pg in enumerate(layout.param_group) if pg == g]
        return {"zero_stage": stage_enum(3), **common, "partition_count": source.world_size,
                "optimizer_state_dict": {"state": states, "param_groups": hyper},
                "fp32_flat_groups": [source.flat(rank, g, "master") for g in range(len(layout.sizes))]}
    for g, group in enumerate(hyper):
        group["params"] = [g]
    lean = [source.flat(rank, g, "master")[:layout.lean_size(rank, g)] for g in range(len(layout.sizes))]
    mappings = [OrderedDict() for _ in layout.sizes]
    for piece in layout.pieces[rank]:
        mappings[piece.group][piece.name] = fragment_address(numel=piece.numel, start=piece.offset)
    return {**common, "clip_grad": source.facts["clip_grad"],
            "base_optimizer_state": {"state": states, "param_groups": hyper},
            "single_partition_of_fp32_groups": lean, "zero_stage": stage_enum(source.stage),
            "group_paddings": layout.paddings[rank], "param_alignment_paddings": [[0] * len(g) for g in source.groups],
            "partition_count": [source.world_size] * len(layout.sizes), "ds_version": DS_VERSION,
            "param_slice_mappings": mappings}


def make_scaler(source: Source, loss_scaler, dynamic_loss_scaler):
    """zero's loss scaler (precision.py) as DeepSpeed's object."""
    saved, options = source.state["scaler"], source.facts["scaler_options"]
    if "hysteresis_left" not in saved:
        return loss_scaler(scale=saved["scale"])
    scaler = dynamic_loss_scaler(init_scale=saved["scale"], scale_window=options["loss_scale_window"],
                                 min_scale=options["min_loss_scale"], delayed_shift=options["hysteresis"],
                                 consecutive_hysteresis=options["consecutive_hysteresis"])
    scaler.cur_hysteresis = saved["hysteresis_left"]
    scaler.cur_iter = saved["iteration"]
    scaler.last_overflow_iter = saved["last_overflow_iteration"]
    return scaler


def copy_recovery_script(out_dir: str) -> None:
    """DeepSpeed's zero_to_fp32.py beside the checkpoint, as its save_checkpoint leaves it."""
    import deepspeed.utils

    src = os.path.join(os.path.dirname(deepspeed.utils.__file__), "zero_to_fp32.py")
    dst = os.path.join(out_dir, "zero_to_fp32.py")
    partial = partial_file(dst)
    with writing("to_deepspeed", dst):
        try:
            shutil.copyfile(src, partial)
            os.chmod(partial, os.stat(partial).st_mode | 0o111)
            os.replace(partial, dst)
        except BaseException:
            if os.path.exists(partial):
                os.remove(partial)
            raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero.to_deepspeed", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into an OUT that is not empty (TAG, latest and zero_to_fp32.py are replaced)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ds-config", default=None, help="the DeepSpeed config JSON the run resumes with: its "
                       "optimizer's layout (default: the config zero ran with)")
    which.add_argument("--optimizer", default=None, help=f"the optimizer DeepSpeed resumes with: torch.optim.AdamW "
                       f"(torch_adam), {FUSED_ADAM} or {CPU_ADAM} (offload_optimizer)")
    args = parser.parse_args(argv)
    try:
        print(convert(args.checkpoint_dir, args.output_dir, tag=args.tag, overwrite=args.overwrite,
                      ds_config=args.ds_config, optimizer=args.optimizer))
    except ValueError as error:  # the caller's paths or checkpoint: the message says it all
        sys.exit(f"{parser.prog}: error: {error}")


if __name__ == "__main__":
    main()
