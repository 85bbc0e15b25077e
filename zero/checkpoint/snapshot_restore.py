"""Resuming from the in-memory snapshots (snapshot.py), or from the disk
checkpoint when it is newer or no snapshot is complete.

[Note: resume from memory]
    every rank   waits for its pending snapshot; checks its share of its host's
                 pieces (piece.json, each file's size, crc32 of the .pt files
                 and the shard file's header, every tensor's word sum)
    all-gather   the valid pieces each rank saw, the steps each host's ranks finished
    choose       the newest (step, world size) with every piece valid on some
                 host; the disk checkpoint in load_dir instead when it is newer
    fetch        a piece a host lacks, from a rank that holds it (another host: a lost host's
                 pieces come from its successor's copies, [Note: buddies] in snapshot_wire.py)
    assemble     each host's first rank links one valid copy of each piece's shard
                 file, piece 0's .pt files and their manifest into restore/step{N}_of{W}/:
                 a checkpoint directory as save.py writes one
    load         load.py's validate, agree, apply (a new world size reshards)
    every rank   its own piece's RNG states, client state and buffers (same world size; else
                 rank 0's client state and buffers, and the RNG states stay as they are)
A damaged piece is left out at the check (its error logged): its buddy's
copy, or the step before (double-buffered), or the disk is used.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import zlib
from dataclasses import dataclass, field

import torch

from . import load as checkpoint_load
from .barrier import store_barrier, store_gather
from .format import ENGINE_STATE, FORMAT, MANIFEST, MODEL_STATES, check_file, load_plain, read_engine_state, \
    read_manifest, resolve, shard_file
from .parts import CheckpointOptions, CheckpointParts
from .snapshot import Snapshots
from .snapshot_piece import PIECE, PIECE_DIR, piece_dir, set_rng_state, steps_in
from .snapshot_wire import recv_piece, send_piece, wait_all
from .tensorfile import SafetensorsReader

log = logging.getLogger("zero")


@dataclass(slots=True)
class Resumed:
    """What engine.resume() restored: from where, which step, and how many steps the failure lost."""

    source: str  # "memory" | "disk" | "none" (nothing to resume: a fresh start)
    step: int = 0
    reached: int | None = None  # the newest step any rank had finished (progress markers)
    pieces: dict[int, str] = field(default_factory=dict)  # saved rank -> "own", "copy by rank h", "fetched ..."
    seconds: dict[str, float] = field(default_factory=dict)  # check, agree, fetch, load

    @property
    def lost(self) -> int | None:
        return None if self.reached is None else max(0, self.reached - self.step)


@dataclass(frozen=True, slots=True)
class Piece:
    step: int
    rank: int  # the saved rank whose piece it is
    world_size: int  # the saved world size
    holder: int  # the rank that wrote this copy
    path: str
    reporter: int  # the rank (of this world) that checked it: one on the host that has it


def resume(parts: CheckpointParts, snapshots: Snapshots, load_dir: str | None,
           options: CheckpointOptions) -> tuple[str | None, dict | None, Resumed]:
    """Collective ([Note: resume from memory]): returns (path, client_state, Resumed)."""
    snapshots.wait()
    rank, placement, root = parts.rank, snapshots.placement, snapshots.root
    clock = time.perf_counter()
    mine, errors = check_share(snapshots)
    for error in errors:
        log.warning(f"zero: rank {rank}: snapshot piece refused: {error}")
    markers = read_markers(root) if placement.first_local(rank) == rank else []
    seconds = {"check": time.perf_counter() - clock}
    found = json.dumps([[dataclasses.astuple(p) for p in mine], markers])
    gathered = [json.loads(value) for value in store_gather("zero resume: the snapshots", snapshots.timeout_s, found)]
    gathered = [([Piece(*p) for p in pieces], steps) for pieces, steps in gathered]
    seconds["agree"] = time.perf_counter() - clock - seconds["check"]
    pieces = [p for found, _ in gathered for p in found]
    reached = max((m for _, found in gathered for m in found), default=None)
    chosen = newest_complete(pieces)
    disk = disk_step(load_dir)
    if chosen is None or (disk is not None and disk > chosen[0]):
        resumed = Resumed("disk" if disk is not None else "none", disk or 0, reached, seconds=seconds)
        path, client_state = (checkpoint_load.load(parts, load_dir, None, options=options) if disk is not None
                              else (None, None))
        finish(snapshots, resumed, parts)
        return path, client_state, resumed
    step, saved_world = chosen
    used = [p for p in pieces if (p.step, p.world_size) == chosen]
    local, how = fetch_missing(snapshots, used, step, saved_world)
    seconds["fetch"] = time.perf_counter() - clock - sum(seconds.values())
    tag = f"step{step}_of{saved_world}"
    if placement.first_local(rank) == rank:
        assemble(os.path.join(root, "restore", tag), local, saved_world)
    store_barrier("zero resume: the snapshot assembled", snapshots.timeout_s)
    checkpoint_load.load(parts, os.path.join(root, "restore"), tag, options=options)
    client_state = load_plain(os.path.join(local[0], ENGINE_STATE))["client_state"]
    if saved_world == parts.world_size:  # this rank's own RNG states, client state and buffers
        own = load_plain(os.path.join(local[rank], ENGINE_STATE))
        set_rng_state(own["rng"])
        client_state = own["client_state"]
        module_state = parts.module.state_dict()
        with torch.no_grad():
            for key, value in load_plain(os.path.join(local[rank], MODEL_STATES)).items():
                module_state[key].copy_(value)
    seconds["load"] = time.perf_counter() - clock - sum(seconds.values())
    resumed = Resumed("memory", step, reached, how, seconds)
    finish(snapshots, resumed, parts)
    return os.path.join(root, f"step{step}"), client_state, resumed


def check_share(snapshots: Snapshots) -> tuple[list[Piece], list[str]]:
    """The pieces on this host this rank checks (its share of them, by local
    rank), split into valid ones and errors naming the refused ones."""
    placement, rank, root = snapshots.placement, snapshots.rank, snapshots.root
    local = placement.hosts[placement.host_of(rank)]
    found = []
    for step in steps_in(root):
        folder = os.path.join(root, f"step{step}")
        for name in sorted(os.listdir(folder)):
            if m := PIECE_DIR.match(name):
                found.append(Piece(step, int(m.group(1)), int(m.group(2)), int(m.group(3)),
                                   os.path.join(folder, name), rank))
    valid, errors = [], []
    for piece in found[local.index(rank)::len(local)]:
        try:
            check_piece(piece)
            valid.append(piece)
        except (OSError, ValueError, KeyError) as error:
            errors.append(f"{piece.path}: {error}")
    return valid, errors


def check_piece(piece: Piece) -> None:
    """piece.json names this piece; every file has its size and checksums (ValueError otherwise)."""
    with open(os.path.join(piece.path, PIECE)) as f:
        written = json.load(f)
    facts = (written.get("format"), written.get("step"), written.get("rank"), written.get("world_size"))
    if facts != (FORMAT, piece.step, piece.rank, piece.world_size):
        raise ValueError(f"{PIECE} says {facts}, the folder {(FORMAT, piece.step, piece.rank, piece.world_size)}")
    shards = os.path.basename(shard_file(piece.path, piece.rank, piece.world_size))
    needed = {shards, ENGINE_STATE, MODEL_STATES}
    if not needed <= set(written["files"]):
        raise ValueError(f"{PIECE} lists {sorted(written['files'])}, not {sorted(needed)}")
    for name in written["files"]:
        check_file(piece.path, written, name, crc=name != shards)
    with SafetensorsReader(os.path.join(piece.path, shards)) as reader:
        if f"{zlib.crc32(reader.header_bytes):08x}" != written["files"][shards].get("header_crc32"):
            raise ValueError(f"{shards}: header crc32 differs from the one written")
        for name in reader.specs:
            reader.verify(name)


def read_markers(root: str) -> list[int]:
    folder = os.path.join(root, "progress")
    steps = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.startswith("rank") and not name.endswith(".tmp"):
            try:
                with open(os.path.join(folder, name)) as f:
                    steps.append(int(f.read()))
            except (OSError, ValueError):
                continue
    return steps


def newest_complete(pieces: list[Piece]) -> tuple[int, int] | None:
    """The newest (step, world size) of which every rank's piece is valid somewhere."""
    held: dict[tuple[int, int], set[int]] = {}
    for p in pieces:
        held.setdefault((p.step, p.world_size), set()).add(p.rank)
    return max((key for key, ranks in held.items() if ranks == set(range(key[1]))), default=None)


