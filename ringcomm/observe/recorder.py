"""The flight recorder: per group, the last N collectives (sequence number, op,
sizes, dtype, reduce op, transport, state, times), dumped one JSON file per
rank when a collective fails, on a signal, or on request (ringcomm.dump_trace).

[Note: flight recorder]
    RINGCOMM_TRACE_BUFFER_SIZE=N  entries kept per group (default 64; 0: off; at most 1000000)
    RINGCOMM_TRACE_DIR=DIR        where dumps go (default: <tmp>/ringcomm-trace-<uid>/<run id>)
    RINGCOMM_TRACE_STACKS=1       record the Python stack of every call (costly)
    RINGCOMM_TRACE_SIGNAL=USR1    dump when the process gets this signal (not KILL, STOP or a fault signal)
An entry is a list (cheap to make on the lean path) whose fields are ENTRY_FIELDS;
it is written when the call is made (state queued, or started when it runs
inline) and updated as it starts, completes or fails. Every group of a rank goes
into that rank's one file, `ringcomm_trace_rank_<global rank>.json`, rewritten at
each dump, with the run id ([Note: run id]). The entries carry torch's flight
recorder field names (collective_seq_id, profiling_name, input_sizes, ...);
torch's analyzer reads pickles only, and `python -m ringcomm.observe.trace DIR` reads
these files. Recorders are listed in a weak set so that a signal or dump_trace()
reaches every live group of the process.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _C
from ..core import compat
from ..core.arguments import flag_from_env, int_from_env
from ..core.ops import DTYPE_CODES, OP_KINDS, ReduceOp
from .profiling import event_name

DEFAULT_BUFFER_SIZE = 64
MAX_BUFFER_SIZE = 1_000_000  # entries per group: ~60 MB in C++ and Python, and a dump of ~300 MB
VERSION = "ringcomm-trace-2"  # -1 had no run_id
FILE_PREFIX = "ringcomm_trace_rank_"

# Fields of an entry, in order.
SEQ, OP, INPUTS, OUTPUTS, DTYPE, REDOP, STATE, CREATED, STARTED, COMPLETED, ERROR, FRAMES = range(12)

_recorders: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
# [Note: group ids] A group is named in the dumps by its global ranks and its id:
# n for the n-th group over exactly these ranks that this process made. Only the
# members of a group make it (a rank outside ringcomm.new_group's `ranks`, or
# outside a backend subgroup, makes nothing), but the members make their groups
# in the same order, so (global ranks, n) names the same group on every member,
# and disjoint groups (hpZ's partitions: ranks 0-1 and 2-3) never share a name.
_group_ids: dict[tuple[int, ...], itertools.count] = {}


def buffer_size() -> int:
    """RINGCOMM_TRACE_BUFFER_SIZE, checked."""
    return int_from_env("RINGCOMM_TRACE_BUFFER_SIZE", DEFAULT_BUFFER_SIZE, 0, MAX_BUFFER_SIZE)


# [Note: run id] Every dump names the run it belongs to, so that the analyzer
# never merges the files of two runs, and the default dump folder is one per
# user and per run. The run id is the launcher's job id (TORCHELASTIC_RUN_ID, set
# by torchrun; its placeholder "none" does not count), else one the processes
# agree on as they create groups: each proposes its own (the one it holds, or a
# new random one) with compare_set on the world's store (the group's store while
# there is no initialized world, as when torch builds the backend's world group),
# the first proposal stays, and a process keeps the first run id it learns.
# Agreeing needs no wait, and every process of a world holds the same run id
# whichever of its groups it creates first.
RUN_ID_VARIABLE = "TORCHELASTIC_RUN_ID"
RUN_ID_KEY = "ringcomm/run_id"
_run_ids: list[str] = []  # this process's run id, once known


def launcher_run_id() -> str:
    """The launcher's job id, or "" when it set none."""
    value = os.environ.get(RUN_ID_VARIABLE, "").strip()
    return "" if value in ("", "none") else value


