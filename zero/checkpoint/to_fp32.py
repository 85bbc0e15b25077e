"""Consolidates a checkpoint's named fp32 shards into one state_dict file that
loads strictly into the plain model (tied names and buffers included), one
parameter at a time: peak memory is the largest parameter plus small buffers.

    python -m zero.to_fp32 CKPT_DIR OUT [--tag TAG] [--format safetensors|torch] [--overwrite]

CKPT_DIR is a save_dir (its `latest`, or --tag, picks the checkpoint) or a
checkpoint directory itself; OUT's suffix .safetensors picks that format,
anything else torch.save's. An OUT that is a folder (or ends in /), as
DeepSpeed's zero_to_fp32.py takes, receives OUT/pytorch_model.bin or
OUT/model.safetensors. OUT is never inside the checkpoint, nor over a
non-empty file without --overwrite ([Note: a converter's output] in
output.py). The checkpoint's files are read as plain data and checked against
the sizes and checksums written at save (format.py).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .format import (MANIFEST, MODEL_STATES, SavedShards, check_file, load_plain, read_engine_state, read_manifest,
                     resolve)
from .output import check_empty, check_outside, first_missing, partial_file, remove_made
from .save import writing
from .tensorfile import TensorSpec, write_safetensors, write_torch

FORMATS = ("safetensors", "torch")
FOLDER_FILES = {"torch": "pytorch_model.bin", "safetensors": "model.safetensors"}  # DeepSpeed's zero_to_fp32.py names


def checkpoint_directory(checkpoint_dir: str, tag: str | None = None) -> str:
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, MANIFEST)):
        return checkpoint_dir
    return resolve(checkpoint_dir, tag)


def output_format(output: str, fmt: str | None) -> str:
    fmt = fmt or ("safetensors" if output.endswith(".safetensors") else "torch")
    if fmt not in FORMATS:
        raise ValueError(f"to_fp32: format {fmt!r} is not one of {FORMATS}")
    return fmt


def output_file(output: str, fmt: str | None) -> tuple[str, str]:
    """(the file to write, its format): `output`, or in a folder (one that
    exists, or `output` ending in a separator) DeepSpeed's file name for the
    format (default torch), as its zero_to_fp32.py writes."""
    if output.endswith(os.sep) or os.path.isdir(output):
        fmt = output_format("", fmt)
        return os.path.join(output, FOLDER_FILES[fmt]), fmt
    return output, output_format(output, fmt)


def convert(checkpoint_dir: str, output: str, *, tag: str | None = None, fmt: str | None = None,
            overwrite: bool = False) -> str:
    """Writes the consolidated fp32 state_dict of a checkpoint to `output` (a
    file, or a folder: output_file) through a hidden sibling and a rename;
    returns the file's path. ValueError when `output` is, is inside or contains
    the checkpoint, or (unless `overwrite`) is a file that is not empty."""
    directory = checkpoint_directory(checkpoint_dir, tag)
    path, fmt = output_file(output, fmt)
    check_outside("to_fp32", output, (checkpoint_dir, directory))
    check_outside("to_fp32", path, (checkpoint_dir, directory))
    check_empty("to_fp32", path, folder=False, overwrite=overwrite)
    manifest = read_manifest(directory)
    state = read_engine_state(directory, manifest)
    extras = None
    if any(param is None for _, param in state["state_dict"]):
        extras = load_plain(check_file(directory, manifest, MODEL_STATES, crc=True), mmap=True)
    specs, sources, aliases, first_key = [], {}, {}, {}
    for key, param in state["state_dict"]:
        if param is not None and param in first_key:
            aliases[key] = first_key[param]  # tied: one tensor, two names
            continue
        if param is not None:
            first_key[param] = key
            specs.append(TensorSpec(key, tuple(state["params"][param]), torch.float32))
        else:
            value = extras[key]
            specs.append(TensorSpec(key, tuple(value.shape), torch.float32 if value.is_floating_point() else value.dtype))
        sources[key] = param
    saved = SavedShards(directory, state["world_size"], manifest)

    def fill(spec: TensorSpec) -> torch.Tensor:
        param = sources[spec.name]
        if param is None:
            return extras[spec.name].to(spec.dtype)
        out = torch.empty(spec.numel, dtype=torch.float32)
        saved.read(param, "master", out, 0)
        return out.view(spec.shape)

    partial, made = partial_file(path), first_missing(os.path.dirname(os.path.abspath(path)))
    try:
        with writing("to_fp32", os.path.dirname(partial)):
            os.makedirs(os.path.dirname(partial), exist_ok=True)
        if fmt == "torch":
            write_torch(partial, specs, fill, aliases)
        else:  # safetensors holds no shared tensors: a tied name gets its own copy
            by_name = {spec.name: spec for spec in specs}
            specs = specs + [TensorSpec(alias, by_name[target].shape, torch.float32) for alias, target in aliases.items()]
            sources.update({alias: sources[target] for alias, target in aliases.items()})
            write_safetensors(partial, specs, fill, {"format": "pt"})
        with writing("to_fp32", path):
            os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        remove_made(made)
        raise
    finally:
        saved.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero.to_fp32", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    parser.add_argument("--format", choices=FORMATS, default=None, help="default: from OUT's suffix")
    parser.add_argument("--overwrite", action="store_true", help="write over an OUT that is not empty")
    args = parser.parse_args(argv)
    try:
        print(convert(args.checkpoint_dir, args.output, tag=args.tag, fmt=args.format, overwrite=args.overwrite))
    except ValueError as error:  # the caller's paths or checkpoint: the message says it all
        sys.exit(f"{parser.prog}: error: {error}")


if __name__ == "__main__":
    main()
