"""What an in-memory snapshot's piece is on disk ([Note: in-memory snapshots]
in snapshot.py): its folders, its small files (the RNG states, the buffers)
and piece.json, and what a folder holds."""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import zlib

import torch

from .format import FORMAT, manifest_entry
from .parts import CheckpointParts
from .save import module_tensors, state_dict_keys

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
