"""Where a snapshot's copies go and how they travel ([Note: in-memory snapshots]
in snapshot.py): the placement of ranks on hosts, each rank's buddy, and
piece directories sent to a buddy on another host over a gloo group of their
own (the bytes, received straight into the buddy's /dev/shm; on one host the
piece's rank writes the copy itself: snapshot.py). The group is gloo's, made on
the attempt-scoped store ([Note: attempt-scoped keys] in
ringcomm/core/attempt.py: torch's new_group keys are not, so a restarted
attempt would meet the dead one's addresses), and runs only send and recv,
which gloo runs on the caller's thread; what every rank must learn (the
hostnames, a resume's inventory) goes through the store (barrier.py). Kept
from one snapshot to the next: the files' mappings and the thread that
finishes each snapshot (Worker).

[Note: buddies]
Hosts are ordered by their first rank. The buddy of the i-th rank of host h
is the (i mod n)-th rank of host h+1 (mod the number of hosts), n that
host's rank count, so every host holds a copy of the previous host's ranks'
pieces and a lost host's pieces survive on its successor. On one host the
buddy is the next local rank: a second copy in another rank's segment,
which covers a damaged piece, not the host's loss. A world of one rank has
no buddy.
"""
from __future__ import annotations

import ast
import itertools
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ringcomm.backend.forwarding import ForwardingGloo
from ringcomm.core import compat

from .barrier import store_gather

_WIRES = itertools.count()  # each engine's snapshots get their own keys (every rank makes them in one order)


@dataclass(frozen=True, slots=True)
class Placement:
    """Which host each rank is on (hosts by first rank) and each rank's buddy."""

    hosts: tuple[tuple[int, ...], ...]  # the ranks of each host, hosts in order of their first rank

    @classmethod
    def gather(cls, timeout_s: float) -> Placement:
        return cls.of(store_gather("zero snapshots: the placement", timeout_s, socket.gethostname()))

    @classmethod
    def of(cls, hostnames: list[str]) -> Placement:
        hosts: dict[str, list[int]] = {}
        for rank, name in enumerate(hostnames):
            hosts.setdefault(name, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in hosts.values()))

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    def first_local(self, rank: int) -> int:
        """The lowest rank on `rank`'s host: the one that arranges the host's files."""
        return self.hosts[self.host_of(rank)][0]

    def buddy(self, rank: int) -> int | None:
        """[Note: buddies]"""
        h = self.host_of(rank)
        i = self.hosts[h].index(rank)
        if len(self.hosts) > 1:
            nxt = self.hosts[(h + 1) % len(self.hosts)]
            return nxt[i % len(nxt)]
        local = self.hosts[h]
        return local[(i + 1) % len(local)] if len(local) > 1 else None

    def sources(self, rank: int) -> list[int]:
        """The ranks whose buddy `rank` is."""
        return [r for ranks in self.hosts for r in ranks if self.buddy(r) == rank]

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of(a) == self.host_of(b)


class Wire:
    """The snapshots' own gloo group, for send and recv only; released at exit
    or with its owner ([Note: forwarded works at exit] in ringcomm/backend/forwarding.py)."""

    def __init__(self, owner: object, rank: int, world_size: int, timeout_s: float) -> None:
        store = dist.PrefixStore(f"zero/snapshots/{next(_WIRES)}/", compat.default_store())
        self._gloo = ForwardingGloo(owner, store, rank, world_size, timedelta(seconds=timeout_s))

    def isend(self, tensor: torch.Tensor, dst: int):
        return self._gloo.backend.send([tensor], dst, 0)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._gloo.backend.recv([tensor], src, 0).wait()

    def release(self) -> None:
        self._gloo.release()


def piece_files(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


KEEP_NBYTES = 1 << 20


class Mappings:
    """Shared mappings of the snapshots' files, kept from one snapshot to the
    next: a piece's files are overwritten in place and renamed, never
    replaced, so the same inode comes back two snapshots later and its pages
    are not faulted in again (on this machine a 560 MB copy into a kept
    mapping takes 35 ms, into a new one 105)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: dict[tuple[int, int, int], torch.Tensor] = {}  # (device, inode, size) -> mapping

    def __call__(self, path: str, nbytes: int) -> torch.Tensor:
        """`path`'s bytes, the file sized to nbytes first (an existing one keeps
        its pages); kept when it is a shard file's size (KEEP_NBYTES or more)."""
        with open(path, "r+b" if os.path.isfile(path) else "wb") as f:
            f.truncate(nbytes)
            info = os.fstat(f.fileno())
        key = (info.st_dev, info.st_ino, nbytes)
        mapping = self._kept.pop(key, None)
        if mapping is None:
            mapping = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        if nbytes < KEEP_NBYTES:
            return mapping
        self._kept[key] = mapping  # the most recent last
        while len(self._kept) > self.capacity:
            self._kept.pop(next(iter(self._kept)))
        return mapping

    def clear(self) -> None:
        self._kept.clear()


class Worker:
    """One daemon thread that finishes the snapshots, one at a time (a thread
    started per snapshot cost ~2 ms of the step, on 2 busy cores)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable, *args) -> None:
        """Runs job(*args) on the thread; the caller waits for the job before (wait())."""
        self._idle.clear()
        self._jobs.put((job, args))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
            self._thread.start()

    def wait(self) -> None:
        """Returns once the job submitted last has returned."""
        self._idle.wait()

    def stop(self) -> None:
        """Ends the thread once its job is done."""
        if self._thread is not None:
            self._jobs.put((None, ()))
            self._thread = None

    def _run(self) -> None:
        while True:
            job, args = self._jobs.get()
            if job is None:
                return
            try:
                job(*args)
            finally:
                self._idle.set()


def send_piece(directory: str, dst: int, wire: Wire, mappings: Mappings) -> list:
    """Starts sending the piece in `directory` to rank `dst`: its files' names
    and bytes; returns the works to wait on. Pairs
    with recv_piece; sends start before receives, so buddies in a cycle do
    not wait on each other."""
    names = piece_files(directory) if os.path.isdir(directory) else []
    header = {"files": [(n, os.path.getsize(os.path.join(directory, n))) for n in names]}
    data = torch.frombuffer(bytearray(repr(header).encode()), dtype=torch.uint8)
    tensors = [torch.tensor([data.numel()], dtype=torch.int64), data]
    tensors += [mappings(os.path.join(directory, n), nbytes) for n, nbytes in header["files"] if nbytes]
    return [(wire.isend(t, dst), t) for t in tensors]


def recv_piece(directory: str, src: int, wire: Wire, mappings: Mappings) -> None:
    """Receives the piece send_piece sent into `directory` (files received
    straight into it)."""
    size = torch.empty(1, dtype=torch.int64)
    wire.recv(size, src)
    data = torch.empty(int(size), dtype=torch.uint8)
    wire.recv(data, src)
    header = ast.literal_eval(bytes(data.numpy()).decode())
    os.makedirs(directory, exist_ok=True)
    for name, nbytes in header["files"]:
        path = os.path.join(directory, name)
        if not nbytes:
            open(path, "wb").close()
        else:
            wire.recv(mappings(path, nbytes), src)


def wait_all(works: list) -> None:
    for work, _tensor in works:  # the tensor is kept alive until its send is done
        work.wait()
