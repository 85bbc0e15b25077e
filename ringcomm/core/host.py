"""What this host offers and what its processes are doing: the cores this
process may run on, and a peer's state by pid (judged in C++, csrc/cpu/process.h,
which the shared-memory transport uses too)."""
from __future__ import annotations

import os

from .. import _C
from .arguments import INT64_MAX, INT64_MIN, check_int

PROCESS_STATES = ("running", "stopped", "exited")  # csrc/cpu/process.h ProcessState, in order


def process_state(pid: int) -> str:
    """"exited" (gone, or a zombie), "stopped" (SIGSTOP, or traced) or "running"."""
    check_int("process_state", "pid", pid, INT64_MIN, INT64_MAX)  # C++ says "running" for no such pid_t
    return PROCESS_STATES[_C.process_state(pid)]


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as taskset or a cgroup sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
