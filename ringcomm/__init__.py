"""ringcomm: bucketed ring collectives for data-parallel training in PyTorch.

The package face: the public names below load their module on first use, so
`import ringcomm.plan.schedule` loads no torch. Importing ringcomm registers
the torch.distributed backend "ringcomm" once torch is loaded (at once if it
already is; backend/registration.py), so dist.init_process_group("ringcomm")
works in any import order.

Rooms, lowest first; each imports only from rooms before it (the order is
checked by tests/test_house_rules.py), and each __init__.py says what it owns:
plan (stdlib-only plans), core (codes, checks, torch compatibility), kernels,
observe (profiler events, flight recorder), transport (moving bytes),
algorithms (rings and hierarchies over transports), comm (groups and the
public collectives), buckets (gradient buffers and overlap), backend (the
torch.distributed backend).
"""
from __future__ import annotations

import importlib
import importlib.util
import types

from .core.on_import import after_import

# Public name -> the module that defines it (relative to ringcomm).
_HOMES = {
    "FlatBuffer": "buckets.buffer", "GradBucket": "buckets.buffer", "flat_buffers": "buckets.buffer",
    "Spares": "buckets.buffer", "transport_allocator": "buckets.buffer",
    "all_gather_coalesced": "comm.coalesced", "reduce_scatter_coalesced": "comm.coalesced",
    "all_gather": "comm.collectives", "all_reduce": "comm.collectives", "barrier": "comm.collectives",
    "broadcast": "comm.collectives", "empty": "comm.collectives", "reduce_scatter": "comm.collectives",
    "BucketScheduler": "buckets.flat_scheduler",
    "CpuCapabilities": "kernels.cpu", "cpu_capabilities": "kernels.cpu", "cpu_capability": "kernels.cpu",
    "Group": "comm.group", "GroupOptions": "comm.group", "GroupState": "comm.group", "create_group": "comm.group",
    "default_group": "comm.registry", "destroy_default_group": "comm.registry", "new_group": "comm.registry",
    "OverlapReport": "buckets.launch",
    "BufferLayout": "plan.layout", "BucketSpan": "plan.layout", "ParamSlot": "plan.layout",
    "plan_buckets": "plan.layout", "plan_groups": "plan.layout", "plan_module_buckets": "plan.layout",
    "ReduceOp": "core.ops",
    "dump_trace": "observe.recorder",
    "BucketLauncher": "buckets.overlap", "OwnedBucketScheduler": "buckets.overlap",
    "quantized_all_gather": "comm.quantized", "quantized_reduce_scatter": "comm.quantized",
    "ShmOptions": "transport.shm", "host_name": "transport.placement",
    "TorchDistOptions": "algorithms.flat_ring",
    "Work": "comm.work",
}
_MODULES = {"process_group": "backend.process_group"}

__all__ = sorted([*_HOMES, *_MODULES])


def __getattr__(name: str) -> object:
    if name in _HOMES:
        value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    elif name in _MODULES or (not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}")):
        value = importlib.import_module(f".{_MODULES.get(name, name)}", __name__)  # a room, or process_group
    else:
        raise AttributeError(f"module 'ringcomm' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _register(torch: types.ModuleType) -> None:
    from .backend.registration import register
    register()


after_import("torch", _register)