def run_id() -> str:
    """This process's run id ([Note: run id]); a process that agreed on none
    (its groups were not made by create_group) makes one of its own."""
    if not _run_ids:
        _run_ids.append(launcher_run_id() or uuid.uuid4().hex[:12])
    return _run_ids[0]


def agree_run_id(group_store: dist.Store) -> str:
    """Learns the run id the processes agree on ([Note: run id]) through the
    world's store, or `group_store` while no world is initialized; returns this
    process's run id."""
    if not launcher_run_id():
        store = compat.default_store() if dist.is_initialized() else group_store
        proposal = _run_ids[0] if _run_ids else uuid.uuid4().hex[:12]
        agreed = store.compare_set(RUN_ID_KEY, "", proposal).decode()
        if not _run_ids:
            _run_ids.append(agreed)
    return run_id()


def trace_dir() -> str:
    """Where dumps go: RINGCOMM_TRACE_DIR, else default_trace_dir()."""
    return os.environ.get("RINGCOMM_TRACE_DIR") or default_trace_dir()


def default_trace_dir() -> str:
    """<tmp>/ringcomm-trace-<uid>/<run id>: runs of different users or jobs never
    overwrite each other's dumps ([Note: run id])."""
    folder = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id()).lstrip(".") or "run"
    return os.path.join(tempfile.gettempdir(), f"ringcomm-trace-{os.getuid()}", folder)


def for_group(rank: int, world_size: int, global_ranks: tuple[int, ...], transport: str, timeout_s: float,
              handle: object | None) -> FlightRecorder | None:
    """A group's recorder, or None when RINGCOMM_TRACE_BUFFER_SIZE=0. `handle`:
    the transport's lean handle (its lean calls are recorded in C++), or None."""
    capacity = buffer_size()
    if capacity == 0:
        return None
    recorder = FlightRecorder(capacity, rank=rank, world_size=world_size, global_ranks=global_ranks,
                              transport=transport, handle=handle)
    recorder.timeout_s = timeout_s
    return recorder


class FlightRecorder:
    """The last `capacity` collectives of one group, newest last."""

    def __init__(self, capacity: int, *, rank: int, world_size: int, global_ranks: tuple[int, ...],
                 transport: str, handle: object | None) -> None:
        assert capacity > 0
        self.capacity = capacity
        self.group_id = next(_group_ids.setdefault(tuple(global_ranks), itertools.count()))  # [Note: group ids]
        self._seq = 0  # of the last call recorded here, where no handle numbers them
        self._handle = handle
        if handle is not None:
            _C._trace_resize(handle, capacity)
        self._ring: list[list | None] = [None] * capacity
        self.rank, self.world_size, self.global_ranks, self.transport = rank, world_size, global_ranks, transport
        self.stacks = flag_from_env("RINGCOMM_TRACE_STACKS", False)
        self.timeout_s = 0.0
        _recorders.add(self)
        watch_signal()

    def record(self, op: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
               redop: ReduceOp | None, state: str) -> list:
        """A new entry; of `inputs` and `outputs` only their shapes and dtype are kept."""
        if self._handle is not None:
            seq = _C._trace_next_seq(self._handle)
        else:
            self._seq = seq = self._seq + 1
        now = time.time_ns()
        dtype = inputs[0].dtype if inputs else outputs[0].dtype if outputs else None
        entry = [seq, op, [t.shape for t in inputs], [t.shape for t in outputs], dtype, redop, state, now,
                 now if state == "started" else 0, 0, "", None]
        if self.stacks:
            entry[FRAMES] = traceback.format_stack(limit=24)[:-2]
        self._ring[seq % self.capacity] = entry
        return entry

    def entries(self) -> list[dict]:
        """The last `capacity` calls, oldest first: those recorded here and the
        lean calls the C++ part recorded."""
        entries = [_entry_dict(e, self.transport) for e in self._ring if e is not None]
        if self._handle is not None:
            entries += [_lean_entry_dict(e, self.transport) for e in _C._trace_entries(self._handle)]
        entries.sort(key=lambda e: e["collective_seq_id"])
        return entries[-self.capacity:]

    def snapshot(self) -> dict:
        return {"group_id": self.group_id, "rank": self.rank, "world_size": self.world_size,
                "global_ranks": list(self.global_ranks), "transport": self.transport, "timeout_s": self.timeout_s,
                "entries": self.entries()}


