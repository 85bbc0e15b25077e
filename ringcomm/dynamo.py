"""ringcomm under torch.compile: dynamo runs ringcomm's Python as it is and never
traces it (see [Note: ringcomm under dynamo])."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

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
# yet, a finder on sys.meta_path adds ringcomm when dynamo loads trace_rules.


def skip_in_dynamo() -> None:
    """Puts ringcomm on dynamo's skip list now if dynamo is loaded, else when it
    loads. Idempotent."""
    trace_rules = sys.modules.get(TRACE_RULES)
    if trace_rules is not None:
        trace_rules.add("ringcomm")
    elif not any(isinstance(finder, _SkipOnLoad) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SkipOnLoad())


class _SkipOnLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for trace_rules, hands out the path finder's spec
    with a loader that adds ringcomm once the module ran; then leaves meta_path."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != TRACE_RULES:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _AddRingcommAfter(spec.loader)
        return spec


class _AddRingcommAfter(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        module.add("ringcomm")

    def __getattr__(self, name: str) -> object:
        """The rest of the path finder's loader (get_source, get_filename, ...)."""
        return getattr(self._loader, name)
