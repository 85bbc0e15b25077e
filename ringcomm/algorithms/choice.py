"""Which transport a group gets (RINGCOMM_TRANSPORT, else the caller's choice;
"auto" from the ranks' hosts) and opening it."""
from __future__ import annotations

import os

import torch.distributed as dist

from ..transport.base import Transport
from ..transport.placement import Placement, auto_transport
from ..transport.shm import ShmOptions, ShmTransport
from .flat_ring import TorchDistOptions, open_torch_dist
from .hierarchical import HierarchicalTransport

TRANSPORTS = ("auto", "shm", "torch_dist", "hierarchical")


def open_transport(store: dist.Store, rank: int, placement: Placement, *, kind: str, timeout_s: float,
                   shm: ShmOptions, torch_dist: TorchDistOptions) -> tuple[Transport, dist.ProcessGroup | None]:
    """Collective over the group's ranks (placed as `placement` says): the
    transport, rendezvousing through `store`, and the gloo group made for a
    torch_dist transport (its owner shuts it down; a hierarchical transport
    owns its own)."""
    world_size = len(placement.hosts)
    kind = resolve_transport(kind, placement)
    pg, fallback = None, ""
    if kind == "hierarchical":
        fallback = placement.unsupported()
    if kind == "shm":
        transport: Transport = ShmTransport.create(dist.PrefixStore("shm/", store), rank, world_size, timeout_s, shm)
    elif kind == "hierarchical" and not fallback:
        transport = HierarchicalTransport.create(store, rank, placement, timeout_s, shm=shm, torch_dist=torch_dist)
    else:  # torch_dist, or the flat ring where the placement rules hierarchical out (describe() says why)
        transport, pg = open_torch_dist(store, rank, world_size, timeout_s, torch_dist, fallback=fallback)
    return transport, pg


def resolve_transport(requested: str, placement: Placement) -> str:
    """`RINGCOMM_TRANSPORT` wins over `requested`; "auto" compares the ranks' hosts
    (RINGCOMM_HOST, else the host name): shm on one host, torch_dist when every
    rank is on a host of its own, hierarchical otherwise."""
    kind = os.environ.get("RINGCOMM_TRANSPORT", requested)
    if kind not in TRANSPORTS:
        raise ValueError(f"ringcomm: transport {kind!r} is not one of {TRANSPORTS} (RINGCOMM_TRANSPORT or transport=)")
    if kind != "auto":
        return kind
    return auto_transport(placement.hosts)
