"""Shared-memory transport: all ranks of the group on one host (csrc/cpu/shm*.cpp).

Segment lifetime: rank 0 creates the segment (mode 0600, a name unique per
group and run), every rank maps it, and rank 0 unlinks the name as soon as all
ranks have mapped it. From then on the memory lives only in the mappings, so
nothing is left in /dev/shm however the processes end. A name left by ranks
that all died during set-up expires and is removed by the next group created on
the host (see [Note: shm names] in shm_names.py).
"""
from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _C
from ..core.arguments import INT64_MAX, check_int, check_number, flag_from_env
from ..core.host import cache_nbytes, usable_cores
from ..core.ops import DTYPE_CODES_BY_ID, ReduceOp
from . import agreement, rendezvous
from .agreement import CallKey
from .shm_names import expiry_of, new_name, remove_stale_segments
from .shm_p2p import ShmPointToPoint


MAX_NBYTES = 1 << 40  # of a slot or a one-shot message: world_size * num_slots * slot_nbytes fits int64
P2P_MIN_SLOT_NBYTES = 4 << 10  # the point-to-point slots shrink no further to fit p2p_max_nbytes
CMA_MIN_PIECE_NBYTES = 4 << 10  # csrc/cpu/shm.h kMinCmaPieceBytes


@dataclass(frozen=True, slots=True)
class ShmOptions:
    slot_nbytes: int = 1 << 20
    num_slots: int = 4
    oneshot_max_nbytes: int = 64 << 10
    spin_us: float = 50.0  # busy-wait before sleeping on a flag (0 when ranks outnumber cores)
    # Plain (not ringcomm.empty) buffers of at least this many bytes are read
    # from peers in place by cross-memory attach, where the kernel allows it
    # (csrc/cpu/shm_cma.cpp); smaller ones, or all with cma=False or
    # RINGCOMM_CMA=0, are staged through the segment. Measured here (2 ranks):
    # CMA beats staging from 64 KiB for all-gather, but reductions, which read
    # the peers' data through cache-sized pieces, only from ~2 MiB.
    cma: bool = True
    cma_min_nbytes: int = 64 << 10  # all_gather, broadcast
    cma_reduce_min_nbytes: int = 2 << 20  # all_reduce, reduce_scatter
    # A CMA reduction reads each peer's data through a piece of this many bytes;
    # None: chosen from the L2 size of this CPU (cma_piece_nbytes_for).
    cma_piece_nbytes: int | None = None
    # Point-to-point ([Note: p2p channels] in csrc/cpu/shm_p2p.cpp): a channel of
    # p2p_num_slots slots per ordered pair of ranks; the slots shrink (down to
    # 4 KiB) so that all channels together stay under p2p_max_nbytes (2 ranks:
    # 1 MiB; 8 ranks: 56 channels of 4 x 64 KiB). Sends of at least
    # p2p_cma_min_nbytes are read by the receiver from the sender's memory (CMA)
    # where the group uses CMA, else they are staged through the slots.
    p2p_slot_nbytes: int = 128 << 10
    p2p_num_slots: int = 4
    p2p_max_nbytes: int = 16 << 20
    p2p_cma_min_nbytes: int = 64 << 10

    def __post_init__(self) -> None:
        """Types and bounds, here rather than as pybind11's dump of ShmComm's
        overloads at new_group; the C++ checks what depends on world_size."""
        for name, low, high in (("slot_nbytes", 64, MAX_NBYTES), ("num_slots", 2, 1024),
                                ("oneshot_max_nbytes", 0, MAX_NBYTES), ("cma_min_nbytes", 0, INT64_MAX),
                                ("cma_reduce_min_nbytes", 0, INT64_MAX), ("p2p_slot_nbytes", 64, MAX_NBYTES),
                                ("p2p_num_slots", 2, 1024), ("p2p_max_nbytes", 0, INT64_MAX),
                                ("p2p_cma_min_nbytes", 0, INT64_MAX)):
            check_int("ShmOptions", name, getattr(self, name), low, high)
        if self.cma_piece_nbytes is not None:
            check_int("ShmOptions", "cma_piece_nbytes", self.cma_piece_nbytes, CMA_MIN_PIECE_NBYTES, MAX_NBYTES)
            if self.cma_piece_nbytes % 64:
                raise ValueError(f"ShmOptions: cma_piece_nbytes={self.cma_piece_nbytes} must be a multiple of 64")
        check_number("ShmOptions", "spin_us", self.spin_us, 0.0, 1e6)
        if not isinstance(self.cma, bool):
            raise TypeError(f"ShmOptions: cma={self.cma!r} must be a bool")
        if self.p2p_slot_nbytes % 64:
            raise ValueError(f"ShmOptions: p2p_slot_nbytes={self.p2p_slot_nbytes} must be a multiple of 64")

    def for_ranks_on_machine(self, ranks: int) -> ShmOptions:
        """These options for a group whose machine runs `ranks` ranks of it, in
        all its groups: no spinning when they outnumber the cores, or spinning
        ranks of one group starve those of another (simulated hosts)."""
        return dataclasses.replace(self, spin_us=0.0) if ranks > usable_cores() else self

    def cma_piece_nbytes_for(self, world_size: int, l2_nbytes: int | None) -> int:
        """The piece of a CMA reduction: cma_piece_nbytes, or chosen so that the
        pieces of every peer and as much of the output stay in half of the L2
        cache of one core (`l2_nbytes`; 512 KiB on AMD Zen 2, 1-2 MiB on Intel
        server cores), in 4 KiB steps between 16 KiB and 1 MiB; 128 KiB where the
        L2 size is unknown."""
        if self.cma_piece_nbytes is not None:
            return self.cma_piece_nbytes
        if not l2_nbytes:
            return 128 << 10
        return min(max(l2_nbytes // (2 * world_size) // 4096 * 4096, 16 << 10), 1 << 20)

    def p2p_slot_nbytes_for(self, world_size: int) -> int:
        """The point-to-point slot size of a group of `world_size` ranks: p2p_slot_nbytes,
        halved until all world_size * (world_size - 1) channels fit p2p_max_nbytes, but
        never below 4 KiB (nor above p2p_slot_nbytes)."""
        nbytes = self.p2p_slot_nbytes
        channels = world_size * (world_size - 1) * self.p2p_num_slots
        while channels * nbytes > self.p2p_max_nbytes and nbytes // 2 >= P2P_MIN_SLOT_NBYTES:
            nbytes //= 2
        return nbytes // 64 * 64


class ShmTransport:
    kind = "shm"
    levels = None  # one level

    def __init__(self, comm: _C.ShmComm, store: dist.Store, timeout_s: float) -> None:
        self._comm = comm
        self._store = store
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.timeout_s = timeout_s
        self._next_window = 0
        self.handle = comm._handle  # for the lean calls: see [Note: lean calls] in csrc/cpu/module_lean.cpp
        self._single_copy = "staged"
        self.p2p = ShmPointToPoint(comm, timeout_s)

    @classmethod
    def create(cls, store: dist.Store, rank: int, world_size: int, timeout_s: float, options: ShmOptions) -> ShmTransport:
        """Collective over the group's ranks: rendezvous through `store`. Every rank
        that learned the segment's name unlinks it when its set-up ends, however
        it ends ([Note: shm names] in shm_names.py)."""
        cma = options.cma and flag_from_env("RINGCOMM_CMA", True)  # a bad value fails before any wait
        cores = usable_cores()
        spin = int(options.spin_us * 1000) if world_size <= cores else 0
        args = (rank, world_size, options.slot_nbytes, options.num_slots, options.oneshot_max_nbytes, spin)
        kwargs = dict(cma_min_nbytes=options.cma_min_nbytes, cma_reduce_min_nbytes=options.cma_reduce_min_nbytes,
                      p2p_slot_nbytes=options.p2p_slot_nbytes_for(world_size), p2p_num_slots=options.p2p_num_slots,
                      p2p_cma_min_nbytes=options.p2p_cma_min_nbytes)
        if rank == 0:
            remove_stale_segments()
            name = new_name(timeout_s)
            comm = _C.ShmComm(name, *args, create=True, **kwargs)
        else:
            what = f"shm: rank {rank} waiting for rank 0 to create the segment"
            name = rendezvous.get(store, "shm/name", timeout_s, what).decode()
            _check_name(name, rank, 0)
        try:
            if rank == 0:
                _publish(store, "shm/name", name)
                rendezvous.check_in(store, "shm/attached", rank, world_size, timeout_s,
                                    f"shm: rank {rank} waiting for the ranks to map segment {name}")
                _C.ShmComm.unlink(name)  # every rank mapped it: the name has done its job
            else:
                comm = _C.ShmComm(name, *args, create=False, **kwargs)
                rendezvous.check_in(store, "shm/attached", rank, world_size, timeout_s, "shm", waiting=False)
            _confirm_setup(comm, "new_group", timeout_s)
        finally:
            _C.ShmComm.unlink(name)
        transport = cls(comm, store, timeout_s)
        transport._single_copy = _setup_single_copy(comm, options, cma, timeout_s)
        return transport

    def describe(self) -> str:
        """How this transport moves plain tensors, for benchmark headers and logs."""
        return f"shm, {self._single_copy}"

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Collective: a tensor in a window of shared memory that every rank maps,
        so collectives on it read peers' data in place (no staging copies). Every
        rank unlinks the names of all windows it learned once all ranks mapped
        them, or when it fails; the memory lives as long as the tensor (and the
        peers' mappings of it)."""
        window_id = self._next_window
        self._next_window += 1
        nbytes = max(1, numel) * torch.empty(0, dtype=dtype).element_size()
        deadline = time.monotonic() + self.timeout_s
        name = new_name(self.timeout_s)
        own = _C.ShmWindow(name, nbytes, create=True)
        names = [name]
        peers = {}
        try:
            _publish(self._store, f"window/{window_id}/{self.rank}", f"{name} {nbytes}")
            for peer in range(self.world_size):
                if peer != self.rank:
                    peers[peer] = self._map_window_of(peer, window_id, deadline, names)
            _confirm_setup(self._comm, "empty", _left(deadline))
        finally:
            for learned in names:
                _C.ShmWindow.unlink(learned)
        windows = [peers.get(r, own) for r in range(self.world_size)]
        self._comm.register_window(window_id, [w.address for w in windows], [w.nbytes for w in windows])
        # Forget the window before its memory can be reused: the finalizer runs when
        # the last tensor on it is gone, before the mapping is released.
        weakref.finalize(own, _forget_window, weakref.ref(self), window_id, peers)
        return torch.frombuffer(own, dtype=torch.uint8, count=nbytes).view(dtype)[:numel]

    def _map_window_of(self, peer: int, window_id: int, deadline: float, names: list[str]) -> _C.ShmWindow:
        """Maps `peer`'s window `window_id` once announced; appends its name to `names`."""
        what = f"empty: rank {self.rank} waiting for rank {peer} to allocate (every rank must call it)"
        name, _, nbytes = rendezvous.get(self._store, f"window/{window_id}/{peer}", _left(deadline),
                                         what).decode().partition(" ")
        _check_name(name, self.rank, peer)
        names.append(name)
        if not nbytes.isdigit():
            raise RuntimeError(f"empty: rank {self.rank}: rank {peer} announced window {name} of {nbytes!r} bytes")
        return _C.ShmWindow(name, int(nbytes), create=False)

    def supports(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    # [Note: shm mismatches] The C++ check raises _C.CallMismatch (a ValueError)
    # on every rank when the op descriptors of a call's first round differ; each
    # call here turns it into the error of [Note: call agreement], the same on
    # every rank, from the calls the segment held.
    def all_reduce(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        try:
            _C.all_reduce_lean(self.handle, output.data_ptr(), input.data_ptr(), input.numel(),
                               DTYPE_CODES_BY_ID[id(input.dtype)], op, self.timeout_s)
        except _C.CallMismatch as err:
            raise self.mismatch_error(err, "all_reduce") from None

    def reduce_scatter(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        try:
            _C.reduce_scatter_lean(self.handle, output.data_ptr(), input.data_ptr(), output.numel(),
                                   DTYPE_CODES_BY_ID[id(input.dtype)], op, self.timeout_s)
        except _C.CallMismatch as err:
            raise self.mismatch_error(err, "reduce_scatter") from None

    def all_gather(self, *, output: torch.Tensor, input: torch.Tensor, key: CallKey | None = None) -> None:
        """`key`: the caller's description of the call, compared too ([Note: call agreement])."""
        code = DTYPE_CODES_BY_ID[id(input.dtype)]
        try:
            if key is None:
                _C.all_gather_lean(self.handle, output.data_ptr(), input.data_ptr(), input.numel(), code,
                                   self.timeout_s)
            else:
                _C.all_gather_keyed(self.handle, output.data_ptr(), input.data_ptr(), input.numel(), code,
                                    key.values(), self.timeout_s)
        except _C.CallMismatch as err:
            raise self.mismatch_error(err, "all_gather", key) from None

    def all_to_all(self, *, output: torch.Tensor, input: torch.Tensor, key: CallKey | None = None) -> None:
        try:
            _C.all_to_all_keyed(self.handle, output.data_ptr(), input.data_ptr(), output.numel() // self.world_size,
                                DTYPE_CODES_BY_ID[id(input.dtype)], () if key is None else key.values(),
                                self.timeout_s)
        except _C.CallMismatch as err:
            raise self.mismatch_error(err, "all_to_all", key) from None

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        try:
            self._comm.broadcast(tensor.data_ptr(), tensor.numel(), DTYPE_CODES_BY_ID[id(tensor.dtype)], root,
                                 self.timeout_s)
        except _C.CallMismatch as err:
            raise self.mismatch_error(err, "broadcast") from None

    def barrier(self) -> None:
        try:
            self._comm.barrier(self.timeout_s)
        except _C.CallMismatch as err:
            raise self.mismatch_error(err, "barrier") from None

    def mismatch_error(self, err: ValueError, op: str, key: CallKey | None = None) -> ValueError:
        """The error for a CallMismatch of this rank's call `op` ([Note: shm
        mismatches]); C++'s own where the calls differ only in how peers reach
        the buffers (ringcomm.empty windows on some ranks only)."""
        calls = self._comm.last_calls()
        if all(call == calls[0] for call in calls):
            return err
        return agreement.disagreement(op if key is None else key.op, calls)

    def close(self, timeout_s: float | None = None) -> bool:
        """Refuses new calls, waits up to timeout_s (default: the group's timeout)
        for the one in flight, aborts it past that, and unmaps the segment; safe
        from any thread ([Note: close and abort] in csrc/cpu/shm_lifecycle.cpp).
        Returns whether the call in flight ended by itself."""
        return self._comm.close(self.timeout_s if timeout_s is None else timeout_s)

    def abort(self) -> None:
        """The call in flight fails at once ("aborted"); later calls are refused."""
        self._comm.abort()

    @property
    def broken(self) -> str:
        """Why the transport refuses work after a failure ("" while it is usable)."""
        return self._comm.broken

    def peer_aborted(self) -> str:
        """'rank N aborted the group' once a peer aborted, else "" (cheap: reads the segment)."""
        return self._comm.peer_aborted()


def _publish(store: dist.Store, key: str, name: str) -> None:
    """Tells the other ranks the name of a segment this rank created."""
    store.set(key, name)


def _check_name(name: str, rank: int, peer: int) -> None:
    """A name a peer announced is one new_name makes, so that this rank maps, and
    unlinks on failure, nothing but ringcomm's own segments."""
    if not name.startswith("/") or expiry_of(name[1:]) is None:
        raise RuntimeError(f"shm: rank {rank}: rank {peer} announced segment name {name!r}, which ringcomm does not make")


def _setup_single_copy(comm: _C.ShmComm, options: ShmOptions, cma: bool, timeout_s: float) -> str:
    """Collective: turns on cross-memory attach when `cma` (options.cma and
    RINGCOMM_CMA) and every rank can use it (the ranks agree); says which copy
    plain tensors get, and why."""
    if not cma:
        return "staged (CMA off: ShmOptions.cma=False or RINGCOMM_CMA=0)"
    l2 = cache_nbytes(2)
    piece = options.cma_piece_nbytes_for(comm.world_size, l2)
    l2_source = ("ShmOptions.cma_piece_nbytes" if options.cma_piece_nbytes is not None
                 else f"L2 {l2 >> 10} KiB" if l2 else "L2 size unknown")
    try:
        reason = comm.setup_cma(timeout_s, piece)
    except RuntimeError as err:
        raise RuntimeError(f"new_group: rank {comm.rank}: shared-memory set-up failed: {err}") from err
    if comm.world_size == 1:
        return "one rank (nothing to copy)"
    if reason:
        if comm.rank == 0:
            warnings.warn(f"ringcomm: plain tensors are staged through shared memory (two copies): cross-memory "
                          f"attach is unavailable: {reason}", RuntimeWarning, stacklevel=2)
        return f"staged (CMA unavailable: {reason})"
    return (f"single copy by CMA (process_vm_readv) from {options.cma_min_nbytes} B, reductions from "
            f"{options.cma_reduce_min_nbytes} B in pieces of {piece >> 10} KiB per peer ({l2_source})")


def _left(deadline: float) -> float:
    """Seconds until `deadline` (time.monotonic), at least a millisecond."""
    return max(deadline - time.monotonic(), 0.001)


def _confirm_setup(comm: _C.ShmComm, op: str, timeout_s: float) -> None:
    """Ends a set-up with a barrier through the segment: a peer that died after
    it announced a name is named here (by pid, at once), not at the first collective."""
    try:
        comm.barrier(timeout_s)
    except RuntimeError as err:
        raise RuntimeError(f"{op}: rank {comm.rank}: shared-memory set-up failed: {err}") from err


def _forget_window(transport_ref: weakref.ref, window_id: int, peers: dict) -> None:
    transport = transport_ref()
    if transport is not None:
        transport._comm.unregister_window(window_id)
    peers.clear()
