"""DeepSpeed's comms logger (deepspeed.utils.comms_logging) for zero's
collectives: per op and message size, the count, latencies and bandwidths;
zero.comm.log_summary() prints DeepSpeed's table.

[Note: comms logger]
As DeepSpeed's: off unless configured (config "comms_logger", or
zero.comm.configure); when on, every logged op is made blocking (an async one
is waited for before its timer stops: DeepSpeed synchronizes the device after
each op), so the latencies are whole collectives and the overlap is lost while
it logs. prof_all logs every op, prof_ops those named, verbose prints each op as
it completes, debug adds the caller's function to the record name. Ops are named
as DeepSpeed's engine calls them (all_reduce, reduce_scatter_tensor,
all_gather_into_tensor, broadcast) with DeepSpeed's message size (the tensor
argument: the input; for all_gather_into_tensor, this rank's chunk). Bandwidths
are nccl-tests': algbw = the collective's whole buffer / latency, busbw = algbw x
ringcomm.plan.schedule.bus_factor; DeepSpeed multiplies reduce_scatter_tensor's whole
input by world_size once more. The logger is one per process, as DeepSpeed's is
(its API, zero.comm.log_summary(), names no object).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ringcomm.plan.schedule import bus_factor

# How DeepSpeed sizes an op's whole buffer from its message size, and the ring op it is.
_RING_OP = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
            "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}
_WHOLE = {"all_gather_into_tensor": "world", "all_gather": "world"}  # the message is one rank's chunk


@dataclass
class CommsLogger:
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = field(default_factory=list)
    debug: bool = False
    records: dict[str, dict[int, list]] = field(default_factory=dict)  # name -> msg bytes -> [count, lat, algbw, busbw]

    def configure(self, section: dict) -> None:
        """The config's "comms_logger" section, as DeepSpeed reads it."""
        self.enabled = bool(section.get("enabled", False))
        if self.enabled:
            self.verbose = bool(section.get("verbose", False))
            self.prof_all = bool(section.get("prof_all", True))
            self.prof_ops = list(section.get("prof_ops", []))
            self.debug = bool(section.get("debug", False))

    def wants(self, name: str) -> bool:
        return self.enabled and (self.prof_all or name in self.prof_ops)

    def append(self, name: str, latency_ms: float, msg_nbytes: int, world_size: int) -> None:
        algbw, busbw = bandwidths(name, msg_nbytes, latency_ms, world_size)
        record_name = f"{name} | [Caller Func: {sys._getframe(3).f_code.co_name}]" if self.debug else name
        entry = self.records.setdefault(record_name, {}).setdefault(msg_nbytes, [0, [], [], []])
        entry[0] += 1
        entry[1].append(latency_ms), entry[2].append(algbw), entry[3].append(busbw)
        if self.verbose and _rank() == 0:
            print(f"comm op: {record_name} | time (ms): {latency_ms:.2f} | msg size: {convert_size(msg_nbytes)} | "
                  f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", flush=True)


LOGGER = CommsLogger()


def bandwidths(name: str, msg_nbytes: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps, see [Note: comms logger]."""
    whole = msg_nbytes * world_size if name in _WHOLE else msg_nbytes
    algbw = whole * 8 / 1e6 / latency_ms if latency_ms > 0 else 0.0
    ring_op = _RING_OP.get(name)
    return algbw, algbw * (bus_factor(ring_op, world_size) if ring_op else 1.0)


def timed(name: str, message: object, call, *args, **kwargs):
    """Runs `call` and logs it when the logger wants `name` (see [Note: comms
    logger]); `message`, the tensor(s) whose bytes are its message size, is
    sized only then."""
    if not LOGGER.wants(name):
        return call(*args, **kwargs)
    start = time.perf_counter()
    handle = call(*args, **kwargs)
    if handle is not None:
        handle.wait()
    LOGGER.append(name, (time.perf_counter() - start) * 1e3, nbytes(message), _world_size())
    return handle


def nbytes(tensor: object) -> int:
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    if isinstance(tensor, (list, tuple)):
        return sum(nbytes(t) for t in tensor)
    return 0


def convert_size(size_bytes: int) -> str:
    """DeepSpeed's message size text ("4.0 KB")."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def trim_mean(data: list[float], trim: float = 0.1) -> float:
    """DeepSpeed's trimmed mean (10% off each end)."""
    if not data:
        return 0.0
    data, k = sorted(data), int(round(len(data) * trim))
    kept = data[k:len(data) - k]
    return sum(kept) / len(kept)


def summary_lines(records: dict, straggler_min: dict | None = None) -> list[str]:
    """DeepSpeed's table; with `straggler_min` (name -> size -> the ranks' minimum
    latencies), its straggler breakdown too."""
    head = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
            "busbw_avg (Gbps)")
    lines = ["".join(f"{h: <20}" for h in head)]
    for name, sizes in records.items():
        lines.append(name)
        for size, (count, lats, algbws, busbws) in sorted(sizes.items()):
            lines.append(f"{' ': <20}{convert_size(size): <20}{count: <20}{sum(lats): <20.2f}{trim_mean(lats): <20.2f}"
                         f"{trim_mean(algbws): <20.2f}{trim_mean(busbws): <20.2f}")
    if straggler_min is not None:
        lines += ["_______________________________", "Breakdown with straggler effect",
                  "-------------------------------",
                  "".join(f"{h: <20}" for h in ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)",
                                                "Total straggler(ms)", "Avg comm lat(ms)", "Avg straggler(ms)"))]
        for name, sizes in records.items():
            lines.append(name)
            for size, (count, lats, _, _) in sorted(sizes.items()):
                mins = straggler_min[name][size]
                extra = [a - b for a, b in zip(lats, mins)]
                lines.append(f"{' ': <20}{convert_size(size): <20}{count: <20}{sum(mins): <20.2f}{sum(extra): <20.2f}"
                             f"{trim_mean(mins): <20.2f}{trim_mean(extra): <20.2f}")
    return lines


def log_summary(show_straggler: bool = False) -> None:
    """deepspeed.comm.log_summary: a barrier, rank 0 prints the table, a barrier."""
    dist.barrier()
    records = {name: dict(sizes) for name, sizes in LOGGER.records.items()}
    mins = None
    if show_straggler:  # every rank takes part, with the same records (the same ops were logged)
        mins = {}
        for name, sizes in records.items():
            for size, (_, lats, _, _) in sorted(sizes.items()):
                values = torch.tensor(lats, dtype=torch.float64)
                dist.all_reduce(values, op=dist.ReduceOp.MIN)
                mins.setdefault(name, {})[size] = values.tolist()
    if _rank() == 0:
        print("\n".join(summary_lines(records, mins)), flush=True)
    dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
