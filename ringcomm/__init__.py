"""ringcomm: bucketed ring collectives for data-parallel training in PyTorch."""
from __future__ import annotations

from .collectives import all_gather, all_reduce, barrier, broadcast, empty, reduce_scatter
from .group import Group, GroupOptions, create_group, default_group, destroy_default_group, new_group
from .ops import ReduceOp
from .transport.shm import ShmOptions
from .transport.torch_dist import TorchDistOptions
from .work import Work
from .process_group import register_backend as _register_backend; _register_backend()  # noqa: E702

__all__ = [
    "Group", "GroupOptions", "ReduceOp", "ShmOptions", "TorchDistOptions", "Work", "all_gather", "all_reduce",
    "barrier", "broadcast", "empty", "create_group", "default_group", "destroy_default_group", "new_group", "reduce_scatter",
]

# Flat buffers, buckets and overlap (issue 5).
from .buffer import FlatBuffer, flat_buffers, transport_allocator
from .coalesced import all_gather_coalesced, reduce_scatter_coalesced
from .launch import OverlapReport
from .layout import BufferLayout, BucketSpan, ParamSlot, plan_buckets
from .overlap import BucketScheduler

__all__ += [
    "BucketScheduler", "BucketSpan", "BufferLayout", "FlatBuffer", "OverlapReport", "ParamSlot",
    "all_gather_coalesced", "flat_buffers", "plan_buckets", "reduce_scatter_coalesced", "transport_allocator",
]
