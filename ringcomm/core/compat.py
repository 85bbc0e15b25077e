"""The one place ringcomm and zero call torch's private APIs: each is named
here once, so a torch release that moves one breaks one line. Every function
is a plain forward; the comment says why no public API does the job."""
from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd import profiler as _autograd_profiler
from torch.utils import _pytree

from . import attempt


def profiler_enabled() -> bool:
    """Whether torch.profiler records: one read of torch's flag (~8 ns; the
    public C++ query costs ~50 ns, too much for the lean path's budget)."""
    return _autograd_profiler._is_profiler_enabled


def profiler_flag() -> tuple[object, str]:
    """Where torch keeps that flag (a module and the attribute's name), for the
    lean C++ calls, which read it themselves (csrc/cpu/module_lean.cpp)."""
    return _autograd_profiler, "_is_profiler_enabled"


def record_function(name: str, inputs: Sequence[torch.Tensor], kwargs: dict) -> object:
    """A profiler event with input shapes and attributes (torch.profiler's
    record_function takes neither); the caller enters and exits it."""
    return torch._C._profiler._RecordFunctionFast(name, list(inputs), kwargs)


def default_store() -> dist.Store:
    """The default group's store (new_group's own store is not exposed), its
    keys under this attempt's scope ([Note: attempt-scoped keys] in attempt.py)."""
    return attempt.scoped(dist.distributed_c10d._get_default_store())


def backend_registered(name: str) -> bool:
    """Whether a third-party backend named `name` is registered (no public query)."""
    return name.upper() in dist.Backend._plugins


def register_device_backend(pg: dist.ProcessGroup, device: torch.device, backend: dist.ProcessGroup) -> None:
    """Makes `backend` the one `pg` hands `device`'s calls to (as torch's own
    groups are built: ProcessGroup._register_backend)."""
    kind = dist.ProcessGroup.BackendType.NCCL if device.type == "cuda" else dist.ProcessGroup.BackendType.GLOO
    pg._register_backend(device, kind, backend)


def allgather_base(backend: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, opts) -> dist.Work:
    """all_gather_into_tensor on a process group object (torch's name for it)."""
    return backend._allgather_base(output, input, opts)


def reduce_scatter_base(backend: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, opts) -> dist.Work:
    """reduce_scatter_tensor on a process group object (torch's name for it)."""
    return backend._reduce_scatter_base(output, input, opts)


def nccl_options(timeout: timedelta) -> object:
    """ProcessGroupNCCL options with a timeout (the attribute is private)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


def tree_map(fn, tree):
    """fn over every leaf of a nested container (torch's pytree; no public alias in 2.13)."""
    return _pytree.tree_map(fn, tree)


def tree_flatten(tree) -> tuple[list, object]:
    """The leaves of a nested container and the spec to rebuild it (torch's pytree)."""
    return _pytree.tree_flatten(tree)


def zip_file_reader(path: str) -> object:
    """torch.save's zip container, read record by record (torch.load reads it whole)."""
    return torch._C.PyTorchFileReader(path)


def device_types(pg: dist.ProcessGroup) -> list[torch.device]:
    """The device types a process group has a backend for (no public query)."""
    return pg._device_types


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread
    (a checkpointed module recomputing its forward, for instance)."""
    return torch._C._current_graph_task_id() != -1
