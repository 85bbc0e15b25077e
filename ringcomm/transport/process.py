"""What a process on this host is doing (for naming dead or stopped peers)."""
from __future__ import annotations

import os


def process_state(pid: int) -> str:
    """"exited" (gone, or a zombie), "stopped" (SIGSTOP, or traced) or "running"."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "exited"
    except PermissionError:
        return "running"
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "running"
    return {"Z": "exited", "X": "exited", "T": "stopped", "t": "stopped"}.get(state, "running")