def started(entry: list) -> None:
    entry[STATE], entry[STARTED] = "started", time.time_ns()


def completed(entry: list) -> None:
    entry[STATE], entry[COMPLETED] = "completed", time.time_ns()


def failed(entry: list, error: BaseException) -> None:
    entry[STATE], entry[COMPLETED], entry[ERROR] = "failed", time.time_ns(), str(error).splitlines()[0][:500]


def _shapes(shapes: list[torch.Size]) -> list[list[int]]:
    return [list(s) for s in shapes]


def _entry_dict(e: list, transport: str) -> dict:
    dtype = "" if e[DTYPE] is None else str(e[DTYPE]).removeprefix("torch.")
    inputs, outputs = _shapes(e[INPUTS]), _shapes(e[OUTPUTS])
    return {"record_id": e[SEQ], "collective_seq_id": e[SEQ], "profiling_name": event_name(e[OP]),
            "input_sizes": inputs, "input_dtypes": [dtype] * len(inputs), "output_sizes": outputs,
            "output_dtypes": [dtype] * len(outputs), "reduce_op": None if e[REDOP] is None else e[REDOP].name,
            "transport": transport, "state": e[STATE], "time_created_ns": e[CREATED],
            "time_discovered_started_ns": e[STARTED] or None, "time_discovered_completed_ns": e[COMPLETED] or None,
            "error": e[ERROR], "frames": e[FRAMES] or []}


_KIND_NAMES = {code: name for name, code in OP_KINDS.items()}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPE_CODES.items()}
_LEAN_STATES = {1: "started", 2: "completed", 3: "failed"}


def _lean_entry_dict(e: tuple, transport: str) -> dict:
    """An entry of the C++ part: (seq, kind, dtype, redop, state, input_numel, output_numel, started_ns, ended_ns)."""
    seq, kind, dtype, redop, state, input_numel, output_numel, started_ns, ended_ns = e
    return {"record_id": seq, "collective_seq_id": seq, "profiling_name": event_name(_KIND_NAMES[kind]),
            "input_sizes": [[input_numel]], "input_dtypes": [_DTYPE_NAMES[dtype]], "output_sizes": [[output_numel]],
            "output_dtypes": [_DTYPE_NAMES[dtype]], "reduce_op": ReduceOp(redop).name if redop >= 0 else None,
            "transport": transport, "state": _LEAN_STATES[state], "time_created_ns": started_ns,
            "time_discovered_started_ns": started_ns, "time_discovered_completed_ns": ended_ns or None,
            "error": "", "frames": []}


