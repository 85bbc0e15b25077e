"""The whole model as files, written one tensor at a time: a checkpoint's
model_states.pt, save_16bit_model's output and python -m zero.to_fp32's.

[Note: sharded model files]
A model larger than a rank's memory is never held whole: a writer asks for
one tensor at a time (tensorfile.py), so the peak is the largest tensor (one
gathered bucket for save_16bit_model). With a maximum shard size the model is
split as Hugging Face's save_pretrained splits it: tensors in state_dict order,
a new file when the next tensor would pass the size (a tensor larger than it
gets a file of its own), files named NAME-00001-of-00003.EXT beside an index
NAME.EXT.index.json ({"metadata": {"total_size"}, "weight_map": {key: file}}),
which transformers' from_pretrained reads. One file is written as NAME.EXT,
with no index. Tied names share a tensor in a torch file (as in a state_dict)
and are copies in safetensors (which holds no shared tensors). Every file is
written under a hidden sibling and renamed into place once all are written,
the index last; stale shards of an earlier save under the same NAME go.
"""
from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .output import partial_file
from .tensorfile import Fill, TensorSpec, write_safetensors, write_torch

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of a size given as Hugging Face's max_shard_size is: an int, or
    "5GB" (10**9), "5GiB" (2**30), "500MB", ..."""
    if isinstance(size, int) and not isinstance(size, bool):
        nbytes = size
    else:
        match = _SIZE.match(str(size))
        unit = match and match[2].upper()
        if not match or unit not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: not a size (an int of bytes, or as '2GB', '500MiB')")
        nbytes = int(float(match[1]) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"max_shard_size {size!r}: must be > 0 bytes")
    return nbytes


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """The tensors of a model's state_dict, as written: `specs` in state_dict
    order (a tied name's first), `aliases` the other tied names (name -> spec's name)."""

    specs: list[TensorSpec]
    aliases: dict[str, str]


@dataclass(frozen=True, slots=True)
class FilePlan:
    """One file to write: its name in the folder and its tensors in order
    (`aliases`: a torch file's tied names sharing a tensor of `specs`)."""

    name: str
    specs: list[TensorSpec]
    aliases: dict[str, str]


def plan_files(layout: ModelLayout, filename: str, fmt: str, max_shard_size: int | str | None) -> list[FilePlan]:
    """The files holding `layout` ([Note: sharded model files])."""
    aliases_of: dict[str, list[str]] = {}
    for alias, target in layout.aliases.items():
        aliases_of.setdefault(target, []).append(alias)
    # safetensors: a tied name is a copy beside its tensor; torch: it shares it
    items = [(spec, [TensorSpec(a, spec.shape, spec.dtype) for a in aliases_of.get(spec.name, ())])
             for spec in layout.specs]
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    groups: list[list[tuple[TensorSpec, list[TensorSpec]]]] = [[]]
    size = 0
    for item in items:
        nbytes = item[0].nbytes * (1 + len(item[1]) if fmt == "safetensors" else 1)
        if limit is not None and groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    names = shard_names(filename, len(groups))
    plans = []
    for name, group in zip(names, groups):
        if fmt == "safetensors":
            plans.append(FilePlan(name, [s for spec, copies in group for s in (spec, *copies)], {}))
        else:
            plans.append(FilePlan(name, [spec for spec, _ in group],
                                  {copy.name: spec.name for spec, copies in group for copy in copies}))
    return plans


def shard_names(filename: str, count: int) -> list[str]:
    """`filename` alone, or NAME-00001-of-0000N.EXT for each of `count` shards (Hugging Face's names)."""
    if count == 1:
        return [filename]
    stem, ext = os.path.splitext(filename)
    return [f"{stem}-{i:05d}-of-{count:05d}{ext}" for i in range(1, count + 1)]


def index_name(filename: str) -> str:
    return f"{filename}.index.json"


def write_files(folder: str, filename: str, plans: Sequence[FilePlan], fill: Fill, fmt: str,
                metadata: dict[str, str] | None = None) -> list[str]:
    """Writes `plans` into `folder`, then renames them into place (the index
    last) and removes stale shards of `filename`; returns the paths. `fill` is
    asked for each spec of each plan, in order. A failure leaves no partial file."""
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, plan.name) for plan in plans]
    partials = [partial_file(path) for path in paths]
    index = None
    if len(plans) > 1:
        weight_map = {spec.name: plan.name for plan in plans for spec in plan.specs}
        weight_map.update({alias: plan.name for plan in plans for alias in plan.aliases})
        total = sum(spec.nbytes for plan in plans for spec in plan.specs)
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    try:
        for plan, partial in zip(plans, partials):
            if fmt == "safetensors":
                write_safetensors(partial, plan.specs, fill, {"format": "pt", **(metadata or {})})
            else:
                write_torch(partial, plan.specs, fill, plan.aliases)
        for partial, path in zip(partials, paths):
            os.replace(partial, path)
        index_path = os.path.join(folder, index_name(filename))
        if index is not None:
            with open(index_path + ".partial", "w") as f:
                f.write(index)
                f.flush()
                os.fsync(f.fileno())
            os.replace(index_path + ".partial", index_path)
            paths.append(index_path)
    except BaseException:
        for partial in partials:
            if os.path.exists(partial):
                os.remove(partial)
        raise
    remove_stale(folder, filename, paths)
    return paths


def stale_files(folder: str, filename: str, keep: Sequence[str]) -> list[str]:
    """Files of an earlier save of `filename` in `folder` that a save of `keep` replaces."""
    stem, ext = os.path.splitext(filename)
    found = glob.glob(os.path.join(glob.escape(folder), f"{glob.escape(stem)}-[0-9][0-9][0-9][0-9][0-9]-of-"
                                                       f"[0-9][0-9][0-9][0-9][0-9]{glob.escape(ext)}"))
    found += [os.path.join(folder, name) for name in (filename, index_name(filename))]
    kept = {os.path.abspath(path) for path in keep}
    return sorted(path for path in found if os.path.lexists(path) and os.path.abspath(path) not in kept)


def remove_stale(folder: str, filename: str, keep: Sequence[str]) -> None:
    for path in stale_files(folder, filename, keep):
        os.remove(path)


def module_layout(module: torch.nn.Module, trainable: Sequence[torch.nn.Parameter], shapes: Sequence[tuple[int, ...]],
                  dtype: torch.dtype) -> tuple[ModelLayout, dict[str, int | None]]:
    """The layout of `module`'s state_dict with the trainable parameters (whole
    `shapes`, by parameter index) in `dtype`, and each spec's parameter index
    (None: a buffer or frozen parameter, written as the module holds it)."""
    index = {id(p): i for i, p in enumerate(trainable)}
    params = dict(module.named_parameters(remove_duplicate=False))
    specs, aliases, sources, first = [], {}, {}, {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        param = params.get(name)
        i = index.get(id(param)) if param is not None else None
        if i is not None and i in first:
            aliases[name] = first[i]
            continue
        if i is not None:
            first[i] = name
            specs.append(TensorSpec(name, tuple(shapes[i]), dtype))
        else:
            specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype))
        sources[name] = i
    return ModelLayout(specs, aliases), sources
