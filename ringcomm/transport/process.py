"""Whether a process on this host still runs (for naming dead peers)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """False once `pid` has exited, also while it is a zombie its parent has not reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
