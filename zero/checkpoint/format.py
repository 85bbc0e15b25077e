"""The files of a zero checkpoint directory and how they are read: as plain
data only, each checked against what was written at save, every failure a
ValueError naming the file (and the tensor or parameter).

    zero_shards_rank{r}_of{W}.safetensors   per rank: named shards, a crc32 per tensor in the header
    engine_state.pt                          rank 0: plain data (numbers, strings, lists, dicts, tensors)
    model_states.pt                          rank 0: the module's state_dict in the training dtype
    manifest.json                            rank 0, written last: every file's size; crc32 of the two
                                             .pt files and of each shard file's header

[Note: no code runs from a checkpoint]
Nothing is unpickled beyond plain data: the .pt files are read with
torch.load(weights_only=True), whose unpickler admits tensors, storages,
dtypes and Python's primitive containers and refuses every other global
(a planted __reduce__ is refused, not run); the shard files and the manifest
are JSON and raw bytes. A checkpoint from an untrusted source can therefore
hold wrong numbers (caught by the checks when they were damaged after the
save, not when they were written so), never code.
"""
from __future__ import annotations

import json
import os
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .tensorfile import CHUNK_NBYTES, SafetensorsReader, crc32

FORMAT = "zero-named-shards/2"
ENGINE_STATE = "engine_state.pt"
MODEL_STATES = "model_states.pt"
MANIFEST = "manifest.json"
ENGINE_STATE_KEYS = frozenset({"format", "world_size", "stage", "dtype", "layout", "params", "state_dict",
                               "param_groups", "scaler", "scheduler", "counters", "client_state"})


def shard_file(directory: str, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"zero_shards_rank{rank}_of{world_size}.safetensors")


@dataclass(frozen=True, slots=True)
class Deferred:
    """A shard's tensor that is read only when it is written: a state swapped
    to NVMe, so that a save holds one sub-group of them at a time."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


@dataclass(slots=True)
class NamedShard:
    """Elements [offset, offset + numel) of parameter `name` (flattened) and,
    under "master" and each optimizer state's key, their tensors: 1-D of numel
    elements, or scalars (Adam's step). `group`: the optimizer's param group."""

    name: str
    offset: int
    numel: int
    group: int | None
    tensors: dict[str, torch.Tensor | Deferred] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.name}:{self.offset}"


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


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_NBYTES):
            crc = crc32(chunk, crc)
    return crc


def manifest_entry(path: str, *, crc: bool | int = False, header_crc: int | None = None) -> dict:
    """A file's manifest entry: its size and, with crc, its crc32 (True: read
    from the file; an int: known) or its header's (a safetensors file's)."""
    entry: dict[str, object] = {"nbytes": os.path.getsize(path)}
    if crc is not False:
        entry["crc32"] = f"{file_crc32(path) if crc is True else crc:08x}"
    if header_crc is not None:
        entry["header_crc32"] = f"{header_crc:08x}"
    return entry


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: {directory} is not a complete {FORMAT} checkpoint (an older "
                         f"zero's checkpoint, or not one of zero's)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: corrupt ({len(raw)} bytes): {error!r}") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, this zero reads {FORMAT!r}")
    return manifest


def check_file(directory: str, manifest: dict, name: str, *, crc: bool) -> str:
    """The path of `name`, whose size (and with crc, whose crc32) is the one written at save."""
    path = os.path.join(directory, name)
    entry = manifest["files"].get(name)
    if not isinstance(entry, dict):
        raise ValueError(f"{os.path.join(directory, MANIFEST)} does not list {name}")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing (listed in {MANIFEST})")
    nbytes = os.path.getsize(path)
    if nbytes != entry.get("nbytes"):
        raise ValueError(f"{path}: {nbytes} bytes, {entry.get('nbytes')} written at save: truncated or replaced")
    if crc and file_crc32(path) != int(str(entry.get("crc32")), 16):
        raise ValueError(f"{path}: crc32 {file_crc32(path):08x}, {entry.get('crc32')} written at save: "
                         f"the file is corrupt")
    return path


def load_plain(path: str, *, mmap: bool = False) -> object:
    """torch.load with weights_only=True ([Note: no code runs from a checkpoint])."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise ValueError(f"{path}: refused: it holds more than plain data (the weights_only unpickler admits "
                         f"tensors, numbers, strings, lists and dicts); nothing in it was run: {error}") from None
    except Exception as error:  # a damaged zip or pickle: the kinds torch raises are many
        raise ValueError(f"{path}: unreadable: {type(error).__name__}: {error}") from None


def read_engine_state(directory: str, manifest: dict) -> dict:
    path = check_file(directory, manifest, ENGINE_STATE, crc=True)
    state = load_plain(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT or not ENGINE_STATE_KEYS <= set(state):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path}: not a {FORMAT} engine state (keys {keys})")
    return state


