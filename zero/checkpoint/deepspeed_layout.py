"""DeepSpeed's checkpoint layout (as DeepSpeed 0.19.8 writes it; ZeRO stages
1-3, data parallel only): the names of its files, how it cuts the fp32
masters and the optimizer's states into per-rank flat groups, and how its
files are read as plain data. zero reads it (deepspeed_files.py) and
writes it (to_deepspeed.py).

    TAG/mp_rank_00_model_states.pt                       stages 1-2: the module, shapes, counters, scheduler
    TAG/zero_pp_rank_{r}_mp_rank_00_model_states.pt      stage 3: the same, one per rank (its frozen fragments)
    TAG/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   per rank: its fp32 flat groups, optimizer states
    latest, zero_to_fp32.py                              beside TAG

[Note: DeepSpeed's flat groups]
Parameters are taken per optimizer param group, in the group's order.
Stages 1-2: a group's parameters are laid end to end (each followed by its
alignment padding, 0 unless parameter_alignment is on) and the whole padded
with zeros to a multiple of 2 x world size; rank r holds elements
[r P, (r + 1) P), P = padded / world size. Its fp32 partition is saved
without the padding ("group_paddings"), the optimizer's states with it.
Stage 3: each parameter is cut by itself: rank r holds its elements
[r Q, (r + 1) Q), Q = ceil(numel / world size), zero-padded; a sub-group
(a param group, split after every sub_group_size partition elements) lays
its parameters' pieces end to end. The zero_to_fp32.py DeepSpeed writes
beside every checkpoint reads the same layout back.

[Note: reading DeepSpeed's files]
DeepSpeed's files are pickles holding, besides tensors and containers, a few
of its own classes: loss scalers, the stage enum, fragment addresses. They are
read with torch.load(weights_only=True) with exactly those names admitted,
each bound to a plain stand-in here (a bag of fields, an int), so reading
needs no DeepSpeed installed and a planted __reduce__ is refused, never run.
Every record's crc32 (torch.save writes one per record of its zip) is
checked before the file is unpickled.
"""
from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass, field

import torch

from .format import load_plain

DS_VERSION = "0.19.8"  # the DeepSpeed whose layout this follows (checked in tests/test_zero_deepspeed_interop.py)
SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size's default, DeepSpeed's and zero's


def model_states_name(stage: int, rank: int = 0) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


def optim_states_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


# ---- reading ([Note: reading DeepSpeed's files]) ---------------------------------------------------
class Fields:
    """A DeepSpeed object (loss scaler, fragment address) read as its fields."""

    def __init__(self, *args: object) -> None:
        self.args = args

    def fields(self) -> dict:
        return dict(vars(self))


class Stage(int):
    """deepspeed.runtime.zero.config.ZeroStageEnum, read as its value."""


SAFE_GLOBALS = [(Fields, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
                (Fields, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
                (Fields, "deepspeed.utils.tensor_fragment.fragment_address"),
                (Stage, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def load_deepspeed(path: str) -> dict:
    """One of DeepSpeed's files, its records' checksums verified, as plain
    data; a ValueError naming `path` otherwise."""
    check_records(path)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        state = load_plain(path, mmap=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: a {type(state).__name__}, not one of DeepSpeed's checkpoint dicts")
    return state


def check_records(path: str) -> None:
    """torch.save writes a zip whose every record carries a crc32: each is
    checked (one read of the file). torch.load itself checks none of them."""
    if not zipfile.is_zipfile(path):
        return  # truncated (no directory left), or torch's legacy format: torch.load says which
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise ValueError(f"{path}: unreadable: {type(error).__name__}: {error}") from None
    if bad is not None:
        raise ValueError(f"{path}: record {bad} fails its crc32: the file is corrupt")


# ---- the flat groups ([Note: DeepSpeed's flat groups]) -----------------------------------------------
@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [begin, begin + numel) of parameter `name`, at `offset` of flat group `group` of a rank."""

    name: str
    begin: int
    numel: int
    group: int
    offset: int


@dataclass(slots=True)
class Layout:
    """Where every element of every parameter lives in each rank's flat groups."""

    stage: int
    world_size: int
    sizes: list[int] = field(default_factory=list)  # each flat group's elements on every rank (padded)
    param_group: list[int] = field(default_factory=list)  # each flat group's optimizer param group
    paddings: list[list[int]] = field(default_factory=list)  # [rank][group]: trailing padding (stages 1-2)
    pieces: list[list[Piece]] = field(default_factory=list)  # [rank]

    def lean_size(self, rank: int, group: int) -> int:
        return self.sizes[group] - (self.paddings[rank][group] if self.paddings else 0)


def flat_layout(stage: int, world_size: int, groups: list[list[tuple[str, int]]], *,
                alignment_paddings: list[list[int]] | None = None, sub_group_size: int = SUB_GROUP_SIZE) -> Layout:
    """DeepSpeed's layout of `groups` (per optimizer param group, (name, numel) in order)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed's ZeRO layout has stages 1-3, not {stage}")
    layout = Layout(stage, world_size, pieces=[[] for _ in range(world_size)])
    if stage == 3:
        for g, params in enumerate(groups):
            for sub in sub_groups(params, world_size, sub_group_size):
                stage3_group(layout, g, sub)
        return layout
    layout.paddings = [[] for _ in range(world_size)]
    for g, params in enumerate(groups):
        stage12_group(layout, g, params, alignment_paddings[g] if alignment_paddings else [0] * len(params))
    return layout


def sub_groups(params: list[tuple[str, int]], world_size: int, size: int) -> list[list[tuple[str, int]]]:
    """A stage-3 param group cut after every `size` partition elements, as DeepSpeed's _create_fp16_sub_groups."""
    out, current, count = [], [], 0
    for param in params:
        current.append(param)
        count += math.ceil(param[1] / world_size)
        if count >= size:
            out.append(current)
            current, count = [], 0
    return out + [current] if current else out


def stage3_group(layout: Layout, param_group: int, params: list[tuple[str, int]]) -> None:
    group, world_size = len(layout.sizes), layout.world_size
    offset = 0
    for name, numel in params:
        part = math.ceil(numel / world_size)
        for r in range(world_size):
            begin = r * part
            if begin < numel:
                layout.pieces[r].append(Piece(name, begin, min(part, numel - begin), group, offset))
        offset += part
    layout.sizes.append(offset)
    layout.param_group.append(param_group)


def stage12_group(layout: Layout, param_group: int, params: list[tuple[str, int]], alignment: list[int]) -> None:
    group, world_size = len(layout.sizes), layout.world_size
    starts, end = [], 0
    for (_, numel), padding in zip(params, alignment, strict=True):
        starts.append(end)
        end += numel + padding
    total = end
    per_rank = math.ceil(total / (2 * world_size)) * 2
    for r in range(world_size):
        lo, hi = r * per_rank, (r + 1) * per_rank
        layout.paddings[r].append(hi - min(hi, max(total, lo)))
        for (name, numel), start in zip(params, starts):
            a, b = max(start, lo), min(start + numel, hi)
            if a < b:
                layout.pieces[r].append(Piece(name, a - start, b - a, group, a - lo))
    layout.sizes.append(per_rank)
    layout.param_group.append(param_group)
