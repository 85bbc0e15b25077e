"""ringcomm: bucketed ring collectives for data-parallel training in PyTorch."""
from __future__ import annotations

from .collectives import all_gather, all_reduce, barrier, broadcast, reduce_scatter
from .group import Group, GroupOptions, create_group, default_group, destroy_default_group, new_group
from .ops import ReduceOp
from .transport.shm import ShmOptions
from .transport.torch_dist import TorchDistOptions
from .work import Work

__all__ = [
    "Group", "GroupOptions", "ReduceOp", "ShmOptions", "TorchDistOptions", "Work", "all_gather", "all_reduce",
    "barrier", "broadcast", "create_group", "default_group", "destroy_default_group", "new_group", "reduce_scatter",
]
