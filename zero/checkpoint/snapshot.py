"""In-memory snapshots of a run's state, taken every few optimizer steps, kept
in shared memory and copied to a buddy rank, so that a run that loses a rank
or a host resumes from the last step instead of the last disk checkpoint.

[Note: in-memory snapshots]
A snapshot of step N is one piece per rank, in the host's snapshot folder
(/dev/shm: it outlives the process, not the host):

    step{N}/rank{r}_of{W}.by{h}/   rank r's piece (h == r) or its buddy h's copy; on one host rank r
                                   writes both, across hosts h receives its copy
        zero_shards_rank{r}_of{W}.safetensors   the rank's named shards (fp32 masters, optimizer
                                                states), a word sum per tensor ([Note: word sums]
                                                in csrc/cpu/checksum.h)
        engine_state.pt                         save.py's engine state (scheduler, scaler, counters,
                                                client state) and this rank's RNG states
        model_states.pt                         the rank's buffers and frozen parameters
        piece.json                              the files' sizes and checksums, written last
    progress/rank{r}                            the last step rank r finished (how many a resume lost)

[Note: the step writes the snapshot]
A snapshot's cost is the memory traffic of its copies: a copy of the 586 MB
a rank holds of a 100M-parameter model, the checksums of it and a buddy's copy
of it cost ~500 ms of CPU per step on a 2-core machine whose cores both
train (benchmarks/snapshots.py). So each byte is written once and read never:
before a step that is due (before_step), the rank opens its slots (its own
shard file and, on its host, its buddy's copy, through kept shared mappings)
and hands the fused Adam step their addresses; the step writes each updated
master and moment into both, while the values are in cache, and returns their
word sums ([Note: copies in the step] in csrc/cpu/kernels/adam.cpp). After the
step (take), the small states are pickled and what the step did not write (the
step counts; every tensor for another optimizer, for NVMe offload, or before the
moments exist) is copied into the own file. A thread then finishes the pieces
while the next step runs: the engine state's weights-only check (the step after
a failed one raises), the missing word sums and the copy's missing tensors, the
headers, the small files, piece.json; a buddy on another host receives the
piece (snapshot_wire.py), and each directory is renamed from .partial when
complete. Double-buffered: a rank keeps the last two steps, so a failure during
a snapshot leaves the one before complete on every rank (ranks are at most one
snapshot apart: a step's collectives wait for every rank; `expired` says which
older steps go). A new snapshot is written over the files of the one before the
last, in place: tmpfs then allocates, zeroes and frees no page per step.
Resuming from them: snapshot_restore.py. With NVMe offload the shards are read
from the swap files by the main thread (a copy, not a reference), before the
next step.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..optim.host_adam import KINDS, StepCopies
from .format import ENGINE_STATE, FORMAT, MODEL_STATES, NamedShard, manifest_entry, shard_file
from .parts import CheckpointParts
from .save import (check_plain, engine_state, module_tensors, named_shards, plain_bytes, shard_specs,
                   state_dict_keys)
from .snapshot_config import SnapshotOptions, default_path
from .snapshot_wire import Mappings, Placement, Wire, Worker, recv_piece, send_piece, wait_all
from .tensorfile import MappedSafetensors, TensorSpec

PIECE = "piece.json"
STEP = re.compile(r"step(\d+)$")
PIECE_DIR = re.compile(r"rank(\d+)_of(\d+)\.by(\d+)$")


def piece_dir(root: str, step: int, rank: int, world_size: int, holder: int) -> str:
    return os.path.join(root, f"step{step}", f"rank{rank}_of{world_size}.by{holder}")


def steps_in(root: str) -> list[int]:
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for m in map(STEP.match, names) if m)


def expired(steps: list[int], step: int) -> list[int]:
    """Of the snapshot folders' steps, those a snapshot of `step` no longer
    needs: all older than the newest one before it (double buffering)."""
    return [s for s in steps if s < step][:-1]


def rng_state() -> dict:
    """This process's random number generators, as plain data."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Snapshots:
    """This rank's side of the in-memory snapshots: taking them, and the
    folder and group that snapshot_restore.py resumes from."""

    def __init__(self, options: SnapshotOptions, rank: int, world_size: int, *, timeout_s: float = 600.0) -> None:
        self.options, self.rank, self.world_size = options, rank, world_size
        self.root = options.path or default_path()
        self.asynchronous = options.asynchronous
        self.timeout_s = timeout_s
        # its own group: the snapshot thread's sends never interleave with the training's collectives
        self.wire = Wire(self, rank, world_size, timeout_s)
        self.placement = Placement.gather(timeout_s)
        buddy = self.placement.buddy(rank) if options.replicas else None
        self.buddy, self.sources = buddy, (self.placement.sources(rank) if options.replicas else [])
        # own piece and its copy on this host, copies from sources on other hosts: 2 steps each, room to spare
        self.mappings = Mappings(capacity=4 + 4 * len(self.sources))
        self._slots: Slots | None = None  # opened before a step that is due
        self._worker = Worker(f"zero-snapshots-rank{rank}")
        self._error: BaseException | None = None
        self._step: int | None = None
        os.makedirs(os.path.join(self.root, "progress"), exist_ok=True)

    # ---- taking ---------------------------------------------------------------------------
    def before_step(self, step: int, parts: Callable[[], CheckpointParts]) -> StepCopies | None:
        """Before optimizer step `step`: when it is due for a snapshot, opens its
        slots and returns where the fused step writes into them ([Note: the
        step writes the snapshot]); None when it is not due or no shard can."""
        if step % self.options.interval != 0:
            return None
        self.wait()
        with named_shards(parts()) as shards:
            targets = {(s.tensors["master"].data_ptr(), s.numel): s.key for s in shards if written_by_step(s)}
            if not targets:
                return None
            specs, _, metadata = shard_specs(shards)
        slots = self._open(step, specs, metadata)
        slots.copies = StepCopies({ptr: [f.address(f"{key}:{kind}") for f in slots.files for kind in KINDS]
                                   for ptr, key in targets.items()})
        slots.keys = targets
        self._slots = slots
        return slots.copies

    def after_step(self, step: int, parts: Callable[[], CheckpointParts], client_state: Callable[[], dict] | None) -> None:
        """After optimizer step `step`: marks it, and snapshots it when due (every `interval` steps)."""
        self.mark(step)
        if step % self.options.interval == 0:
            self.take(parts(), client_state() if client_state is not None else None)

    def mark(self, step: int) -> None:
        """Records that this rank finished `step` (a resume counts the steps it lost from these)."""
        path = os.path.join(self.root, "progress", f"rank{self.rank}")
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)

    def take(self, parts: CheckpointParts, client_state: dict | None) -> None:
        """Snapshots the state after optimizer step parts.progress's global_steps:
        completes this rank's slots now (what the step did not write into them),
        finishes the pieces (word sums, small files, a buddy's copy on another
        host) on a thread."""
        step = parts.progress.state_dict()["global_steps"]
        small = {ENGINE_STATE: plain_bytes({**engine_state(parts, client_state), "rng": rng_state()}, check=False),
                 MODEL_STATES: model_states_bytes(parts)}  # _finish checks the engine state loads
        slots, self._slots = self._slots, None
        with named_shards(parts) as shards:
            specs, fill, metadata = shard_specs(shards)
            if slots is None or slots.step != step or slots.specs != specs:
                self.wait()
                slots = self._open(step, specs, metadata)
            slots.files[0].copy(fill, skip=slots.written())
        self._step = step
        if not self.asynchronous:
            self._finish(slots, small)
            self._raise()
            return
        self._worker.submit(self._finish, slots, small)

    def wait(self) -> None:
        """Returns once the pending snapshot is complete (copied, renamed)."""
        self._worker.wait()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"zero: rank {self.rank}: the in-memory snapshot of step {self._step} in "
                               f"{self.root} failed: {type(error).__name__}: {error}") from error

    def _open(self, step: int, specs: list[TensorSpec], metadata: dict[str, str]) -> Slots:
        """The slots of this rank's piece of `step`: its own and, on this host, its buddy's copy."""
        holders = [self.rank]
        if self.buddy is not None and self.placement.same_host(self.rank, self.buddy):
            holders.append(self.buddy)
        dirs = [piece_dir(self.root, step, self.rank, self.world_size, holder) for holder in holders]
        partials = [self._slot(directory, step) for directory in dirs]
        files = [MappedSafetensors(shard_file(partial, self.rank, self.world_size), specs, metadata, self.mappings)
                 for partial in partials]
        return Slots(step, list(zip(dirs, partials)), files, specs)

    def _finish(self, slots: Slots, small: dict[str, bytes]) -> None:
        try:
            check_plain(small[ENGINE_STATE], "in-memory snapshot")
            own, *copies = slots.files
            written = slots.written()
            header = own.final_header(own.sums(written))
            for copy in copies:
                copy.copy_from(own, [spec.name for spec in slots.specs if spec.name not in written])
                copy.finish(header)
            own.finish(header)
            checksummed = {os.path.basename(own.path): header, **small}
            for directory, partial in slots.dirs:
                for name, data in small.items():
                    with open(os.path.join(partial, name), "wb") as f:
                        f.write(data)
                write_piece_json(partial, slots.step, self.rank, self.world_size, checksummed)
                os.rename(partial, directory)
            self._exchange(slots.step, slots.dirs[0][0])
            for old in expired(steps_in(self.root), slots.step):
                shutil.rmtree(os.path.join(self.root, f"step{old}"), ignore_errors=True)
        except BaseException as error:
            self._error = error

    def _exchange(self, step: int, own: str) -> None:
        """Own piece to a buddy on another host, the pieces of sources on other
        hosts from them ([Note: buddies]); on one host the writer made the copy."""
        works = []
        if self.buddy is not None and not self.placement.same_host(self.rank, self.buddy):
            works = send_piece(own, self.buddy, self.wire, self.mappings)
        for src in self.sources:
            if self.placement.same_host(self.rank, src):
                continue
            copy = piece_dir(self.root, step, src, self.world_size, self.rank)
            partial = self._slot(copy, step)
            recv_piece(partial, src, self.wire, self.mappings)
            os.rename(partial, copy)
        wait_all(works)

    def _slot(self, directory: str, step: int) -> str:
        """The .partial directory to write `directory` in (renamed to it when
        complete): the same piece's directory of an older step, recycled (its
        files are overwritten in place: no page of shared memory is allocated
        or freed), a killed snapshot's, or a new one. Its piece.json is gone
        until the piece is complete again."""
        parent, name = os.path.split(directory)
        partial = os.path.join(parent, f".{name}.partial")
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(directory, ignore_errors=True)  # a step taken again after a resume
        if not os.path.isdir(partial):
            old = (os.path.join(self.root, f"step{s}", name) for s in expired(steps_in(self.root), step))
            recycled = next((d for d in old if os.path.isdir(d)), None)
            if recycled is not None:
                os.rename(recycled, partial)
            else:
                os.makedirs(partial)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(partial, PIECE))
        return partial

    def held(self, step: int) -> list[str]:
        """The piece directories of `step` this rank wrote: its own, its buddy's
        copy on this host, the copies it received from sources on other hosts."""
        folder = os.path.join(self.root, f"step{step}")
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return [os.path.join(folder, name) for name in names
                if (m := PIECE_DIR.match(name)) and self.wrote(*map(int, m.groups()))]

    def wrote(self, rank: int, world_size: int, holder: int) -> bool:
        """Whether this rank writes `rank`'s piece held by `holder`: on one host
        the piece's rank writes both; across hosts the holder receives its copy."""
        if world_size == self.world_size and self.placement.same_host(rank, holder):
            return rank == self.rank
        return holder == self.rank

    def nbytes(self) -> int:
        """Shared memory this rank's snapshots hold: the last two steps' pieces and copies it wrote."""
        return sum(held_nbytes(d) for step in steps_in(self.root)[-2:] for d in self.held(step))

    def close(self) -> None:
        """Waits for the pending snapshot; releases the group and the mappings."""
        try:
            self.wait()
        finally:
            self._worker.stop()
            self.wire.release()
            self.mappings.clear()

    def remove(self) -> None:
        """Removes what this rank wrote (the end of a run that finished): pieces, copies, progress."""
        self.wait()
        for step in steps_in(self.root):
            for directory in self.held(step):
                shutil.rmtree(directory, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.root, f"step{step}"))
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self.root, "progress", f"rank{self.rank}"))