def disk_step(load_dir: str | None) -> int | None:
    """The global step of load_dir's latest checkpoint (None: none there, or unreadable)."""
    if not load_dir or not os.path.isfile(os.path.join(load_dir, "latest")):
        return None
    try:
        directory = resolve(load_dir, None)
        return int(read_engine_state(directory, read_manifest(directory))["counters"]["global_steps"])
    except (OSError, ValueError, KeyError) as error:
        log.warning(f"zero: resume: the disk checkpoint in {load_dir} is unreadable ({error}); not used")
        return None


def fetch_missing(snapshots: Snapshots, used: list[Piece], step: int,
                  saved_world: int) -> tuple[dict[int, str], dict[int, str]]:
    """Each host gets every piece of the chosen snapshot: those it lacks come from
    the lowest rank that checked one, in one order on every rank. Returns this
    host's copy of each piece (saved rank -> folder) and how it was had."""
    rank, placement, wire = snapshots.rank, snapshots.placement, snapshots.wire
    here = placement.hosts[placement.host_of(rank)]
    local, how = {}, {}
    for r in range(saved_world):  # a rank's own piece first, else the lowest holder's copy
        on_host = sorted((p for p in used if p.rank == r and p.reporter in here), key=lambda p: (p.holder != r, p.holder))
        if on_host:
            local[r], how[r] = on_host[0].path, "own" if on_host[0].holder == r else f"copy by rank {on_host[0].holder}"
    for ranks in placement.hosts:
        for r in range(saved_world):
            if any(p.rank == r and p.reporter in ranks for p in used):
                continue
            source = min((p for p in used if p.rank == r), key=lambda p: p.reporter)
            receiver = ranks[0]
            if rank == source.reporter:
                wait_all(send_piece(source.path, receiver, wire, snapshots.mappings))
            elif rank == receiver:
                directory = piece_dir(snapshots.root, step, r, saved_world, rank)
                shutil.rmtree(directory, ignore_errors=True)
                recv_piece(directory, source.reporter, wire, snapshots.mappings)
                check_piece(Piece(step, r, saved_world, rank, directory, rank))
            if rank in ranks:
                local[r] = piece_dir(snapshots.root, step, r, saved_world, ranks[0])
                how[r] = f"fetched from rank {source.reporter} (held by rank {source.holder})"
    return local, how


