"""Resuming a DeepSpeed checkpoint: its files read as plain data
(deepspeed_layout.py), checked against each other, and served to the loader
(load.py) through the same calls as zero's own named shards, so it
loads on any world size and stage, all or nothing, like zero's own.

What is restored follows DeepSpeed's own load_checkpoint: the module's
buffers (and frozen parameters), fp32 masters, optimizer states and
hyperparameters, the LR scheduler, the loss scaler, global steps, samples and
skipped steps, and client_state (the model-states keys DeepSpeed does not
own). The optimizer states are read in their optimizer's layout
(deepspeed_optim.py). Refused with a ValueError naming the file: pipeline,
MoE, tensor parallel and universal checkpoints, optimizer states zero does not
map, and a set of files that do not agree.
DeepSpeed's files have no checksums of their own, but each record of the zip
torch.save writes has a crc32, checked before anything is unpickled; a file
that passes is also checked against the others' shapes and sizes.
"""
from __future__ import annotations

import math
import os
import re

import torch

from .deepspeed_layout import (SUB_GROUP_SIZE, Fields, Piece, flat_layout, load_deepspeed, model_states_name,
                               optim_states_name)
from .deepspeed_optim import read_group, read_state, saved_optimizer

DEEPSPEED_SUFFIXES = ("_model_states.pt", "_optim_states.pt")
UNSUPPORTED = ((re.compile(r"^layer_\d+"), "a pipeline-parallel"), (re.compile(r"expert|expp_rank"), "a MoE"),
               (re.compile(r"mp_rank_(?!00_)\d+"), "a tensor-parallel"))
DEEPSPEED_STATES = frozenset({"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
                              "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
                              "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
                              "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
                              "checkpoint_parallel_dimensions", "universal_checkpoint_info"})


def is_deepspeed(directory: str) -> bool:
    return any(name.endswith(DEEPSPEED_SUFFIXES) for name in os.listdir(directory))


def check_kind(directory: str) -> None:
    """Refuses the kinds of DeepSpeed checkpoint zero does not resume."""
    names = sorted(os.listdir(directory))
    if os.path.isdir(os.path.join(directory, "zero")):
        raise ValueError(f"{directory}: a DeepSpeed universal checkpoint (its zero/ folder): zero resumes "
                         f"DeepSpeed's ZeRO checkpoints (stages 1-3), not universal ones")
    for pattern, kind in UNSUPPORTED:
        found = [n for n in names if pattern.search(n)]
        if found:
            raise ValueError(f"{directory}: {kind} DeepSpeed checkpoint ({found[:3]}): zero resumes data-parallel "
                             f"ZeRO checkpoints (stages 1-3) only")


