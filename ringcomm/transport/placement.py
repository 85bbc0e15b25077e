"""Where a group's ranks are: each rank's host, the hosts' ranks, and what
transport that placement calls for; which ranks share one machine."""
from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from . import rendezvous

HOST_ENV = "RINGCOMM_HOST"  # overrides the host name (simulated hosts in tests and benchmarks)
SETUP = "ringcomm group set-up"


def host_name() -> str:
    """This process's host as ringcomm sees it: RINGCOMM_HOST, else the host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the group's ranks are. Hosts are numbered by their lowest rank; a
    host's ranks, ascending, have local ranks 0, 1, ..."""

    hosts: tuple[str, ...]  # host name of each rank
    ranks_on: tuple[tuple[int, ...], ...]  # ranks of each host, ascending

    @property
    def num_hosts(self) -> int:
        return len(self.ranks_on)

    @property
    def local_world_size(self) -> int:
        return len(self.ranks_on[0])

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.ranks_on) if rank in ranks)

    def local_rank_of(self, rank: int) -> int:
        return self.ranks_on[self.host_of(rank)].index(rank)

    def unsupported(self) -> str:
        """Why the hierarchical algorithms cannot run here ("" when they can)."""
        counts = [len(ranks) for ranks in self.ranks_on]
        if len(set(counts)) > 1:
            return f"hosts hold unequal numbers of ranks {counts}"
        if counts[0] == 1:
            return "every rank is on its own host"
        if len(counts) == 1:
            return "all ranks are on one host"
        return ""

    def is_host_major(self) -> bool:
        return all(consecutive(ranks) for ranks in self.ranks_on)


def plan_placement(hosts: Sequence[str]) -> Placement:
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    return Placement(tuple(hosts), tuple(tuple(ranks) for ranks in by_host.values()))


def auto_transport(hosts: Sequence[str]) -> str:
    """shm on one host, torch_dist when every rank has a host of its own,
    hierarchical in between."""
    num_hosts = len(set(hosts))
    if num_hosts == 1:
        return "shm"
    return "torch_dist" if num_hosts == len(hosts) else "hierarchical"


def exchange_hosts(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> list[str]:
    """Collective: every rank's host name, through the group's store."""
    store.set(f"host/{rank}", host_name())
    rendezvous.wait_for(store, [f"host/{r}" for r in range(world_size)], timeout_s,
                        f"{SETUP}: rank {rank} waiting for every rank's host name")
    return [store.get(f"host/{r}").decode() for r in range(world_size)]


def ranks_on_this_machine(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> int:
    """Collective: how many of the group's ranks run on this rank's machine. With
    simulated hosts (RINGCOMM_HOST, or namespaces with their own host names)
    several hosts share one machine. A machine is its kernel: the boot id, which
    network and UTS namespaces share."""
    here = _machine_id()
    store.set(f"machine/{rank}", here)
    rendezvous.wait_for(store, [f"machine/{r}" for r in range(world_size)], timeout_s,
                        f"{SETUP}: rank {rank} waiting for every rank's machine name")
    return sum(store.get(f"machine/{r}").decode() == here for r in range(world_size))


def _machine_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def consecutive(ranks: tuple[int, ...]) -> bool:
    return ranks == tuple(range(ranks[0], ranks[0] + len(ranks)))
