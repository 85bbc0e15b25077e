"""Saving checkpoints. save_dir/TAG/ holds, per rank, the named shards it
updates (element ranges of each parameter: fp32 master and optimizer states)
and, from rank 0, the engine state, the module's state_dict and a manifest
(the files: format.py). save_dir/latest names the last complete tag.
Named shards load on any world size and stage (load.py).

[Note: atomic save]
    every rank   write save_dir/.TAG.partial/zero_shards_rank{r}_of{W}, fsync   "written"
    agree        (barrier.py: each has a deadline, names the ranks missing and carries their errors)
    rank 0       engine_state.pt, model_states.pt, manifest.json, fsync           "committing"
                 TAG exists: rename TAG -> .TAG.previous                          "renamed_old"
                 rename .TAG.partial -> TAG, fsync save_dir, remove .previous     "before_latest"
                 write latest.tmp, fsync, rename -> latest
    agree        (other ranks wait here: "waiting")
A kill at any point leaves the old TAG, or the new complete TAG, or (between
the two renames) .TAG.previous alone, which load() and the next save() take
back as TAG. `latest` never names an incomplete directory. A write that fails
(full disk, read-only folder) is an error naming its path on every rank (the
agreement carries it), and the .partial directory is removed; a save also
removes the .partial directories that killed saves left behind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import shutil
import zlib
from collections.abc import Callable, Iterator

import torch

from .barrier import failure, store_agree
from .deepspeed_optim import built_by
from .format import (ENGINE_STATE, FORMAT, MANIFEST, MODEL_STATES, Deferred, NamedShard, SavedShards,
                     manifest_entry, shard_file)
from .model_files import ModelLayout, module_layout, plan_files, write_files
from .parts import CheckpointOptions, CheckpointParts
from .tensorfile import SafetensorsReader, TensorSpec, fsync_dir, write_safetensors, write_torch

log = logging.getLogger("zero")


@contextlib.contextmanager
def named_shards(parts: CheckpointParts) -> Iterator[list[NamedShard]]:
    """The named shards this rank saves, readable inside: its fp32 master slices
    and their optimizer states (views, or Deferred reads of swapped ones).
    Unsharded masters (stage 0) are saved by rank 0 only."""
    if parts.stage == 0 and parts.rank != 0:
        yield []
        return
    with parts.shards.saved_shards() as shards:
        yield shards


def shard_specs(shards: list[NamedShard]) -> tuple[list[TensorSpec], Callable[[TensorSpec], torch.Tensor], dict]:
    """A shard file's tensors: their specs, the fill that hands each over (a
    Deferred tensor is read as its turn comes) and the file's metadata (the index)."""
    specs, tensors = [], {}
    for shard in shards:
        for kind, tensor in shard.tensors.items():
            spec = TensorSpec(f"{shard.key}:{kind}", tuple(tensor.shape), tensor.dtype)
            specs.append(spec)
            tensors[spec.name] = tensor

    def fill(spec: TensorSpec) -> torch.Tensor:
        tensor = tensors[spec.name]
        return tensor.read() if isinstance(tensor, Deferred) else tensor
    index = [[s.name, s.offset, s.numel, s.group] for s in shards]
    return specs, fill, {"format": FORMAT, "shards": json.dumps(index)}


def write_shards(path: str, shards: list[NamedShard]) -> None:
    """One safetensors file, a crc32 per tensor."""
    specs, fill, metadata = shard_specs(shards)
    write_safetensors(path, specs, fill, metadata, checksums=True)


# ---- save -------------------------------------------------------------------------------------
def engine_state(parts: CheckpointParts, client_state: dict | None) -> dict:
    """engine_state.pt: the facts of the run and the state_dict of each stateful part but the shards."""
    scheduler = parts.scheduler
    return {
        "format": FORMAT, "world_size": parts.world_size, "stage": parts.stage,
        "dtype": str(parts.dtype).removeprefix("torch."),
        "params": parts.param_shapes(), "state_dict": state_dict_keys(parts),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups],
        "layout": dict(parts.layout), "scaler": parts.scaler.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
        "counters": parts.progress.state_dict(),
        "client_state": client_state or {},
        "deepspeed": deepspeed_facts(parts),
    }


