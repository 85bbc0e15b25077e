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
master and moment into both (the moments of the own piece are updated where
they live: [Note: moments in the own piece]), while the values are in cache,
and returns their word sums ([Note: copies in the step] in csrc/cpu/kernels/adam.cpp). After the
step (take), the small states are pickled and what the step did not write (the
step counts; every tensor for another optimizer, for NVMe offload, or before the
moments exist) is copied into the own file. A thread then finishes the pieces
while the next step runs: the engine state's weights-only check (the step after
a failed one raises), the missing word sums and the copy's missing tensors, the
headers, the small files, piece.json; a buddy on another host receives the
piece (snapshot_wire.py), and each directory is renamed from .partial when
complete. Double-buffered: a rank keeps the last two steps (on one host, of
its buddy's copy: [Note: moments in the own piece]), so a failure during a
snapshot leaves the one before complete for every rank (ranks are at most one
snapshot apart: a step's collectives wait for every rank; `expired` says which
older steps go). A new snapshot is written over the files of the one before the
last, in place: tmpfs then allocates, zeroes and frees no page per step.
Resuming from them: snapshot_restore.py. With NVMe offload the shards are read
from the swap files by the main thread (a copy, not a reference), before the
next step.

[Note: moments in the own piece]
With a buddy's copy on the same host (one host, replicas 1), the own piece is
one file, and the optimizer's moments of the shards the step writes are views
of it: copied there once (_home: the first snapshot after they exist, or
after a load replaced them), then the fused step updates them in place. The
step then streams 16 bytes per owned parameter instead of 24 (the masters into
the own piece; masters and moments into the buddy's copy): ~15 ms of a
100M-parameter model's step on 2 ranks (benchmarks/snapshots.py), and the
moments are not held twice (memory_report counts them once, as the
optimizer's). The own piece moves on to each new step's folder and is partial
(.partial, no piece.json) while a step changes it: the step it is taken in, and
each step between snapshots (_unpublish_own). The step before then stands in
the buddy's copy, which keeps two steps. Across hosts the own piece stays
double-buffered and the moments stay where the optimizer made them: a host
lost while the own piece is partial would take with it the only copy of the
step before (the buddy's), and the survivors could not resume.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..optim.host_adam import KINDS, StepCopies
from .format import ENGINE_STATE, MODEL_STATES, NamedShard, shard_file
from .parts import CheckpointParts
from .save import check_plain, engine_state, named_shards, plain_bytes, shard_specs
from .snapshot_config import SnapshotOptions, default_path
from .snapshot_piece import (PIECE, PIECE_DIR, expired, held_nbytes, model_states_bytes, piece_dir, rng_state,
                             steps_in, write_piece_json)
from .snapshot_wire import Mappings, Placement, Wire, Worker, recv_piece, send_piece, wait_all
from .tensorfile import MappedSafetensors, TensorSpec

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
        # [Note: moments in the own piece]: with a buddy's copy on this host, the own piece is one and holds the moments
        self.moments_in_own = buddy is not None and self.placement.same_host(rank, buddy)
        self._states: dict = {}  # the optimizer.state whose moments _home placed in the own piece
        self._homed: list[tuple[torch.Tensor, str, int]] = []  # (param, kind, the address in the own piece)
        self._own_specs: list[TensorSpec] | None = None  # the layout of the own piece the moments live in
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
            self._unpublish_own()
            return None
        self.wait()
        current = parts()
        with named_shards(current) as shards:
            targets = {(s.tensors["master"].data_ptr(), s.numel): s.key for s in shards if written_by_step(s)}
            if not targets:
                self._unpublish_own()
                return None
            specs, _, metadata = shard_specs(shards)
        slots = self._open(step, specs, metadata)
        if self.moments_in_own:
            self._home(current.optimizer, slots.files[0], targets)
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
        """The slots of this rank's piece of `step`: its own and, on this host, its
        buddy's copy. With the buddy on this host the own piece moves on from
        its last step (the moments live in it; a restarted rank finds it by
        name); a new layout first hands the moments back to the optimizer."""
        if self.moments_in_own and specs != self._own_specs:
            self._unhome()
        holders = [self.rank]
        if self.buddy is not None and self.placement.same_host(self.rank, self.buddy):
            holders.append(self.buddy)
        dirs = [piece_dir(self.root, step, self.rank, self.world_size, holder) for holder in holders]
        partials = [self._slot(directory, step, moved=self.moments_in_own and i == 0) for i, directory in enumerate(dirs)]
        files = [MappedSafetensors(shard_file(partial, self.rank, self.world_size), specs, metadata, self.mappings)
                 for partial in partials]
        self._own_specs = specs if self.moments_in_own else None
        return Slots(step, list(zip(dirs, partials)), files, specs)

    def _home(self, optimizer: torch.optim.Optimizer, own: MappedSafetensors,
              targets: dict[tuple[int, int], str]) -> None:
        """[Note: moments in the own piece]: the moments of the shards the step
        writes become views of the own piece's file (copied there when they are
        elsewhere: the first snapshot, after a load); the step updates them in place."""
        params = {(p.data_ptr(), p.numel()): p for group in optimizer.param_groups for p in group["params"]}
        self._states, self._homed = optimizer.state, []
        for ptr, key in targets.items():
            if ptr not in params:
                continue  # not the optimizer's: the step streams its copies
            state = optimizer.state[params[ptr]]
            for kind in KINDS[1:]:
                name = f"{key}:{kind}"
                if state[kind].data_ptr() != own.address(name):
                    state[kind] = own.tensor(name).copy_(state[kind])
                self._homed.append((params[ptr], kind, own.address(name)))

    def _homed_moments(self) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        """(param, kind, tensor) of the moments that still live in the own piece
        (a load since may have replaced them)."""
        return [(param, kind, t) for param, kind, address in self._homed
                if isinstance(t := self._states.get(param, {}).get(kind), torch.Tensor) and t.data_ptr() == address]

    def _unhome(self) -> None:
        """The moments living in the own piece become the optimizer's own copies
        (before the file is laid out anew over them)."""
        for param, kind, tensor in self._homed_moments():
            self._states[param][kind] = tensor.clone()
        self._homed = []

    def _unpublish_own(self) -> None:
        """Before a step that updates the moments in the own piece without
        snapshotting them: the last snapshot's own piece becomes partial again
        (its buddy's copies stay complete)."""
        if not self._homed:
            return
        self.wait()
        for directory in self._own_dirs():
            parent, name = os.path.split(directory)
            if not name.startswith("."):
                partial = os.path.join(parent, f".{name}.partial")
                shutil.rmtree(partial, ignore_errors=True)  # a killed snapshot's of that step, if any
                os.rename(directory, partial)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(partial, PIECE))

    def _own_dirs(self) -> list[str]:
        """This rank's own piece directories and .partial ones, in every step's folder, newest first."""
        name = os.path.basename(piece_dir(self.root, 0, self.rank, self.world_size, self.rank))
        folders = (os.path.join(self.root, f"step{s}") for s in reversed(steps_in(self.root)))
        return [d for folder in folders for d in (os.path.join(folder, name), os.path.join(folder, f".{name}.partial"))
                if os.path.isdir(d)]

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

    def _slot(self, directory: str, step: int, *, moved: bool = False) -> str:
        """The .partial directory to write `directory` in (renamed to it when
        complete): the same piece's directory of an expired step (or, `moved`,
        the own piece's newest), recycled (its files are overwritten in place:
        no page of shared memory is allocated or freed), a killed snapshot's, or
        a new one. Its piece.json is gone until the piece is complete again."""
        parent, name = os.path.split(directory)
        partial = os.path.join(parent, f".{name}.partial")
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(directory, ignore_errors=True)  # a step taken again after a resume
        if not os.path.isdir(partial):
            old = self._own_dirs() if moved else \
                (os.path.join(self.root, f"step{s}", name) for s in expired(steps_in(self.root), step))
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
        """Shared memory this rank's snapshots add: the last two steps' pieces and
        copies it wrote, and its own piece (also between snapshots), less the
        optimizer's moments that live in it (memory_report counts them as the optimizer's)."""
        dirs = {d for step in steps_in(self.root)[-2:] for d in self.held(step)}
        dirs.update(self._own_dirs()[:1] if self.moments_in_own else [])
        return sum(held_nbytes(d) for d in dirs) - sum(t.nbytes for _, _, t in self._homed_moments())

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
        for directory in self._own_dirs():
            shutil.rmtree(directory, ignore_errors=True)
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
