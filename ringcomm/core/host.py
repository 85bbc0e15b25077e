"""What this host offers and what its processes are doing: the cores this
process may run on and their caches, its memory cgroup's limit and usage, and a peer's state by pid (judged in C++,
csrc/cpu/process.h, which the shared-memory transport uses too)."""
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


CPU_CACHES = "/sys/devices/system/cpu/cpu{cpu}/cache"
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs writes cache sizes as "512K", "16M"


def cache_nbytes(level: int) -> int | None:
    """The size of the data (or unified) cache of `level` that this process's
    first core uses, as the kernel reports it (sysfs: one instance, e.g. one
    core's L2 or one core complex's L3, not a socket's total), or None where it
    does not."""
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    folder = CPU_CACHES.format(cpu=cpu)
    try:
        indexes = [name for name in os.listdir(folder) if name.startswith("index")]
        for index in indexes:
            fields = {}
            for field in ("level", "type", "size"):
                with open(os.path.join(folder, index, field)) as f:
                    fields[field] = f.read().strip()
            if int(fields["level"]) == level and fields["type"] in ("Data", "Unified"):
                size = fields["size"]
                return int(size[:-1]) * _SIZE_UNITS[size[-1]] if size[-1] in _SIZE_UNITS else int(size)
    except (OSError, ValueError, KeyError):
        return None
    return None


CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 62  # cgroup v1 says "no limit" with a number near 2**63


def memory_cgroup_folder() -> tuple[str, int] | None:
    """(folder, version) of the memory cgroup this process is charged to: cgroup
    v1's memory controller (version 1) or v2's unified hierarchy (version 2);
    None when /proc/self/cgroup names neither."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    v1 = [path for _, controllers, path in lines if "memory" in controllers.split(",")]
    if v1:
        return os.path.join(CGROUP_ROOT, "memory", v1[0].lstrip("/")), 1
    v2 = [path for hierarchy, controllers, path in lines if hierarchy == "0" and not controllers]
    return (os.path.join(CGROUP_ROOT, v2[0].lstrip("/")), 2) if v2 else None


def memory_cgroup() -> tuple[str, int, int] | None:
    """(path, limit, usage) in bytes of the memory cgroup this process is
    charged to, when it or one of its ancestors has a limit (the smallest
    counts); None when none has one or the cgroup cannot be read. cgroup v1's
    memory controller (memory.limit_in_bytes, memory.usage_in_bytes) or v2's
    unified hierarchy (memory.max, memory.current). The usage leaves out the
    page cache (file pages, active and inactive): the kernel reclaims it
    before it kills a process of the cgroup (a swap file's cached pages and
    the libraries' mapped ones make room), so what counts is anonymous and
    shared memory."""
    found = memory_cgroup_folder()
    if found is None:
        return None
    folder, version = found
    v1 = version == 1
    root = os.path.join(CGROUP_ROOT, "memory") if v1 else CGROUP_ROOT
    files = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
    try:
        with open(os.path.join(folder, files[1])) as f:
            usage = int(f.read())
    except (OSError, ValueError):
        return None
    prefix = "total_" if v1 else ""
    usage -= _stat_nbytes(folder, (f"{prefix}active_file", f"{prefix}inactive_file"))
    limit, here = None, folder
    while True:  # the tightest limit on the way up to the root
        try:
            with open(os.path.join(here, files[0])) as f:
                text = f.read().strip()
            if text != "max" and int(text) < _NO_LIMIT:
                limit = int(text) if limit is None else min(limit, int(text))
        except (OSError, ValueError):
            pass
        if os.path.normpath(here) == os.path.normpath(root):
            break
        here = os.path.dirname(here)
    return None if limit is None else (folder, limit, usage)


def _stat_nbytes(folder: str, keys: tuple[str, ...]) -> int:
    """The sum of memory.stat's `keys` (0 where unreadable)."""
    total = 0
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in keys:
                    total += int(value)
    except (OSError, ValueError):
        return 0
    return total