def need(path: str, state: dict, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{path}: not a DeepSpeed ZeRO checkpoint file: no {missing}")


class DeepSpeedShards:
    """A DeepSpeed checkpoint directory, indexed by parameter name as zero's
    SavedShards; without `optimizer_states`, its masters only."""

    def __init__(self, directory: str, *, optimizer_states: bool = True) -> None:
        check_kind(directory)
        self.directory = directory
        self.model_path, self.model = self._model_states()
        self.stage, self.world_size = self._optim_states()
        self.shapes = {name: tuple(shape) for group in self.model["param_shapes"] for name, shape in group.items()}
        groups = [[(name, math.prod(shape)) for name, shape in group.items()] for group in self.model["param_shapes"]]
        sub_group_size = (self.model.get("ds_config") or {}).get("zero_optimization", {}).get("sub_group_size")
        self.layout = flat_layout(self.stage, self.world_size, groups, alignment_paddings=self.alignment,
                                  sub_group_size=int(sub_group_size or SUB_GROUP_SIZE))
        self._check_sizes()
        self.aliases = {k: v for k, v in (self.model.get("shared_params") or {}).items() if v in self.shapes}
        self.by_name: dict[str, list[tuple[int, Piece]]] = {}
        for r, pieces in enumerate(self.layout.pieces):
            for piece in pieces:
                self.by_name.setdefault(piece.name, []).append((r, piece))
        for alias, target in self.aliases.items():
            self.by_name.setdefault(alias, self.by_name.get(target, []))
        self.optimizer_states = optimizer_states
        self.optimizer = self._saved_optimizer() if optimizer_states else None

    # ---- the files ----
    def _model_states(self) -> tuple[str, dict]:
        for stage in (1, 3):
            path = os.path.join(self.directory, model_states_name(stage))
            if os.path.isfile(path):
                state = load_deepspeed(path)
                need(path, state, ("module", "param_shapes", "buffer_names", "dp_world_size", "global_steps"))
                return path, state
        raise ValueError(f"{self.directory}: no {model_states_name(1)} or {model_states_name(3)}: not a complete "
                         f"DeepSpeed ZeRO checkpoint")

    def _optim_states(self) -> tuple[int, int]:
        world_size = int(self.model["dp_world_size"])
        bf16 = os.path.isfile(os.path.join(self.directory, optim_states_name(0, True)))
        self.paths = [os.path.join(self.directory, optim_states_name(r, bf16)) for r in range(world_size)]
        missing = [p for p in self.paths if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"{self.directory}: saved on {world_size} ranks, but {missing[:3]} are missing")
        self.optim = []
        for path in self.paths:
            state = load_deepspeed(path)
            need(path, state, ("optimizer_state_dict",))
            need(path, state["optimizer_state_dict"], ("zero_stage", "partition_count"))
            self.optim.append(state["optimizer_state_dict"])
        stage = int(self.optim[0]["zero_stage"])
        if stage not in (1, 2, 3):
            raise ValueError(f"{self.paths[0]}: ZeRO stage {stage}; zero resumes DeepSpeed's stages 1-3")
        counts = self.optim[0]["partition_count"]
        count = max(counts) if isinstance(counts, list) else int(counts)
        if count != world_size:
            raise ValueError(f"{self.paths[0]}: partitioned over {count} ranks, the model states say {world_size}")
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        for path, osd in zip(self.paths, self.optim):
            need(path, osd, (key, "optimizer_state_dict" if stage == 3 else "base_optimizer_state"))
        self.alignment = self.optim[0].get("param_alignment_paddings") if stage < 3 else None
        return stage, world_size

    def _saved_optimizer(self) -> str | None:
        """The optimizer whose layout the states are in (deepspeed_optim.py); None in an elastic checkpoint."""
        base = self.base_state(0)
        if not isinstance(base, dict) or not isinstance(base.get("param_groups"), list):
            return None  # optimizer_groups() refuses it
        states = [base.get("state", {}).get(g, {}) for g in range(len(self.layout.sizes))]
        return saved_optimizer(self.model.get("ds_config"), base["param_groups"], states, self.paths[0])

    def _check_sizes(self) -> None:
        key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        for r, (path, osd) in enumerate(zip(self.paths, self.optim)):
            saved = [tuple(t.shape) for t in osd[key]]
            want = [(self.layout.lean_size(r, g),) for g in range(len(self.layout.sizes))]
            if saved != want:
                raise ValueError(f"{path}: fp32 flat groups of shapes {saved[:4]}, the parameter shapes in "
                                 f"{os.path.basename(self.model_path)} make {want[:4]}: the files do not agree")

    # ---- what the loader reads (SavedShards' calls) ----
    def flat(self, rank: int, group: int, kind: str) -> torch.Tensor:
        osd = self.optim[rank]
        if kind == "master":
            return osd["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"][group]
        return self.optimizer_state(rank, group).get(kind)

    def base_state(self, rank: int) -> dict | list:
        osd = self.optim[rank]
        return osd["optimizer_state_dict"] if self.stage == 3 else osd["base_optimizer_state"]

    def optimizer_state(self, rank: int, group: int) -> dict:
        """Flat group `group`'s optimizer state on `rank`, in torch's terms; {} without optimizer states."""
        if self.optimizer is None:  # not asked for, or an elastic checkpoint's (refused by optimizer_groups)
            return {}
        return read_state(self.optimizer, self.base_state(rank).get("state", {}).get(group, {}))

    def kinds(self, name: str) -> set[str]:
        rank, piece = self.by_name[name][0]
        state = self.optimizer_state(rank, piece.group)
        return {"master"} | {k for k, v in state.items() if isinstance(v, torch.Tensor)}

    def read(self, name: str, kind: str, out: torch.Tensor, begin: int) -> set[str]:
        covered = 0
        for rank, piece in self.by_name.get(name, ()):
            lo, hi = max(begin, piece.begin), min(begin + out.numel(), piece.begin + piece.numel)
            if lo >= hi:
                continue
            flat = self.flat(rank, piece.group, kind)
            where = f"{self.paths[rank]}: {name}'s {kind}"
            if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() < piece.offset + piece.numel:
                raise ValueError(f"{where}: {tuple(flat.shape) if isinstance(flat, torch.Tensor) else flat!r} "
                                 f"does not hold elements [{piece.offset}, {piece.offset + piece.numel}) of its group")
            start = piece.offset + lo - piece.begin
            out[lo - begin:hi - begin].copy_(flat[start:start + hi - lo])
            covered += hi - lo
        if covered != out.numel():
            raise ValueError(f"{self.directory}: the saved partitions cover {covered} of elements [{begin}, "
                             f"{begin + out.numel()}) of {name}")
        return self.kinds(name)

    def state(self, name: str, offset: int, numel: int, kind: str) -> torch.Tensor:
        """One optimizer state of elements [offset, offset + numel) of `name`: elementwise, or a scalar."""
        rank, piece = self.by_name[name][0]
        value = self.optimizer_state(rank, piece.group).get(kind)
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            return value.clone()
        out = torch.empty(numel, dtype=torch.float32)
        self.read(name, kind, out, offset)
        return out

    def close(self) -> None:
        self.optim, self.model = [], {}

    # ---- the engine state, as zero's engine_state.pt holds it ----
    def engine_state(self) -> dict:
        model, config = self.model, self.model.get("ds_config") or {}
        accumulation = int(config.get("gradient_accumulation_steps", 1) or 1)
        micro = int(config.get("train_micro_batch_size_per_gpu", 0) or 0)
        groups = self.optimizer_groups() if self.optimizer_states else []
        return {
            "format": "deepspeed", "world_size": self.world_size, "stage": self.stage, "dtype": self.dtype(config),
            "params": self.shapes, "param_groups": groups, "scaler": self.scaler(),
            "optimizer": self.optimizer and {"name": self.optimizer, "kinds": self.optimizer_kinds()},
            "layout": {"world_size": self.world_size, "micro_batch_size": micro,
                       "gradient_accumulation_steps": accumulation,
                       "train_batch_size": micro * accumulation * self.world_size},
            "scheduler": model.get("lr_scheduler"),
            "counters": {"global_steps": int(model["global_steps"]),
                         "global_samples": int(model.get("global_samples", 0)),
                         "micro_steps": int(model["global_steps"]) * accumulation,
                         "skipped_steps": int(model.get("skipped_steps", 0))},
            "client_state": {k: v for k, v in model.items() if k not in DEEPSPEED_STATES},
        }

    def optimizer_groups(self) -> list[dict]:
        base = self.base_state(0)
        groups = base.get("param_groups") if isinstance(base, dict) else None
        if not isinstance(groups, list):
            raise ValueError(f"{self.paths[0]}: no optimizer param_groups (an elastic checkpoint without them)")
        if self.stage < 3 and len(groups) != len(self.layout.sizes):
            raise ValueError(f"{self.paths[0]}: {len(groups)} optimizer param groups for {len(self.layout.sizes)} "
                             f"flat groups")
        return [read_group(self.optimizer, g, self.paths[0]) for g in groups]

    def optimizer_kinds(self) -> list[str]:
        """The kinds of state the optimizer saved (rank 0's, every flat group's)."""
        return sorted({kind for g in range(len(self.layout.sizes)) for kind in self.optimizer_state(0, g)})

    def dtype(self, config: dict) -> str:
        if (config.get("bf16") or {}).get("enabled"):
            return "bfloat16"
        if (config.get("fp16") or {}).get("enabled"):
            return "float16"
        return "float32"

    def scaler(self) -> dict:
        """DeepSpeed's loss scaler in zero's terms (precision.py)."""
        scaler = self.optim[0].get("loss_scaler")
        fields = scaler.fields() if isinstance(scaler, Fields) else {}
        if not fields.get("dynamic"):
            return {"scale": float(fields.get("cur_scale", 1.0))}
        return {"scale": float(fields["cur_scale"]), "hysteresis_left": int(fields.get("cur_hysteresis", 1)),
                "iteration": int(fields.get("cur_iter", 0)),
                "last_overflow_iteration": int(fields.get("last_overflow_iter", -1))}

    def extras(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters, by state_dict key."""
        module = self.model["module"]
        out = {k: v for k, v in module.items() if isinstance(v, torch.Tensor) and k not in self.shapes
               and k not in self.aliases}
        fragments = self.model.get("frozen_param_fragments")
        if self.stage == 3 and fragments:  # each rank's model states hold its piece of each frozen parameter
            files = [load_deepspeed(os.path.join(self.directory, model_states_name(3, r)))
                     for r in range(self.world_size)]
            for name, shape in (self.model.get("frozen_param_shapes") or {}).items():
                whole = torch.cat([f["frozen_param_fragments"][name].reshape(-1) for f in files])
                out[name] = whole[:math.prod(shape)].view(tuple(shape))
        return out