def deepspeed_facts(parts: CheckpointParts) -> dict:
    """What DeepSpeed's layout needs beyond zero's own (to_deepspeed.py): the
    persistent buffers' names, the clipping, the stage-3 sub-group size, the
    fp16 scaler's options (DeepSpeed's files hold the scaler whole), and the
    optimizer DeepSpeed builds from this config, whose layout it saves
    (deepspeed_optim.py), and its adamw_mode."""
    config = parts.config
    return {"buffers": buffer_names(parts.module), "clip_grad": float(config.gradient_clipping),
            "sub_group_size": int(config.zero.sub_group_size), "scaler_options": dataclasses.asdict(config.scaler),
            "optimizer": deepspeed_optimizer(parts),
            "adamw": isinstance(parts.optimizer, torch.optim.AdamW)
            or any(g.get("decoupled_weight_decay", False) for g in parts.optimizer.param_groups)}


def deepspeed_optimizer(parts: CheckpointParts) -> str:
    """DeepSpeed's optimizer for this engine's config ("FusedAdam", ...), or the client's class."""
    config, cls = parts.config, type(parts.optimizer)
    offload = {"offload_optimizer": {"device": config.zero.offload_optimizer_options.device}}
    built = built_by({"optimizer": config.optimizer, "zero_optimization": offload})
    if built is not None:
        return built
    if cls.__module__.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def buffer_names(module: torch.nn.Module) -> list[str]:
    """The module's persistent buffers, by state_dict key."""
    return [f"{prefix}{'.' if prefix else ''}{name}" for prefix, sub in module.named_modules()
            for name, buf in sub.named_buffers(recurse=False)
            if buf is not None and name not in sub._non_persistent_buffers_set]


def state_dict_keys(parts: CheckpointParts) -> list[tuple[str, str | None]]:
    """The module's state_dict keys in order, each with the trainable
    parameter it holds (tied names name the same one) or None (buffers, frozen)."""
    name_of = {id(p): name for p, name in zip(parts.trainable, parts.param_names)}
    params = dict(parts.module.named_parameters(remove_duplicate=False))
    return [(key, name_of.get(id(params.get(key)))) for key in parts.module.state_dict(keep_vars=True)]


def layout(parts: CheckpointParts) -> tuple[ModelLayout, dict[str, int | None]]:
    """The module's state_dict (every key: tied names, buffers, frozen
    parameters) as written, the trainable parameters whole in the training dtype."""
    shapes = parts.param_shapes()
    return module_layout(parts.module, parts.trainable, [shapes[name] for name in parts.param_names], parts.dtype)


def module_tensors(parts: CheckpointParts) -> Callable[[str], torch.Tensor]:
    """name -> a buffer or frozen parameter of the module, as its state_dict holds it."""
    tensors = parts.module.state_dict(keep_vars=True)
    return lambda name: tensors[name].detach()


@contextlib.contextmanager
def writing(what: str, path: str) -> Iterator[None]:
    """An OSError inside (full disk, read-only folder, ...) names `path`: the OS names none for a write."""
    try:
        yield
    except OSError as error:
        raise OSError(error.errno, f"{what}: writing {path}: {error.strerror or error}", path) from error


def attempt(fn: Callable[[], None]) -> tuple[str | None, BaseException | None]:
    """Runs fn; returns (None, None), or its error as a message and itself (for the agreement)."""
    try:
        fn()
    except Exception as error:
        return f"{type(error).__name__}: {error}", error
    return None, None


def agree(what: str, rank: int, failed: tuple[str | None, BaseException | None], *, partial: str | None,
          timeout_s: float) -> None:
    """Every rank learns whether every rank succeeded; if any failed, every rank
    raises the same error naming the ranks and their errors (rank 0 first
    removes the .partial directory): a ValueError when every failure was one
    (the caller's data), else a RuntimeError."""
    message, error = failed
    failures = store_agree(what, timeout_s, message)
    if failures:
        if rank == 0 and partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        raise failure(what, failures) from error


