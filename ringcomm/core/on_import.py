"""Runs a callback once a module has been imported, without importing it:
now if it is loaded, else when it finishes loading. Standard library only;
the package face uses it to register the backend once torch is there, and
backend/dynamo.py to put ringcomm on dynamo's skip list."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence


def after_import(name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """callback(module) now if `name` is fully loaded, else right after it loads
    (a finder on sys.meta_path wraps its loader, then leaves). A module that is
    being imported right now (in sys.modules, not finished) counts as not loaded."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and not getattr(spec, "_initializing", False):
        callback(module)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _RunAfterLoad) and finder.name == name:
            if callback not in finder.callbacks:
                finder.callbacks.append(callback)
            return
    sys.meta_path.insert(0, _RunAfterLoad(name, callback))


class _RunAfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for `name`, hands out the next finder's spec with a
    loader that runs the callbacks once the module ran; then leaves meta_path."""

    def __init__(self, name: str, callback: Callable[[types.ModuleType], None]) -> None:
        self.name, self.callbacks = name, [callback]

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = next((found for finder in sys.meta_path if hasattr(finder, "find_spec")
                     and (found := finder.find_spec(name, path, target)) is not None), None)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader, self.callbacks)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callbacks: list[Callable[[types.ModuleType], None]]) -> None:
        self._loader, self._callbacks = loader, callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name: str) -> object:
        """The rest of the wrapped loader (get_source, get_filename, ...)."""
        return getattr(self._loader, name)
