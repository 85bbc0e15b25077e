"""Registers the torch.distributed backend "ringcomm" once torch is loaded
(ringcomm/__init__.py asks for it): a name and a creator, so that
dist.init_process_group("ringcomm") works; the backend's modules load when
the first group is made, not before."""
from __future__ import annotations

import types

import torch.distributed as dist

from ..core import compat
from . import dynamo

BACKEND_NAME = "ringcomm"


def register(torch_module: types.ModuleType | None = None) -> None:
    """Registers "ringcomm" with torch.distributed and keeps torch.compile from
    tracing ringcomm (idempotent). `torch_module`: the loaded torch, unused (the
    signature of an after_import callback)."""
    if dist.is_available() and not compat.backend_registered(BACKEND_NAME):
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"], extended_api=True)
    dynamo.skip_in_dynamo()


def _create(options: object, backend_options: object = None) -> dist.ProcessGroup:
    """The creator torch.distributed calls for backend "ringcomm" (its extended
    form, which names the group's global ranks: process_group.create_backend)."""
    from .process_group import create_backend
    return create_backend(options, backend_options)