def assemble(directory: str, local: dict[int, str], saved_world: int) -> None:
    """A checkpoint directory of links to the pieces' files, and its manifest."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    files = {}
    for r in range(saved_world):
        with open(os.path.join(local[r], PIECE)) as f:
            written = json.load(f)["files"]
        names = [os.path.basename(shard_file(directory, r, saved_world))]
        if r == 0:
            names += [ENGINE_STATE, MODEL_STATES]
        for name in names:
            os.symlink(os.path.join(local[r], name), os.path.join(directory, name))
            files[name] = written[name]
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "files": files}, f)


def finish(snapshots: Snapshots, resumed: Resumed, parts: CheckpointParts) -> None:
    """Drops what the resumed run will not use (the assembled links, snapshots
    of steps after the one resumed, the old progress), logs where it resumed from."""
    rank, root = parts.rank, snapshots.root
    store_barrier("zero resume: restored", snapshots.timeout_s)
    if snapshots.placement.first_local(rank) == rank:
        shutil.rmtree(os.path.join(root, "restore"), ignore_errors=True)
        for step in steps_in(root):
            if step > resumed.step:
                shutil.rmtree(os.path.join(root, f"step{step}"), ignore_errors=True)
        shutil.rmtree(os.path.join(root, "progress"), ignore_errors=True)
    store_barrier("zero resume: old snapshots dropped", snapshots.timeout_s)
    os.makedirs(os.path.join(root, "progress"), exist_ok=True)
    snapshots.mark(resumed.step)
    if rank == 0:
        pieces = ", ".join(f"rank {r}: {how}" for r, how in sorted(resumed.pieces.items()))
        log.warning(f"zero: resume: {resumed.source} (step {resumed.step}"
                    + (f"; pieces on rank 0's host: {pieces}" if pieces else "")
                    + f"); steps lost: {resumed.lost if resumed.lost is not None else 'unknown'}"
                    + f" (newest step finished before: {resumed.reached}); "
                    + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in resumed.seconds.items()))
