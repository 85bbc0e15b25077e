"""The config's "checkpoint" section: DeepSpeed's keys (accepted; they name
DeepSpeed's own writers) and zero's "in_memory" snapshots ([Note: in-memory
snapshots] in snapshot.py):

    "checkpoint": {"in_memory": {"enabled": true, "interval": 1, "replicas": 1,
                                 "async": true, "path": "/dev/shm/zero-snapshots/<job>"}}

interval: optimizer steps between snapshots; replicas: 0 or 1 buddy copy;
async: the snapshot is written while the next step's forward and backward
run (its optimizer step waits for it); path: where this host keeps them,
default /dev/shm/zero-snapshots/ and the job's name (torchrun's run id, else
the master's address and port), so a restarted attempt finds them."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..parsing.values import as_bool, as_int, section_of, warn_unknown

DEEPSPEED_KEYS = {"tag_validation", "load_universal", "use_node_local_storage", "parallel_write"}
IN_MEMORY_KEYS = {"enabled", "interval", "replicas", "async", "path"}


@dataclass(frozen=True, slots=True)
class SnapshotOptions:
    enabled: bool = False
    interval: int = 1  # >= 1 optimizer steps between snapshots
    replicas: int = 1  # 0 | 1: copies on a buddy rank ([Note: buddies] in snapshot_wire.py)
    asynchronous: bool = True  # "async"
    path: str = ""  # "" -> default_path()


def parse(raw: dict) -> SnapshotOptions:
    section = section_of(raw, "checkpoint")
    warn_unknown(section, DEEPSPEED_KEYS | {"in_memory"}, "checkpoint.")
    memory = section_of(section, "in_memory")
    warn_unknown(memory, IN_MEMORY_KEYS, "checkpoint.in_memory.")
    where = "checkpoint.in_memory."
    replicas = as_int(memory.get("replicas", 1), where + "replicas")
    if replicas > 1:
        raise ValueError(f"zero config: {where}replicas must be 0 or 1 (one buddy copy), got {replicas}")
    path = memory.get("path", "")
    if not isinstance(path, str):
        raise ValueError(f"zero config: {where}path must be a string, got {path!r}")
    return SnapshotOptions(enabled=as_bool(memory.get("enabled", False), where + "enabled"),
                           interval=as_int(memory.get("interval", 1), where + "interval", 1), replicas=replicas,
                           asynchronous=as_bool(memory.get("async", True), where + "async"), path=path)


def default_path() -> str:
    """/dev/shm/zero-snapshots/<job>: the same in every attempt of one torchrun job."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    job = run_id if run_id != "none" else f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
    return os.path.join("/dev/shm", "zero-snapshots", job.replace(os.sep, "_"))
