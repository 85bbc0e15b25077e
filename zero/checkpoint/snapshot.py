"""In-memory snapshots of a run's state, taken every few optimizer steps, kept
in shared memory and copied to a buddy rank, so that a run that loses a rank
or a host resumes from the last step instead of the last disk checkpoint.

[Note: in-memory snapshots]
A snapshot of step N is one piece per rank, in the host's snapshot folder
(/dev/shm: it outlives the process, not the host):

    step{N}/rank{r}_of{W}.by{h}/   written by rank h: rank r's piece (h == r) or its buddy's copy
        zero_shards_rank{r}_of{W}.safetensors   the rank's named shards (fp32 masters, optimizer
                                                states), a crc32 per tensor: save.py's shard file
        engine_state.pt                         save.py's engine state (scheduler, scaler, counters,
                                                client state) and this rank's RNG states
        model_states.pt                         the rank's buffers and frozen parameters
        piece.json                              the files' sizes and checksums, written last
    progress/rank{r}                            the last step rank r finished (how many a resume lost)

Taking one (take), in the step: the small states are pickled and the shards
copied into the slot's shard file through a shared mapping (one memcpy of
what the rank owns). A thread then finishes the piece while the next step
runs: the crc32 of each tensor into the file's header, the small files,
piece.json; the piece goes to the rank's buddy (snapshot_wire.py), and each
directory is renamed from .partial when complete. Double-buffered: a rank keeps the last
two steps, so a failure during a snapshot leaves the one before complete on
every rank (ranks are at most one snapshot apart: a step's collectives wait
for every rank; `expired` says which older steps go). A new snapshot is written over the files of the one before
the last, in place: tmpfs then allocates, zeroes and frees no page per step. Resuming from them: snapshot_restore.py. With NVMe offload
the shards are read from the swap files by the main thread (a copy, not a
reference), before the next step.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import threading
import zlib
from collections.abc import Callable

import torch

from .format import ENGINE_STATE, FORMAT, MODEL_STATES, manifest_entry, shard_file
from .parts import CheckpointParts
from .save import engine_state, module_tensors, named_shards, plain_bytes, shard_specs, state_dict_keys
from .snapshot_config import SnapshotOptions, default_path
from .snapshot_wire import Mappings, Placement, Wire, recv_piece, send_piece, wait_all
from .tensorfile import MappedSafetensors, SafetensorsReader

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
        # own and copies, 2 steps each, and the sources' files a copy on this host reads
        self.mappings = Mappings(capacity=2 + 4 * len(self.sources))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None
        os.makedirs(os.path.join(self.root, "progress"), exist_ok=True)

    # ---- taking ---------------------------------------------------------------------------
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
        copies it into this rank's slot now, finishes the piece (checksums,
        small files, the buddy's copy) on a thread."""
        self.wait()
        step = parts.progress.state_dict()["global_steps"]
        small = {ENGINE_STATE: plain_bytes({**engine_state(parts, client_state), "rng": rng_state()}),
                 MODEL_STATES: model_states_bytes(parts)}
        own = piece_dir(self.root, step, self.rank, self.world_size, self.rank)
        partial = self._slot(own, step)
        with named_shards(parts) as shards:
            specs, fill, metadata = shard_specs(shards)
            shard_bytes = MappedSafetensors(shard_file(partial, self.rank, self.world_size), specs, metadata,
                                            self.mappings)
            shard_bytes.copy(fill)
        self._step = step
        if not self.asynchronous:
            self._finish(step, own, partial, shard_bytes, small)
            self._raise()
            return
        self._thread = threading.Thread(target=self._finish, args=(step, own, partial, shard_bytes, small),
                                        daemon=True, name=f"zero-snapshot-{step}")
        self._thread.start()

    def wait(self) -> None:
        """Returns once the pending snapshot is complete (copied, renamed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"zero: rank {self.rank}: the in-memory snapshot of step {self._step} in "
                               f"{self.root} failed: {type(error).__name__}: {error}") from error

    def _finish(self, step: int, own: str, partial: str, shard_bytes: MappedSafetensors,
                small: dict[str, bytes]) -> None:
        try:
            shard_bytes.checksum()
            for name, data in small.items():
                with open(os.path.join(partial, name), "wb") as f:
                    f.write(data)
            write_piece_json(partial, step, self.rank, self.world_size)
            os.rename(partial, own)
            self._exchange(step, own)
            for old in expired(steps_in(self.root), step):
                shutil.rmtree(os.path.join(self.root, f"step{old}"), ignore_errors=True)
        except BaseException as error:
            self._error = error

    def _exchange(self, step: int, own: str) -> None:
        """Own piece to the buddy, the sources' pieces from them ([Note: buddies])."""
        works = []
        if self.buddy is not None:
            works = send_piece(own, self.buddy, self.wire, self.mappings, same_host=self.placement.same_host(self.rank, self.buddy))
        for src in self.sources:
            copy = piece_dir(self.root, step, src, self.world_size, self.rank)
            partial = self._slot(copy, step)
            recv_piece(partial, src, self.wire, self.mappings, same_host=self.placement.same_host(self.rank, src))
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
        """The piece directories of `step` this rank wrote (its own, its copies)."""
        folder = os.path.join(self.root, f"step{step}")
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return [os.path.join(folder, n) for n in names if (m := PIECE_DIR.match(n)) and int(m.group(3)) == self.rank]

    def nbytes(self) -> int:
        """Shared memory this rank's snapshots hold: the last two steps' pieces and copies it wrote."""
        return sum(held_nbytes(d) for step in steps_in(self.root)[-2:] for d in self.held(step))

    def close(self) -> None:
        """Waits for the pending snapshot; releases the group and the mappings."""
        try:
            self.wait()
        finally:
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


def model_states_bytes(parts: CheckpointParts) -> bytes:
    """model_states.pt of a piece: the buffers and frozen parameters (the trainable ones are in the shards)."""
    tensor = module_tensors(parts)
    buffer = io.BytesIO()
    torch.save({key: tensor(key).clone() for key, index in state_dict_keys(parts) if index is None}, buffer)
    return buffer.getvalue()


def write_piece_json(directory: str, step: int, rank: int, world_size: int) -> None:
    """piece.json, last: what restore checks each file against (as a checkpoint's manifest)."""
    files = {}
    for name in sorted(set(os.listdir(directory)) - {PIECE}):
        path = os.path.join(directory, name)
        if name.endswith(".safetensors"):
            with SafetensorsReader(path) as reader:
                files[name] = manifest_entry(path, header_crc=zlib.crc32(reader.header_bytes))
        else:
            files[name] = manifest_entry(path, crc=True)
    piece = {"format": FORMAT, "step": step, "rank": rank, "world_size": world_size, "files": files}
    with open(os.path.join(directory, PIECE), "w") as f:
        json.dump(piece, f)


def held_nbytes(directory: str) -> int:
    with contextlib.suppress(OSError):
        return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    return 0
