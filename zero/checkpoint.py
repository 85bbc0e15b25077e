"""Checkpoints. save_dir/TAG/ holds, per rank, the named shards it updates
(element ranges of each parameter: fp32 master and optimizer states) in
zero_shards_rank{r}_of{W}.safetensors; from rank 0 engine_state.pt
(counters, scaler, scheduler, optimizer hyperparameters, client_state) and
model_states.pt (the module's whole state_dict in the training dtype).
save_dir/latest names the last complete tag. Named shards load on any world
size and stage: each rank reads the overlap of the saved ranges with its own.

[Note: atomic save]
    every rank   write save_dir/.TAG.partial/zero_shards_rank{r}_of{W}, fsync   "written"
    barrier      (zero/barrier.py: each has a deadline and names the ranks missing)
    rank 0       engine_state.pt, model_states.pt, fsync                          "committing"
                 TAG exists: rename TAG -> .TAG.previous                          "renamed_old"
                 rename .TAG.partial -> TAG, fsync save_dir, remove .previous     "before_latest"
                 write latest.tmp, fsync, rename -> latest
    barrier      (other ranks wait here: "waiting")
A kill at any point leaves the old TAG, or the new complete TAG, or (between
the two renames) .TAG.previous alone, which load() and the next save() take
back as TAG. `latest` never names an incomplete directory.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
import torch

from .barrier import store_barrier
from .tensorfile import SafetensorsReader, TensorSpec, fsync_dir, write_safetensors

FORMAT = "zero-named-shards/1"
ENGINE_STATE = "engine_state.pt"
MODEL_STATES = "model_states.pt"
BARRIER_TIMEOUT_S = 600.0  # the longest a rank waits for the others to finish writing
phase_hook: Callable[[str, int], None] = lambda phase, rank: None  # tests kill a rank at a phase of save()


def shard_file(directory: str, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"zero_shards_rank{rank}_of{world_size}.safetensors")


# ---- what a rank holds: the seam where states may live elsewhere (offload) ----------------------
@dataclass(slots=True)
class NamedShard:
    """Elements [offset, offset + numel) of parameter `name` (flattened) and,
    under "master" and each optimizer state's key, their tensors: 1-D of numel
    elements, or scalars (Adam's step). `group`: the optimizer's param group."""

    name: str
    offset: int
    numel: int
    group: int | None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.name}:{self.offset}"


def master_slices(engine) -> list[tuple[NamedShard, torch.Tensor]]:
    """Every fp32 master slice this rank updates (the optimizer's parameters),
    named; the shard's tensors are left empty."""
    group, names = engine.parts.group, engine.parts.param_names
    group_of = {id(p): g for g, pg in enumerate(engine.optimizer.param_groups) for p in pg["params"]}
    out = []
    for bucket in group.buckets:
        slices = bucket.layout.local_slices(bucket.span.index, bucket.owned)
        for (view, _, _), (index, _, local) in zip(bucket.master_views, slices, strict=True):
            out.append((NamedShard(names[index], local.begin, local.numel, group_of.get(id(view))), view))
    return out


def named_shards(engine) -> list[NamedShard]:
    """The named shards this rank saves: its fp32 master slices and their
    optimizer states (views, not copies). Unsharded masters (stage 0) are
    saved by rank 0 only."""
    if not engine.parts.group.policy.shard_optimizer and engine.parts.comm.rank != 0:
        return []
    shards = []
    for shard, view in master_slices(engine):
        shard.tensors["master"] = view.detach()
        for key, value in engine.optimizer.state.get(view, {}).items():
            if isinstance(value, torch.Tensor):
                shard.tensors[key] = value.detach()
        shards.append(shard)
    return shards


def write_shards(path: str, shards: list[NamedShard]) -> None:
    specs, tensors = [], {}
    for shard in shards:
        for kind, tensor in shard.tensors.items():
            spec = TensorSpec(f"{shard.key}:{kind}", tuple(tensor.shape), tensor.dtype)
            specs.append(spec)
            tensors[spec.name] = tensor
    index = [[s.name, s.offset, s.numel, s.group] for s in shards]
    write_safetensors(path, specs, lambda spec: tensors[spec.name], {"format": FORMAT, "shards": json.dumps(index)})


class SavedShards:
    """Every rank file of a checkpoint directory, indexed by parameter name."""

    def __init__(self, directory: str, world_size: int) -> None:
        self.readers = [SafetensorsReader(shard_file(directory, r, world_size)) for r in range(world_size)]
        self.by_name: dict[str, list[tuple[SafetensorsReader, NamedShard]]] = {}
        self.kinds: dict[tuple[int, str], set[str]] = {}  # (reader, shard key) -> "master" and the state keys
        for r, reader in enumerate(self.readers):
            if reader.metadata.get("format") != FORMAT:
                raise ValueError(f"load_checkpoint: {reader.path} is not a {FORMAT} file")
            for name, offset, numel, group in json.loads(reader.metadata["shards"]):
                self.by_name.setdefault(name, []).append((reader, NamedShard(name, offset, numel, group)))
            for spec in reader.specs:
                key, kind = spec.rsplit(":", 1)
                self.kinds.setdefault((r, key), set()).add(kind)

    def overlaps(self, name: str, begin: int, end: int):
        """(reader, saved shard, first element, last element + 1) of each saved
        range of `name` overlapping [begin, end), in parameter coordinates."""
        for reader, shard in self.by_name.get(name, ()):
            lo, hi = max(begin, shard.offset), min(end, shard.offset + shard.numel)
            if lo < hi:
                yield reader, shard, lo, hi

    def read(self, name: str, kind: str, out: torch.Tensor, begin: int) -> set[str]:
        """Fills `out` (elements [begin, begin + out.numel()) of `name`'s `kind`
        tensor) from the saved ranges; returns which kinds the ranges hold."""
        covered, kinds = 0, set()
        for reader, shard, lo, hi in self.overlaps(name, begin, begin + out.numel()):
            reader.read(f"{shard.key}:{kind}", out[lo - begin:hi - begin], lo - shard.offset)
            covered += hi - lo
            kinds |= self.kinds[(self.readers.index(reader), shard.key)]
        if covered != out.numel():
            raise ValueError(f"load_checkpoint: the saved shards cover {covered} of elements [{begin}, "
                             f"{begin + out.numel()}) of {name}")
        return kinds

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def restore_named_shards(engine, saved: SavedShards, *, optimizer_states: bool) -> None:
    """Reads every master slice this rank updates (and its optimizer states)
    from the saved shards, whatever world size and stage wrote them."""
    states = {}
    with torch.no_grad():
        for shard, view in master_slices(engine):
            if shard.name not in saved.by_name:  # not saved, and load_module_strict is off
                continue
            kinds = saved.read(shard.name, "master", view, shard.offset)
            if optimizer_states and shard.group is not None:
                states[view] = {kind: saved_state(saved, shard, kind) for kind in sorted(kinds - {"master"})}
    if optimizer_states:
        load_optimizer_state(engine.optimizer, states)


def saved_state(saved: SavedShards, shard: NamedShard, kind: str) -> torch.Tensor:
    """One optimizer state of `shard`: an elementwise state is read over the
    saved ranges; a scalar (Adam's step, equal on all) from the first."""
    reader, first, _, _ = next(saved.overlaps(shard.name, shard.offset, shard.offset + shard.numel))
    spec = reader.specs[f"{first.key}:{kind}"]
    if spec.shape == (first.numel,):
        out = torch.empty(shard.numel, dtype=spec.dtype)
        saved.read(shard.name, kind, out, shard.offset)
        return out
    return reader.read(spec.name, torch.empty(spec.shape, dtype=spec.dtype))


def load_optimizer_state(optimizer: torch.optim.Optimizer, states: dict[torch.Tensor, dict]) -> None:
    """Hands per-parameter states to the optimizer through its own
    load_state_dict (which moves them to each parameter's device)."""
    state_dict = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state_dict["state"] = {i: states[p] for i, p in enumerate(params) if states.get(p)}
    optimizer.load_state_dict(state_dict)


# ---- save -------------------------------------------------------------------------------------
def engine_state(engine, client_state: dict | None) -> dict:
    scheduler, comm = engine.lr_scheduler, engine.parts.comm
    return {
        "format": FORMAT, "world_size": comm.world_size, "stage": engine.parts.group.policy.stage,
        "dtype": str(engine.parts.dtype).removeprefix("torch."),
        "params": param_shapes(engine), "state_dict": state_dict_keys(engine),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
        "scaler": engine.parts.scaler.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
        "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                     "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps},
        "client_state": client_state or {},
    }


def param_shapes(engine) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's shape, by name (stage 3 parameters are empty between uses)."""
    names = engine.parts.param_names
    return {names[i]: tuple(shape) for b in engine.parts.group.buckets for i, shape in zip(b.indices, b.shapes)}


def state_dict_keys(engine) -> list[tuple[str, str | None]]:
    """The module's state_dict keys in order, each with the trainable
    parameter it holds (tied names name the same one) or None (buffers, frozen)."""
    name_of = {id(p): name for p, name in zip(engine.parts.trainable, engine.parts.param_names)}
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    return [(key, name_of.get(id(params.get(key)))) for key in engine.module.state_dict(keep_vars=True)]


def module_state_dict(engine, full: list[torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The module's state_dict (every key: tied names, buffers, frozen
    parameters) with the trainable parameters taken from `full`, in `dtype`."""
    index = {id(p): i for i, p in enumerate(engine.parts.trainable)}
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    state, made = {}, {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        param = params.get(name)
        if param is not None and id(param) in index:
            i = index[id(param)]
            made.setdefault(i, full[i].to(dtype))  # tied names share one tensor, as in state_dict()
            state[name] = made[i]
        else:
            state[name] = tensor.detach().clone()
    return state


def _save_torch(obj: object, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None, *,
         save_latest: bool = True) -> str:
    """Collective: writes save_dir/tag atomically ([Note: atomic save]); returns its path.
    save_latest=False leaves `latest` as it was, as DeepSpeed's."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain, non-hidden directory name")
    rank, world_size = engine.parts.comm.rank, engine.parts.comm.world_size
    directory, partial = os.path.join(save_dir, tag), os.path.join(save_dir, f".{tag}.partial")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        recover(save_dir, tag)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    store_barrier(f"save_checkpoint {directory}: {partial} made", BARRIER_TIMEOUT_S)
    full = engine.full_params_fp32()  # collective: before any rank may stop at a barrier
    with engine.parts.group.offloaded_states():  # offloaded masters and states as ordinary tensors while written
        write_shards(shard_file(partial, rank, world_size), named_shards(engine))
    phase_hook("written", rank)
    store_barrier(f"save_checkpoint {directory}: every rank's shards written", BARRIER_TIMEOUT_S)
    if rank == 0:
        _save_torch(engine_state(engine, client_state), os.path.join(partial, ENGINE_STATE))
        _save_torch(module_state_dict(engine, full, engine.parts.dtype), os.path.join(partial, MODEL_STATES))
        fsync_dir(partial)
        phase_hook("committing", rank)
        commit(save_dir, tag, partial, directory, save_latest=save_latest)
    else:
        phase_hook("waiting", rank)
    store_barrier(f"save_checkpoint {directory}: rank 0 committed", BARRIER_TIMEOUT_S)
    return directory


def commit(save_dir: str, tag: str, partial: str, directory: str, *, save_latest: bool) -> None:
    previous = os.path.join(save_dir, f".{tag}.previous")
    if os.path.exists(directory):
        os.rename(directory, previous)
        phase_hook("renamed_old", 0)
    os.rename(partial, directory)
    fsync_dir(save_dir)
    shutil.rmtree(previous, ignore_errors=True)
    phase_hook("before_latest", 0)
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


# ---- load -------------------------------------------------------------------------------------
def resolve(load_dir: str, tag: str | None) -> str:
    """The directory of `tag` (default: the one `latest` names)."""
    if tag is None:
        with open(os.path.join(load_dir, "latest")) as f:
            tag = f.read().strip()
    directory = os.path.join(load_dir, str(tag))
    if not os.path.isdir(directory):
        previous = os.path.join(load_dir, f".{tag}.previous")  # a save of this tag was killed between renames
        if os.path.isdir(previous):
            return previous
        raise ValueError(f"load_checkpoint: no checkpoint directory {directory}")
    return directory


def load(engine, load_dir: str, tag: str | None = None, *, load_module_strict: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False) -> tuple[str, dict]:
    """Restores a checkpoint saved on any world size and stage (a collective
    only in that every rank reads); returns (path, client_state) like DeepSpeed.
    DeepSpeed's keywords: load_optimizer_states=False leaves the optimizer (and
    the loss scale, which DeepSpeed keeps in it) as they are; load_module_only
    restores the parameters only. The fp32 masters always come from the
    checkpoint's (DeepSpeed rebuilds them from the 16-bit weights without the
    optimizer states); load_module_strict checks the parameter names."""
    directory = resolve(load_dir, tag)
    state = torch.load(os.path.join(directory, ENGINE_STATE), weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {directory} is not a {FORMAT} checkpoint")
    optimizer_states = load_optimizer_states and not load_module_only
    if optimizer_states and len(state["param_groups"]) != len(engine.optimizer.param_groups):
        raise ValueError(f"load_checkpoint: {directory} has {len(state['param_groups'])} optimizer param groups, "
                         f"this engine {len(engine.optimizer.param_groups)}")
    check_params(engine, directory, state["params"], strict=load_module_strict)
    saved = SavedShards(directory, state["world_size"])
    try:
        with engine.parts.group.offloaded_states():  # written back to where they are offloaded on exit
            restore_named_shards(engine, saved, optimizer_states=optimizer_states)
    finally:
        saved.close()
    restore_module_extras(engine, directory, strict=load_module_strict)
    if optimizer_states:
        for group, hyper in zip(engine.optimizer.param_groups, state["param_groups"]):
            group.update(hyper)
    if not load_module_only:
        restore_engine(engine, state, scaler=optimizer_states, scheduler=load_lr_scheduler_states)
    engine.parts.group.publish_masters()
    engine.parts.group.zero_grads()
    return directory, state["client_state"]


def check_params(engine, directory: str, saved: dict[str, tuple[int, ...]], *, strict: bool) -> None:
    """The saved trainable parameters match the engine's by shape, and (strict) by name."""
    shapes = param_shapes(engine)
    wrong = [(name, saved[name], shape) for name, shape in shapes.items() if name in saved and saved[name] != shape]
    if wrong:
        raise ValueError(f"load_checkpoint: {directory}: (name, saved shape, model shape) differ: {wrong[:8]}")
    missing, unexpected = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if strict and (missing or unexpected):
        raise ValueError(f"load_checkpoint: {directory} does not match the module (load_module_strict): "
                         f"missing {missing[:8]}, unexpected {unexpected[:8]}")


def restore_module_extras(engine, directory: str, *, strict: bool) -> None:
    """Buffers and frozen parameters (not in any bucket) from model_states.pt."""
    trainable = set(engine.parts.param_names)
    trainable_ids = {id(p) for p in engine.parts.trainable}
    tied = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if id(p) in trainable_ids}
    extras = {k: v for k, v in engine.module.state_dict().items() if k not in trainable and k not in tied}
    if not extras:
        return
    saved = torch.load(os.path.join(directory, MODEL_STATES), mmap=True, weights_only=True)
    missing = [k for k in extras if k not in saved]
    if missing and strict:
        raise ValueError(f"load_checkpoint: {MODEL_STATES} in {directory} lacks {missing[:8]} (load_module_strict)")
    with torch.no_grad():
        for key, tensor in extras.items():
            if key in saved:
                tensor.copy_(saved[key])


def restore_engine(engine, state: dict, *, scaler: bool, scheduler: bool) -> None:
    """Counters always; the loss scaler and the LR scheduler when asked."""
    if scaler:
        engine.parts.scaler.load_state_dict(state["scaler"])
    if scheduler and state["scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["scheduler"])
    for key, value in state["counters"].items():
        setattr(engine, key, value)


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
    """Collective: rank 0 writes the whole module's state_dict in the training
    dtype (stage 3 gathers the shards), as DeepSpeed's save_16bit_model."""
    full = engine.full_params_fp32()
    if engine.parts.comm.rank != 0:
        return True
    os.makedirs(save_dir, exist_ok=True)
    torch.save(module_state_dict(engine, full, engine.parts.dtype), os.path.join(save_dir, save_filename))
    return True