def dump(reason: str, directory: str | None = None, *, announce: bool = True) -> str | None:
    """Writes this rank's file with every live group's entries; returns its path
    (None when no group records); with `announce`, says where on stderr. Never
    raises: it runs on error paths."""
    recorders = [r for r in list(_recorders)]
    if not recorders:
        return None
    try:
        rank = dist.get_rank() if dist.is_initialized() else recorders[0].global_ranks[recorders[0].rank]
        world_size = dist.get_world_size() if dist.is_initialized() else recorders[0].world_size
        directory = directory or trace_dir()
        if directory == default_trace_dir():  # its parent, shared by this user's runs, private too
            os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        payload = {"version": VERSION, "run_id": run_id(), "rank": rank, "world_size": world_size,
                   "pid": os.getpid(), "hostname": socket.gethostname(), "reason": reason, "time_ns": time.time_ns(),
                   "groups": [r.snapshot() for r in sorted(recorders, key=lambda r: (r.global_ranks, r.group_id))]}
        path = os.path.join(directory, f"{FILE_PREFIX}{rank}.json")
        scratch = f"{path}.{os.getpid()}.tmp"
        with open(scratch, "w") as out:
            json.dump(payload, out, indent=1)
        os.replace(scratch, path)
        if announce:
            print(f"ringcomm: rank {rank} wrote its flight recorder to {path} (python -m ringcomm.observe.trace "
                  f"{directory})", file=sys.stderr, flush=True)
        return path
    except Exception as err:  # a dump must not hide the failure that caused it
        print(f"ringcomm: flight recorder dump failed: {err!r}", file=sys.stderr, flush=True)
        return None


# [Note: dump on a signal] The signal's Python handler does nothing itself: it
# runs only when the main thread gets back to Python, and a stuck collective
# waits in C++. Python's C-level handler also writes the signal number to the
# wakeup fd, which a daemon thread reads, and that thread dumps. Where someone
# else (asyncio) owns the wakeup fd, the handler dumps when the main thread
# next runs Python.
_watching: list[int] = []  # the signal watched, once installed


# Signals RINGCOMM_TRACE_SIGNAL may not name, and why.
_REFUSED_SIGNALS = {
    signal.SIGKILL: "cannot be caught (the kernel acts on it, not the process)",
    signal.SIGSTOP: "cannot be caught (the kernel acts on it, not the process)",
    **{signum: "is a fault signal (a handler that returns re-runs the faulting instruction)"
       for signum in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)},
}


def trace_signal() -> signal.Signals | None:
    """RINGCOMM_TRACE_SIGNAL (e.g. USR1 or SIGUSR1), checked; None when unset."""
    name = os.environ.get("RINGCOMM_TRACE_SIGNAL", "").strip()
    if not name:
        return None
    try:
        signum = signal.Signals["SIG" + name.upper().removeprefix("SIG")]
    except KeyError:
        raise ValueError(f"ringcomm: RINGCOMM_TRACE_SIGNAL={name!r} is not a signal name (e.g. USR1)") from None
    if signum in _REFUSED_SIGNALS:
        raise ValueError(f"ringcomm: RINGCOMM_TRACE_SIGNAL={name!r} cannot trigger a dump: {signum.name} "
                         f"{_REFUSED_SIGNALS[signum]}; use USR1 or USR2")
    return signum


def watch_signal() -> None:
    """Installs RINGCOMM_TRACE_SIGNAL's dump (see [Note: dump on a signal]); from
    the main thread only (Python's rule for signal handlers), once. The variable
    is checked on every call, from any thread."""
    signum = trace_signal()
    if signum is None or _watching or threading.current_thread() is not threading.main_thread():
        return
    try:
        signal.signal(signum, lambda *_: None)
    except OSError as err:
        raise ValueError(f"ringcomm: RINGCOMM_TRACE_SIGNAL={signum.name}: this process cannot handle it ({err})") \
            from None
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_fd), os.close(write_fd)
        signal.signal(signum, lambda *_: dump(f"signal {signum.name}"))
    else:
        threading.Thread(target=_watch, args=(read_fd, signum), name="ringcomm-trace-signal", daemon=True).start()
    _watching.append(signum)


def _watch(read_fd: int, signum: signal.Signals) -> None:
    while True:
        if signum in os.read(read_fd, 64):
            dump(f"signal {signum.name}")


def dump_trace(directory: str | None = None) -> str | None:
    """Writes this rank's flight recorder file now (RINGCOMM_TRACE_DIR, or
    `directory`); returns its path, None when no group records."""
    return dump("ringcomm.dump_trace()", directory, announce=False)