class SavedShards:
    """Every rank file of a checkpoint directory, indexed by parameter name.
    Each file's size and header are checked against the manifest when opened,
    and each tensor's crc32 before its first read."""

    def __init__(self, directory: str, world_size: int, manifest: dict) -> None:
        self.readers: list[SafetensorsReader] = []
        self.by_name: dict[str, list[tuple[SafetensorsReader, NamedShard]]] = {}
        self.kinds: dict[tuple[int, str], set[str]] = {}  # (reader, shard key) -> "master" and the state keys
        self.verified: set[tuple[int, str]] = set()
        self.rank_of: dict[int, int] = {}  # id(reader) -> the rank that wrote it
        try:
            for r in range(world_size):
                self.readers.append(self._open(directory, manifest, r, world_size))
                self.rank_of[id(self.readers[-1])] = r
        except BaseException:
            self.close()
            raise

    def _open(self, directory: str, manifest: dict, r: int, world_size: int) -> SafetensorsReader:
        name = os.path.basename(shard_file(directory, r, world_size))
        reader = SafetensorsReader(check_file(directory, manifest, name, crc=False))
        try:
            expected = int(str(manifest["files"][name].get("header_crc32")), 16)
            if zlib.crc32(reader.header_bytes) != expected:
                raise ValueError(f"{reader.path}: header crc32 {zlib.crc32(reader.header_bytes):08x}, {expected:08x} "
                                 f"written at save: corrupt header")
            if reader.metadata.get("format") != FORMAT:
                raise ValueError(f"{reader.path}: format {reader.metadata.get('format')!r}, not {FORMAT!r}")
            for pname, offset, numel, group in json.loads(reader.metadata["shards"]):
                self.by_name.setdefault(pname, []).append((reader, NamedShard(pname, offset, numel, group)))
            for spec in reader.specs:
                key, kind = spec.rsplit(":", 1)
                self.kinds.setdefault((r, key), set()).add(kind)
        except BaseException:
            reader.close()
            raise
        return reader

    def overlaps(self, name: str, begin: int, end: int):
        """(reader, saved shard, first element, last element + 1) of each saved
        range of `name` overlapping [begin, end), in parameter coordinates."""
        for reader, shard in self.by_name.get(name, ()):
            lo, hi = max(begin, shard.offset), min(end, shard.offset + shard.numel)
            if lo < hi:
                yield reader, shard, lo, hi

    def tensor(self, reader: SafetensorsReader, shard: NamedShard, kind: str) -> str:
        """The name of `shard`'s `kind` tensor in `reader`, its checksum verified."""
        name = f"{shard.key}:{kind}"
        if name not in reader.specs:
            raise ValueError(f"{reader.path}: no tensor {name} (parameter {shard.name}, listed in the index)")
        if (id(reader), name) not in self.verified:
            reader.verify(name)
            self.verified.add((id(reader), name))
        return name

    def read(self, name: str, kind: str, out: torch.Tensor, begin: int) -> set[str]:
        """Fills `out` (elements [begin, begin + out.numel()) of `name`'s `kind`
        tensor) from the saved ranges; returns which kinds the ranges hold."""
        kinds = set()
        for reader, tensor, shard, lo, hi in self._ranges(name, kind, begin, out.numel()):
            reader.read(tensor, out[lo - begin:hi - begin], lo - shard.offset)
            kinds |= self.kinds_of(reader, shard)
        return kinds

    def check(self, name: str, kind: str, begin: int, numel: int) -> set[str]:
        """As read, reading nothing but checksums: what a later read needs is there and intact."""
        return set().union(*(self.kinds_of(reader, shard) for reader, _, shard, _, _ in
                             self._ranges(name, kind, begin, numel)))

    def _ranges(self, name: str, kind: str, begin: int, numel: int):
        """(reader, tensor name, saved shard, first, last + 1) of each saved range of
        elements [begin, begin + numel) of `name`'s `kind`, each tensor's crc32
        verified; a ValueError unless they cover it exactly."""
        covered = 0
        for reader, shard, lo, hi in self.overlaps(name, begin, begin + numel):
            tensor = self.tensor(reader, shard, kind)
            if reader.specs[tensor].shape != (shard.numel,):
                raise ValueError(f"{reader.path}: {tensor} has shape {reader.specs[tensor].shape}, the index says "
                                 f"({shard.numel},)")
            yield reader, tensor, shard, lo, hi
            covered += hi - lo
        if covered != numel:
            raise ValueError(f"load_checkpoint: the saved shards cover {covered} of elements [{begin}, "
                             f"{begin + numel}) of {name}")

    def elementwise(self, name: str, offset: int, numel: int, kind: str) -> torch.dtype | None:
        """The dtype of optimizer state `kind` of `name` when it is elementwise
        (None: a scalar, as Adam's step)."""
        reader, first, _, _ = next(self.overlaps(name, offset, offset + numel))
        spec = reader.specs[self.tensor(reader, first, kind)]
        return spec.dtype if spec.shape == (first.numel,) else None

    def kinds_of(self, reader: SafetensorsReader, shard: NamedShard) -> set[str]:
        """What a saved shard holds: "master" and its optimizer states' keys."""
        return self.kinds[(self.rank_of[id(reader)], shard.key)]

    def state(self, name: str, offset: int, numel: int, kind: str) -> torch.Tensor:
        """One optimizer state of elements [offset, offset + numel) of `name`:
        an elementwise state read over the saved ranges; a scalar (Adam's step,
        equal on all) from the first."""
        reader, first, _, _ = next(self.overlaps(name, offset, offset + numel))
        tensor = self.tensor(reader, first, kind)
        spec = reader.specs[tensor]
        if spec.shape == (first.numel,):
            out = torch.empty(numel, dtype=spec.dtype)
            self.read(name, kind, out, offset)
            return out
        if spec.numel != 1:
            raise ValueError(f"{reader.path}: {tensor} has shape {spec.shape}: neither elementwise ({first.numel},) "
                             f"nor a scalar")
        return reader.read(tensor, torch.empty(spec.shape, dtype=spec.dtype))

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