@dataclass
class Slots:
    """The shard files of one snapshot this rank writes: its own piece's and,
    on its host, its buddy's copy's (the same tensors at the same offsets)."""

    step: int
    dirs: list[tuple[str, str]]  # (piece directory, the .partial one it is written in); own first
    files: list[MappedSafetensors]  # by dirs
    specs: list[TensorSpec]
    copies: StepCopies | None = None  # what the step writes (before_step)
    keys: dict[tuple[int, int], str] = field(default_factory=dict)  # a master's (data_ptr, numel) -> its shard's key

    def written(self) -> dict[str, int]:
        """The tensors the step wrote into every file: their word sums, by name."""
        sums = self.copies.sums if self.copies is not None else {}
        return {f"{self.keys[ptr]}:{kind}": value for ptr, values in sums.items() for kind, value in zip(KINDS, values)}


def written_by_step(shard: NamedShard) -> bool:
    """Whether the fused step can write the shard's master and moments into a
    snapshot: plain fp32 host tensors of its numel (not offloaded to NVMe, not
    before the optimizer's first step made the moments)."""
    tensors = [shard.tensors.get(kind) for kind in KINDS]
    return shard.numel > 0 and all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and
                                   t.device.type == "cpu" and t.is_contiguous() and t.numel() == shard.numel
                                   for t in tensors)


