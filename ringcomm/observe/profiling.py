"""torch.profiler events for ringcomm's collectives: one event `ringcomm:<op>`
per call, with the input shapes and dtype, as torch's gloo and NCCL backends
record `gloo:all_reduce`.

[Note: profiler events]
A collective's event starts on the calling thread when it is called and ends
when it completes: on the calling thread for a call that ran inline, on the comm
thread for one that ran there (torch's profiler then marks it async, as it does
gloo's events, which its worker threads end). Under the profiler the backend
runs every call on its comm thread, as gloo does (process_group.py), so that its
events are the async events torch's tools expect; the lean paths step aside
while a profiler is active. The check is one read of torch's flag
`torch.autograd.profiler._is_profiler_enabled` (~8 ns; the C++ query costs
~50 ns), which torch.profiler.profile and torch.autograd.profiler.profile set;
a profiler started by other means records no ringcomm events. The flag's one
home is core/compat.py: Python reads it through compat.profiler_enabled(), and
the lean C++ calls of collectives.py read it themselves (module_lean.cpp), so
their Python path pays no call for it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.compat import profiler_enabled, record_function
from ..plan.schedule import torch_name

PREFIX = "ringcomm:"

def event_name(op: str) -> str:
    """`ringcomm:<op>`, with the backend's calls named as torch's events are ([Note: op names])."""
    return PREFIX + torch_name(op)


def active() -> bool:
    """Whether a torch profiler is recording (see [Note: profiler events])."""
    return profiler_enabled()


class Event:
    """One collective's profiler event: begun at construction, ended by end()
    on whichever thread finishes the call (see [Note: profiler events])."""

    __slots__ = ("_record",)

    def __init__(self, op: str, inputs: Sequence[torch.Tensor], *, seq: int, group_size: int) -> None:
        dtype = str(inputs[0].dtype).removeprefix("torch.") if inputs else ""
        numel = sum(t.numel() for t in inputs)
        self._record = record_function(
            event_name(op), inputs, {"seq": seq, "dtype": dtype, "in_numel": numel, "group_size": group_size})
        self._record.__enter__()

    def end(self) -> None:
        record, self._record = self._record, None
        if record is not None:
            record.__exit__(None, None, None)
