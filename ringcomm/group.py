"""Groups: a set of ranks, the transport that connects them, and the comm
thread that runs their asynchronous collectives in launch order."""
from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .transport.base import Transport
from .transport.shm import ShmOptions, ShmTransport
from .transport.torch_dist import TorchDistOptions, TorchDistTransport
from .work import Work

TRANSPORTS = ("auto", "shm", "torch_dist")
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class GroupOptions:
    transport: str = "auto"  # RINGCOMM_TRANSPORT in the environment overrides it
    timeout_s: float = DEFAULT_TIMEOUT_S
    shm: ShmOptions = field(default_factory=ShmOptions)
    torch_dist: TorchDistOptions = field(default_factory=TorchDistOptions)


class Group:
    """Ranks 0..world_size-1 of a ringcomm group and how they talk."""

    def __init__(self, transport: Transport, pg: dist.ProcessGroup | None, global_ranks: tuple[int, ...]) -> None:
        self.transport = transport
        self.pg = pg
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.global_ranks = global_ranks
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    def run(self, op: str, fn: Callable[[], None], async_op: bool) -> Work | None:
        """Runs a collective: inline when nothing is queued and the caller waits,
        else on the group's comm thread after everything launched before it.
        One thread launches a group's collectives (as with NCCL communicators)."""
        if not async_op and self._last is None:
            fn()
            return None
        timing: list[float] = []

        def timed() -> None:
            timing.append(time.perf_counter())
            try:
                fn()
            finally:
                timing.append(time.perf_counter())

        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ringcomm-r{self.rank}")
            future = self._executor.submit(timed)
            self._last = future
        future.add_done_callback(self._forget)
        work = Work(future, op, self.rank, timing)
        if not async_op:
            work.wait()
            return None
        return work

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            if self._last is future:
                self._last = None

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Collective: a 1-D tensor that this group's collectives can use without
        staging copies (shared memory on the shm transport; plain memory elsewhere)."""
        allocate = getattr(self.transport, "allocate", None)
        if allocate is None:
            return torch.empty(numel, dtype=dtype)
        result: list[torch.Tensor] = []
        self.run("allocate", lambda: result.append(allocate(numel, dtype)), async_op=False)
        return result[0]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.transport.close()

    def __repr__(self) -> str:
        return f"ringcomm.Group(rank={self.rank}, world_size={self.world_size}, transport={self.transport.kind})"


def create_group(store: dist.Store, rank: int, world_size: int, *, options: GroupOptions,
                 pg: dist.ProcessGroup | None = None, global_ranks: tuple[int, ...] | None = None) -> Group:
    """Collective over the group's ranks: builds the transport, rendezvousing through
    `store` (a store private to this group). `pg` is the process group torch_dist
    rides on; without one, a gloo group is made on `store`."""
    kind = resolve_transport(store, rank, world_size, options.transport)
    if kind == "shm":
        transport: Transport = ShmTransport.create(dist.PrefixStore("shm/", store), rank, world_size, options.timeout_s,
                                                   options.shm)
    else:
        if pg is None:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size,
                                       timedelta(seconds=options.timeout_s))
        transport = TorchDistTransport(pg, options.timeout_s, options.torch_dist, dist.PrefixStore("torch_dist/", store))
    return Group(transport, pg, global_ranks or tuple(range(world_size)))


def resolve_transport(store: dist.Store, rank: int, world_size: int, requested: str) -> str:
    """`RINGCOMM_TRANSPORT` wins over `requested`; "auto" is shm when every rank
    is on this host (same host name), torch_dist otherwise."""
    kind = os.environ.get("RINGCOMM_TRANSPORT", requested)
    if kind not in TRANSPORTS:
        raise ValueError(f"ringcomm: transport {kind!r} is not one of {TRANSPORTS} (RINGCOMM_TRANSPORT or transport=)")
    if kind != "auto":
        return kind
    store.set(f"host/{rank}", socket.gethostname())
    hosts = {store.get(f"host/{r}").decode() for r in range(world_size)}
    return "shm" if len(hosts) == 1 else "torch_dist"


def new_group(ranks: list[int] | None = None, *, transport: str = "auto", timeout: float | timedelta = DEFAULT_TIMEOUT_S,
              shm: ShmOptions | None = None, torch_dist: TorchDistOptions | None = None) -> Group | None:
    """A ringcomm group over `ranks` (default: all) of the initialized default
    torch.distributed group. Like dist.new_group, every rank must call it, in the
    same order; ranks outside `ranks` get None. `timeout` (seconds) bounds every
    wait of every collective of the group."""
    if not dist.is_initialized():
        raise RuntimeError("ringcomm.new_group: call torch.distributed.init_process_group first")
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if timeout_s <= 0:
        raise ValueError(f"ringcomm.new_group: timeout={timeout_s} s must be > 0")
    options = GroupOptions(transport, timeout_s, shm or ShmOptions(), torch_dist or TorchDistOptions())
    pg = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    store = dist.PrefixStore(f"ringcomm/{dist.distributed_c10d._get_group_tag(pg)}/{pg.group_name}/",
                             dist.distributed_c10d._get_default_store())
    global_ranks = tuple(dist.get_process_group_ranks(pg))
    return create_group(store, pg.rank(), pg.size(), options=options, pg=pg, global_ranks=global_ranks)


_default_groups: dict[int, Group] = {}


def default_group() -> Group:
    """The ringcomm group over the whole default torch.distributed group, made on
    first use (by the first collective every rank calls with group=None)."""
    if not dist.is_initialized():
        raise RuntimeError("ringcomm: torch.distributed is not initialized; call init_process_group or pass group=")
    world = dist.group.WORLD
    key = id(world)
    if key not in _default_groups:
        _default_groups[key] = new_group()
    return _default_groups[key]


def destroy_default_group() -> None:
    for group in _default_groups.values():
        group.close()
    _default_groups.clear()
