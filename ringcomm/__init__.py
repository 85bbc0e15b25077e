"""ringcomm: bucketed ring collectives for data-parallel training in PyTorch.
Importing it registers the torch.distributed backend "ringcomm" (process_group.py)."""
from __future__ import annotations

from . import process_group
from .buffer import FlatBuffer, GradBucket, flat_buffers, transport_allocator
from .coalesced import all_gather_coalesced, reduce_scatter_coalesced
from .collectives import all_gather, all_reduce, barrier, broadcast, empty, reduce_scatter
from .flat_scheduler import BucketScheduler
from .kernels import CpuCapabilities, cpu_capabilities, cpu_capability
from .group import Group, GroupOptions, GroupState, create_group, default_group, destroy_default_group, new_group
from .launch import OverlapReport
from .layout import BufferLayout, BucketSpan, ParamSlot, plan_buckets, plan_groups, plan_module_buckets
from .ops import ReduceOp
from .recorder import dump_trace
from .overlap import BucketLauncher, OwnedBucketScheduler
from .quantized import quantized_all_gather, quantized_reduce_scatter
from .transport.shm import ShmOptions
from .transport.torch_dist import TorchDistOptions
from .work import Work

__all__ = [
    "BucketLauncher", "BucketScheduler", "BucketSpan", "BufferLayout", "CpuCapabilities", "FlatBuffer", "GradBucket", "Group",
    "GroupOptions", "GroupState", "OverlapReport", "OwnedBucketScheduler", "ParamSlot", "ReduceOp", "ShmOptions",
    "TorchDistOptions", "Work", "all_gather",
    "all_gather_coalesced", "all_reduce", "barrier", "broadcast", "cpu_capabilities", "cpu_capability", "create_group", "default_group",
    "destroy_default_group", "dump_trace", "empty", "flat_buffers", "new_group", "plan_buckets", "plan_groups",
    "plan_module_buckets", "process_group", "quantized_all_gather", "quantized_reduce_scatter", "reduce_scatter", "reduce_scatter_coalesced", "transport_allocator",
]