def model_states_bytes(parts: CheckpointParts) -> bytes:
    """model_states.pt of a piece: the buffers and frozen parameters (the trainable ones are in the shards)."""
    tensor = module_tensors(parts)
    buffer = io.BytesIO()
    torch.save({key: tensor(key).clone() for key, index in state_dict_keys(parts) if index is None}, buffer)
    return buffer.getvalue()


def write_piece_json(directory: str, step: int, rank: int, world_size: int, checksummed: dict[str, bytes]) -> None:
    """piece.json, last: what restore checks each file against (as a checkpoint's
    manifest). checksummed: each file of the piece by name, with the bytes its
    checksum covers (a shard file's header, a small file's whole), as the writer has them."""
    files = {}
    for name, data in sorted(checksummed.items()):
        path, crc = os.path.join(directory, name), zlib.crc32(data)
        files[name] = manifest_entry(path, header_crc=crc) if name.endswith(".safetensors") else \
            manifest_entry(path, crc=crc)
    piece = {"format": FORMAT, "step": step, "rank": rank, "world_size": world_size, "files": files}
    with open(os.path.join(directory, PIECE), "w") as f:
        json.dump(piece, f)


def held_nbytes(directory: str) -> int:
    with contextlib.suppress(OSError):
        return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    return 0
