"""Where the bytes a rank sends go: to ranks on its own host or across hosts,
by a model of each transport's schedule (engine.wire_report()).

[Note: wire model]
S is a collective's whole size in the bytes it moves (an all-gather's output,
a reduce-scatter's input; a quantized one's rows), N = H hosts x L ranks.
    flat ring (torch_dist; shm on one host): (N-1)/N S to the right-hand
        neighbour (twice for all_reduce): across hosts if that neighbour is
        on another host, else inside. torch_dist's ring sends the partial
        sums of 16-bit floats in float32 (ringcomm/algorithms/ring.py): its
        reduce_scatter counts them twice, its all_reduce 2 + 1 times (the
        all-gather phase moves 16 bits); shm stages them as they are.
    hierarchical all_gather: (H-1) S/N across, (L-1) H S/N inside;
        reduce_scatter the same, 16-bit floats counted twice (they cross in
        float32); all_reduce 2 (H-1) S/N across (twice for 16-bit floats),
        (L-1)/L S inside for the local all-gather and as much again for the
        local reduce-scatter (twice for 16-bit floats); an all_reduce of up
        to the transport's whole_max_nbytes is a local and a cross-host
        all-reduce of all of it, 2 (L-1)/L S inside and 2 (H-1)/H S across
        (twice for 16-bit floats).
sent = inside + across.
    quantized reduce_scatter (all-to-alls): one level, S/N to each other rank
        (across for those on other hosts); two levels, as hierarchical
        all_gather (ringcomm/comm/quantized.py [Note: quantized reduce-scatter]).
Small all_reduces (the gradient norm) take another route; they are a few bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # wire.py stays free of torch: the model is arithmetic
    import ringcomm


@dataclass(frozen=True, slots=True)
class WireReport:
    """Bytes this rank sent in the last step, by where they went."""

    sent_nbytes: int
    inside_host_nbytes: int
    across_host_nbytes: int


@dataclass(frozen=True, slots=True)
class Topology:
    """A comm's ranks and hosts (host of each group rank) and how its transport moves bytes."""

    rank: int
    hosts: tuple[str, ...]
    hierarchical: bool
    widens: bool = False  # a flat ring that sends 16-bit partial sums in float32 (torch_dist's)
    whole_max_nbytes: int = 0  # hierarchical: all_reduces up to this size skip the shards

    @classmethod
    def of_group(cls, group: ringcomm.Group) -> Topology:
        """A ringcomm group's: its placement (the hosts it exchanged at set-up) and
        how its transport moves bytes."""
        transport = group.transport
        hierarchical = transport.kind == "hierarchical"
        return cls(group.rank, group.placement.hosts, hierarchical=hierarchical, widens=transport.kind == "torch_dist",
                   whole_max_nbytes=transport.whole_max_nbytes if hierarchical else 0)

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))

    def split(self, kind: str, nbytes: int, *, widened: bool = False, all_to_all: bool = False) -> tuple[int, int]:
        """(inside, across) bytes this rank sends for one collective of `nbytes` ([Note: wire model])."""
        n, h = len(self.hosts), self.num_hosts
        per_rank, local = nbytes // n, n // h
        if all_to_all and not self.hierarchical:
            across = sum(host != self.hosts[self.rank] for host in self.hosts) * per_rank
            return (n - 1) * per_rank - across, across
        if not self.hierarchical or h == 1:
            w = 2 if widened and self.widens else 1
            sent = (n - 1) * per_rank * (w + 1 if kind == "all_reduce" else w)
            right = self.hosts[(self.rank + 1) % n]
            return (sent, 0) if right == self.hosts[self.rank] else (0, sent)
        w = 2 if widened else 1
        if kind == "all_reduce" and nbytes <= self.whole_max_nbytes:
            return 2 * (local - 1) * (nbytes // local) * w, 2 * (h - 1) * (nbytes // h) * w
        if kind == "all_reduce":
            return (local - 1) * (nbytes // local) * (w + 1), 2 * (h - 1) * per_rank * w
        return (local - 1) * h * per_rank * w, (h - 1) * per_rank * w