def plain_bytes(state: dict, *, check: bool = True) -> bytes:
    """engine_state.pt's bytes, refused when they would not load as plain data
    (check=False: the caller checks them later, with check_plain)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    if check:
        check_plain(buffer.getvalue(), "save_checkpoint")
    return buffer.getvalue()


def check_plain(data: bytes, what: str) -> None:
    """A ValueError unless `data` (torch.save's) loads as plain data, as a resume loads it."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:
        raise ValueError(f"{what}: the engine state (client_state included) must be plain data "
                         f"(tensors, numbers, strings, lists, dicts) to load with weights_only=True: {error}") from None


def write_file(path: str, data: bytes) -> None:
    with writing("save_checkpoint", path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def prepare(save_dir: str, tag: str, partial: str) -> None:
    """Rank 0: takes back a killed save's .TAG.previous, removes stale .partial directories, makes `partial`."""
    with writing("save_checkpoint", save_dir):
        os.makedirs(save_dir, exist_ok=True)
        recover(save_dir, tag)
        for name in os.listdir(save_dir):
            if name.startswith(".") and name.endswith(".partial"):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        os.makedirs(partial)


def write_rank0_files(parts: CheckpointParts, state_bytes: bytes, partial: str) -> None:
    """engine_state.pt, model_states.pt, then the manifest of every file."""
    write_file(os.path.join(partial, ENGINE_STATE), state_bytes)
    files = {}
    for r in range(parts.world_size):
        path = shard_file(partial, r, parts.world_size)
        with SafetensorsReader(path) as reader:
            header_crc = zlib.crc32(reader.header_bytes)
        files[os.path.basename(path)] = manifest_entry(path, header_crc=header_crc)
    path = os.path.join(partial, MODEL_STATES)
    with writing("save_checkpoint", path):
        write_model_states(parts, partial, {"files": files}, path)
    files.update({name: manifest_entry(os.path.join(partial, name), crc=True) for name in (ENGINE_STATE, MODEL_STATES)})
    manifest = {"format": FORMAT, "files": files}
    write_file(os.path.join(partial, MANIFEST), json.dumps(manifest, indent=1).encode())
    with writing("save_checkpoint", partial):
        fsync_dir(partial)


def write_model_states(parts: CheckpointParts, partial: str, manifest: dict, path: str) -> None:
    """model_states.pt: the whole module's state_dict in the training dtype,
    written one tensor at a time with the trainable parameters read back from
    the shard files every rank just wrote: no rank gathers the model."""
    model, sources = layout(parts)
    module_tensor = module_tensors(parts)
    saved = SavedShards(partial, parts.world_size, manifest)

    def fill(spec: TensorSpec) -> torch.Tensor:
        if sources[spec.name] is None:
            return module_tensor(spec.name)
        out = torch.empty(spec.numel, dtype=torch.float32)
        saved.read(parts.param_names[sources[spec.name]], "master", out, 0)
        return out.view(spec.shape).to(spec.dtype)
    try:
        write_torch(path, model.specs, fill, model.aliases)
    finally:
        saved.close()


def save(parts: CheckpointParts, save_dir: str, tag: str | None = None, client_state: dict | None = None, *,
         save_latest: bool = True, options: CheckpointOptions = CheckpointOptions()) -> str:
    """Collective: writes save_dir/tag atomically ([Note: atomic save]); returns its path.
    save_latest=False leaves `latest` as it was, as DeepSpeed's."""
    tag = str(tag) if tag is not None else f"global_step{parts.progress.state_dict()['global_steps']}"
    if not tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain, non-hidden directory name")
    counters = parts.progress.state_dict()
    rank, world_size, timeout_s = parts.rank, parts.world_size, options.timeout_s
    directory, partial = os.path.join(save_dir, tag), os.path.join(save_dir, f".{tag}.partial")
    what = f"save_checkpoint {directory}"
    state_bytes = b""
    if rank == 0:
        within = counters["micro_steps"] % parts.accumulation_steps
        if within:
            log.warning(f"zero: {what}: saved {within} micro-steps into an accumulation of "
                        f"{parts.accumulation_steps}: their gradients are not saved, a resume starts "
                        f"at the boundary after global step {counters['global_steps']}")

        def start() -> None:
            nonlocal state_bytes
            state_bytes = plain_bytes(engine_state(parts, client_state))
            prepare(save_dir, tag, partial)
    agree(f"{what}: {partial} made", rank, attempt(start) if rank == 0 else (None, None), partial=None,
          timeout_s=timeout_s)
    path = shard_file(partial, rank, world_size)

    def write() -> None:
        with named_shards(parts) as shards, writing("save_checkpoint", path):
            write_shards(path, shards)
    failed = attempt(write)
    options.phase("written", rank)
    agree(f"{what}: every rank's shards written", rank, failed, partial=partial, timeout_s=timeout_s)
    failed = (None, None)
    if rank == 0:
        def finish() -> None:
            write_rank0_files(parts, state_bytes, partial)
            options.phase("committing", rank)
            with writing("save_checkpoint", directory):
                commit(save_dir, tag, partial, directory, save_latest=save_latest, options=options)
        failed = attempt(finish)
    else:
        options.phase("waiting", rank)
    agree(f"{what}: rank 0 committed", rank, failed, partial=partial, timeout_s=timeout_s)
    return directory


def commit(save_dir: str, tag: str, partial: str, directory: str, *, save_latest: bool,
           options: CheckpointOptions) -> None:
    previous = os.path.join(save_dir, f".{tag}.previous")
    if os.path.exists(directory):
        os.rename(directory, previous)
        options.phase("renamed_old", 0)
    os.rename(partial, directory)
    fsync_dir(save_dir)
    shutil.rmtree(previous, ignore_errors=True)
    options.phase("before_latest", 0)
    if not save_latest:
        return
    latest = os.path.join(save_dir, "latest")
    with open(latest + ".tmp", "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest + ".tmp", latest)
    fsync_dir(save_dir)


def recover(save_dir: str, tag: str) -> None:
    """Takes back .TAG.previous as TAG when a save was killed between its renames."""
    previous, directory = os.path.join(save_dir, f".{tag}.previous"), os.path.join(save_dir, tag)
    if os.path.isdir(previous):
        if os.path.isdir(directory):
            shutil.rmtree(previous)
        else:
            os.rename(previous, directory)
            fsync_dir(save_dir)


def save_16bit_model(parts: CheckpointParts, save_dir: str, save_filename: str = "pytorch_model.bin", *,
                     exclude_frozen_parameters: bool = False, max_shard_size: int | str | None = None,
                     timeout_s: float = 600.0) -> bool:
    """Collective: rank 0 writes the whole module's state_dict in the training
    dtype, as DeepSpeed's save_16bit_model, one tensor at a time: every rank
    takes part in gathering one bucket at a time (ParamGroup.whole_masters), so
    no rank holds the model. A `save_filename` ending in .safetensors writes
    safetensors; `max_shard_size` splits the model into Hugging Face's shards and
    index ([Note: sharded model files]); exclude_frozen_parameters leaves out
    the parameters that do not require grad. A failed write is the same error
    on every rank."""
    fmt = "safetensors" if save_filename.endswith(".safetensors") else "torch"
    if os.sep in save_filename or not save_filename:
        raise ValueError(f"save_16bit_model: save_filename {save_filename!r} must be a file name")
    model, sources = layout(parts)
    if exclude_frozen_parameters:
        frozen = {name for name, p in parts.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        model = ModelLayout([spec for spec in model.specs if spec.name not in frozen], model.aliases)
    plans = plan_files(model, save_filename, fmt, max_shard_size)
    module_tensor = module_tensors(parts)
    asked = 0
    with parts.whole_masters() as read:
        def fill(spec: TensorSpec) -> torch.Tensor:
            nonlocal asked
            asked += 1
            index = sources[model.aliases.get(spec.name, spec.name)]  # a safetensors copy of a tied name too
            return module_tensor(spec.name) if index is None else read(index).to(spec.dtype)

        failed: tuple[str | None, BaseException | None] = (None, None)
        if parts.rank == 0:
            failed = attempt(lambda: write_files(save_dir, save_filename, plans, fill, fmt))
        order = [spec for plan in plans for spec in plan.specs]
        for spec in order[asked:]:  # every rank gathers what rank 0 asked for (all of it, also after a failure)
            fill(spec)
    agree(f"save_16bit_model {os.path.join(save_dir, save_filename)}", parts.rank, failed, partial=None,
          timeout_s=timeout_s)
    return True
