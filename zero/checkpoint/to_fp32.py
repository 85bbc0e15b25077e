"""Consolidates a checkpoint's named fp32 shards into one state_dict file (or
Hugging Face's shards and index) that loads strictly into the plain model
(tied names and buffers included), one parameter at a time: peak memory is
the largest parameter plus small buffers.

    python -m zero.to_fp32 CKPT_DIR OUT [--tag TAG] [--format safetensors|torch] [--overwrite]
                                        [--max-shard-size SIZE]

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
from .model_files import ModelLayout, parse_size, plan_files, stale_files, write_files
from .output import check_empty, check_outside, first_missing, remove_made
from .save import writing
from .tensorfile import TensorSpec

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


def output_file(output: str, fmt: str | None, sharded: bool = False) -> tuple[str, str]:
    """(the file to write, its format): `output`, or in a folder (one that
    exists, or `output` ending in a separator; always when `sharded`)
    DeepSpeed's file name for the format (default torch, safetensors when
    `sharded`), as its zero_to_fp32.py writes."""
    if sharded or output.endswith(os.sep) or os.path.isdir(output):
        fmt = output_format(".safetensors" if sharded else "", fmt)
        return os.path.join(output, FOLDER_FILES[fmt]), fmt
    return output, output_format(output, fmt)


def layout(state: dict, extras: dict | None) -> tuple[ModelLayout, dict[str, str | None]]:
    """The consolidated state_dict's tensors, and each one's trainable parameter (None: from model_states.pt)."""
    specs, aliases, sources, first_key = [], {}, {}, {}
    for key, param in state["state_dict"]:
        if param is not None and param in first_key:
            aliases[key] = first_key[param]  # tied: one tensor, two names
            continue
        if param is not None:
            first_key[param] = key
            specs.append(TensorSpec(key, tuple(state["params"][param]), torch.float32))
        else:
            value = extras[key]
            dtype = torch.float32 if value.is_floating_point() else value.dtype
            specs.append(TensorSpec(key, tuple(value.shape), dtype))
        sources[key] = param
    return ModelLayout(specs, aliases), sources


def convert(checkpoint_dir: str, output: str, *, tag: str | None = None, fmt: str | None = None,
            overwrite: bool = False, max_shard_size: int | str | None = None) -> str:
    """Writes the consolidated fp32 state_dict of a checkpoint to `output` (a
    file, or a folder: output_file), one tensor at a time; returns the file's
    path (the index's, when sharded). `max_shard_size` ("2GB") splits it into
    Hugging Face's shards and index in the folder `output` ([Note: sharded
    model files]). ValueError when `output` is, is inside or contains the
    checkpoint, or (unless `overwrite`) holds files it would write over."""
    if max_shard_size is not None:
        parse_size(max_shard_size)  # a bad size fails before anything is read
    directory = checkpoint_directory(checkpoint_dir, tag)
    path, fmt = output_file(output, fmt, sharded=max_shard_size is not None)
    folder, filename = os.path.split(os.path.abspath(path))
    check_outside("to_fp32", output, (checkpoint_dir, directory))
    check_outside("to_fp32", path, (checkpoint_dir, directory))
    check_empty("to_fp32", path, folder=False, overwrite=overwrite)
    stale = stale_files(folder, filename, [path]) if os.path.isdir(folder) else []
    if stale and not overwrite:
        raise ValueError(f"to_fp32: {folder} holds an earlier output ({', '.join(map(os.path.basename, stale[:3]))}"
                         f"{', ...' if len(stale) > 3 else ''}); pass --overwrite (overwrite=True) to replace it")
    manifest = read_manifest(directory)
    state = read_engine_state(directory, manifest)
    extras = None
    if any(param is None for _, param in state["state_dict"]):
        extras = load_plain(check_file(directory, manifest, MODEL_STATES, crc=True), mmap=True)
    model, sources = layout(state, extras)
    plans = plan_files(model, filename, fmt, max_shard_size)
    saved = SavedShards(directory, state["world_size"], manifest)

    def fill(spec: TensorSpec) -> torch.Tensor:
        name = model.aliases.get(spec.name, spec.name)  # a safetensors copy of a tied name
        param = sources[name]
        if param is None:
            return extras[name].to(spec.dtype)
        out = torch.empty(spec.numel, dtype=torch.float32)
        saved.read(param, "master", out, 0)
        return out.view(spec.shape)

    made = first_missing(folder)
    try:
        with writing("to_fp32", folder):
            paths = write_files(folder, filename, plans, fill, fmt)
    except BaseException:
        remove_made(made)
        raise
    finally:
        saved.close()
    return paths[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero.to_fp32", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    parser.add_argument("--format", choices=FORMATS, default=None, help="default: from OUT's suffix")
    parser.add_argument("--overwrite", action="store_true", help="write over an OUT that is not empty")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="split into Hugging Face's shards of at most SIZE ('2GB', '500MiB', bytes) and an "
                             "index, in the folder OUT (default format then: safetensors)")
    args = parser.parse_args(argv)
    try:
        print(convert(args.checkpoint_dir, args.output, tag=args.tag, fmt=args.format, overwrite=args.overwrite,
                      max_shard_size=args.max_shard_size))
    except ValueError as error:  # the caller's paths or checkpoint: the message says it all
        sys.exit(f"{parser.prog}: error: {error}")


if __name__ == "__main__":
    main()
