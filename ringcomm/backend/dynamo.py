"""ringcomm under torch.compile: dynamo runs ringcomm's Python as it is and never
traces it (see [Note: ringcomm under dynamo])."""
from __future__ import annotations

import types

from ..core.on_import import after_import

TRACE_RULES = "torch._dynamo.trace_rules"

# [Note: ringcomm under dynamo]
# torch calls the backend's Python methods from C++ inside compiled regions (DDP's
# bucket rebuild broadcasts from its pre-forward; FSDP2's hooks all-gather), where
# dynamo's frame hook is set: it would try to compile ProcessGroupRingcomm's
# methods frame by frame, and fails on them (the shm transport, pybind objects).
# trace_rules.add puts ringcomm's folder on dynamo's skip list: its frames then
# run eagerly, a call from traced code is a graph break (the functional
# collectives, which trace, reach the backend through torch's c10d ops).
# Importing dynamo costs seconds, so ringcomm does not: when it is not loaded
# yet, ringcomm is added when dynamo loads trace_rules (core/on_import.py).


def skip_in_dynamo() -> None:
    """Puts ringcomm on dynamo's skip list now if dynamo is loaded, else when it
    loads. Idempotent."""
    after_import(TRACE_RULES, _skip)


def _skip(trace_rules: types.ModuleType) -> None:
    trace_rules.add("ringcomm")
