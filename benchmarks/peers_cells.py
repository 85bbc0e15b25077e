"""The cells of peers.py: each peer's call per op on shared buffers, the
closed-form check of its result, and the timing of one cell (op, size, peer).

Every op runs on float32 buffers: all_reduce in place on `full`,
reduce_scatter from `full` into `chunk`, all_gather from `chunk` into `full`
(torch's reduce_scatter_tensor / all_gather_into_tensor argument order; dist.*
runs them under their torch 2.13 names, reduce_scatter_single / all_gather_single,
where torch has those)."""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ringcomm
from bus_bw_cases import GATHER, SCATTER
from ringcomm import _C

# Column order of the table; "memcpy" and "dist_floor" are limit lines, not collectives:
# a copy of the buffer, and dist.* into a backend that does nothing (its result is not checked).
PEERS = ("rc_plain", "rc_window", "rc_dist", "dist_floor", "mpi", "deepspeed", "gloo", "memcpy")
NO_RESULT = ("dist_floor",)  # peers whose calls change no tensor
BEST_OF = ("mpi", "deepspeed", "gloo")  # the peers ringcomm is compared with
POINT_TO_POINT = ("send_recv",)  # a ping-pong: each call is a round trip of one message
PEER_OPS = {"deepspeed": ("all_reduce",), "rc_window": ("all_reduce", "reduce_scatter", "all_gather"),
            "dist_floor": ("all_reduce", "reduce_scatter", "all_gather")}  # not every op
DTYPE = torch.float32


@dataclass
class Handles:
    """What the peers run on, made once per rank (None: that peer is off)."""
    group: ringcomm.Group | None = None  # ringcomm.new_group(): rc_plain, rc_window
    backend_group: dist.ProcessGroup | None = None  # dist.new_group(backend="ringcomm"): rc_dist
    floor_group: dist.ProcessGroup | None = None  # peers_setup.floor_backend(): dist_floor
    mpi_comm: object = None  # mpi4py's COMM_WORLD
    mpi: object = None  # the mpi4py.MPI module
    deepspeed_comm: object = None  # deepspeed.comm, initialized with its shm op


@dataclass
class Buffers:
    """One size's buffers: plain tensors (shared by every peer but rc_window,
    each refills them before use) and ringcomm windows."""
    numel: int
    full: torch.Tensor
    chunk: torch.Tensor
    window_full: torch.Tensor | None
    window_chunk: torch.Tensor | None
    scratch: torch.Tensor | None  # memcpy's destination (rank 0 only)


def numel_for(nbytes: int, world_size: int) -> int:
    """Whole float32 elements, a multiple of world_size, at least world_size."""
    return max(world_size, nbytes // DTYPE.itemsize // world_size * world_size)


def make_buffers(nbytes: int, handles: Handles, rank: int, world_size: int, windows: bool) -> Buffers:
    """Collective when `windows` (ringcomm.empty is)."""
    numel = numel_for(nbytes, world_size)
    window_full = window_chunk = None
    if windows:
        window_full = ringcomm.empty(numel, dtype=DTYPE, group=handles.group)
        window_chunk = ringcomm.empty(numel // world_size, dtype=DTYPE, group=handles.group)
    scratch = torch.empty(numel, dtype=DTYPE) if rank == 0 else None
    return Buffers(numel, torch.empty(numel, dtype=DTYPE), torch.empty(numel // world_size, dtype=DTYPE),
                   window_full, window_chunk, scratch)


# -- the calls -------------------------------------------------------------------------
def make_call(peer: str, op: str, bufs: Buffers, handles: Handles, rank: int) -> Callable[[], object]:
    """The one collective call that is timed for (peer, op)."""
    full, chunk = (bufs.window_full, bufs.window_chunk) if peer == "rc_window" else (bufs.full, bufs.chunk)
    if op == "send_recv" and peer != "memcpy":
        return _ping_pong(peer, full, handles, rank)
    if peer in ("rc_plain", "rc_window"):
        group = handles.group
        return {"all_reduce": lambda: ringcomm.all_reduce(full, group=group),
                "reduce_scatter": lambda: ringcomm.reduce_scatter(chunk, full, group=group),
                "all_gather": lambda: ringcomm.all_gather(full, chunk, group=group)}[op]
    if peer in ("rc_dist", "dist_floor", "gloo"):
        group = {"rc_dist": handles.backend_group, "dist_floor": handles.floor_group}.get(peer)
        return {"all_reduce": lambda: dist.all_reduce(full, group=group),
                "reduce_scatter": lambda: SCATTER(chunk, full, group=group),
                "all_gather": lambda: GATHER(full, chunk, group=group)}[op]
    if peer == "mpi":
        return _mpi_call(op, full, chunk, handles)
    if peer == "deepspeed":
        return lambda: handles.deepspeed_comm.inference_all_reduce(full)
    if peer == "memcpy":  # rank 0 copies; the others have nothing to do
        dst, src, nbytes = bufs.scratch, full, full.numel() * DTYPE.itemsize
        return (lambda: _C.copy(dst.data_ptr(), src.data_ptr(), nbytes)) if rank == 0 else (lambda: None)
    raise ValueError(f"peers: unknown peer {peer!r}")


def _mpi_call(op: str, full: torch.Tensor, chunk: torch.Tensor, handles: Handles) -> Callable[[], object]:
    """mpi4py on numpy views of the torch tensors (no copies), buffer specs built once."""
    mpi, comm = handles.mpi, handles.mpi_comm
    full_spec, chunk_spec = [full.numpy(), mpi.FLOAT], [chunk.numpy(), mpi.FLOAT]
    return {"all_reduce": lambda: comm.Allreduce(mpi.IN_PLACE, full_spec),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(full_spec, chunk_spec),
            "all_gather": lambda: comm.Allgather(chunk_spec, full_spec)}[op]


def partner(rank: int, world_size: int) -> int | None:
    """send_recv's pairs (0, 1), (2, 3), ...; an odd last rank has none."""
    other = rank ^ 1
    return other if other < world_size else None


def _ping_pong(peer: str, buffer: torch.Tensor, handles: Handles, rank: int) -> Callable[[], object]:
    """The even rank of a pair sends `buffer` and receives it back into itself; the odd one echoes it."""
    other = partner(rank, dist.get_world_size())
    if other is None:
        return lambda: None
    if peer == "mpi":
        comm, spec = handles.mpi_comm, [buffer.numpy(), handles.mpi.FLOAT]
        send, recv = (lambda: comm.Send(spec, dest=other)), (lambda: comm.Recv(spec, source=other))
    elif peer == "rc_plain":
        p2p = handles.group.transport.p2p
        send, recv = (lambda: p2p.isend(buffer, other, 0).wait()), (lambda: p2p.irecv(buffer, other, 0).wait())
    else:  # rc_dist, gloo
        group = handles.backend_group if peer == "rc_dist" else None
        send, recv = (lambda: dist.send(buffer, other, group=group)), (lambda: dist.recv(buffer, other, group=group))
    first, second = (send, recv) if rank % 2 == 0 else (recv, send)
    return lambda: (first(), second())


# -- the closed-form check ------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def periodic(numel: int, scale: int) -> torch.Tensor:
    """scale * (1 + i % 13) for i < numel, exact in float32. Tiled, not computed
    with an int64 `%` (seconds per 128 MiB on one thread); cached for the
    size's cells (read only)."""
    period = torch.arange(1, 14, dtype=DTYPE) * scale
    return period.repeat(-(-numel // 13))[:numel]


def pattern(rank: int, numel: int) -> torch.Tensor:
    """Rank r's data: (r + 1) * (1 + i % 13)."""
    return periodic(numel, rank + 1)


def fill_inputs(peer: str, op: str, bufs: Buffers, rank: int) -> None:
    full, chunk = (bufs.window_full, bufs.window_chunk) if peer == "rc_window" else (bufs.full, bufs.chunk)
    if op == "send_recv":  # the even rank's pattern goes to the odd one and back
        if rank % 2 == 0:
            full.copy_(pattern(rank, full.numel()))
        else:
            full.zero_()
    elif op == "all_gather":
        chunk.copy_(pattern(rank, chunk.numel()))
        full.zero_()
    else:
        full.copy_(pattern(rank, full.numel()))
        chunk.zero_()


def expected_result(peer: str, op: str, bufs: Buffers, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(where the result lands, what it must be)."""
    full, chunk = (bufs.window_full, bufs.window_chunk) if peer == "rc_window" else (bufs.full, bufs.chunk)
    n = world_size
    if peer == "memcpy":
        return (bufs.scratch, full) if rank == 0 else (full[:0], full[:0])
    if op == "send_recv":
        other = partner(rank, world_size)
        return (full, full.new_zeros(full.shape)) if other is None else (full, pattern(rank - rank % 2, full.numel()))
    if op == "all_gather":
        return full, torch.cat([pattern(r, chunk.numel()) for r in range(n)])
    reduced = periodic(bufs.numel, n * (n + 1) // 2)
    if op == "reduce_scatter":
        return chunk, reduced[rank * chunk.numel():(rank + 1) * chunk.numel()]
    return full, reduced


def count_wrong(peer: str, op: str, bufs: Buffers, call: Callable[[], object], rank: int, world_size: int) -> int:
    """Runs the call once on the pattern; elements wrong on any rank (a collective).
    A peer of NO_RESULT has none to check: 0."""
    fill_inputs(peer, op, bufs, rank)
    call()
    if peer in NO_RESULT:
        return 0
    actual, expected = expected_result(peer, op, bufs, rank, world_size)
    if actual.shape != expected.shape:
        wrong = torch.tensor([-1])
    else:
        wrong = torch.tensor([0 if torch.equal(actual, expected) else int((actual != expected).sum())])
    dist.all_reduce(wrong)
    return int(wrong)


def zero_inputs(peer: str, op: str, bufs: Buffers) -> None:
    """Timing data: zeros, so that repeated in-place sums never overflow to inf."""
    full = bufs.window_full if peer == "rc_window" else bufs.full
    if op == "all_reduce" or peer == "memcpy":
        full.zero_()


# -- timing ----------------------------------------------------------------------------
def slowest(seconds: float) -> float:
    """The slowest rank's value: it sets the pace of a collective."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, dist.ReduceOp.MAX)
    return float(value)


def run_timed(call: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return time.perf_counter() - start


def calibrate(call: Callable[[], object], budget_s: float, max_iters: int) -> int:
    """Iterations that fill `budget_s`: one warm-up call (page faults, set-up),
    then batches growing x4 until one takes a tenth of the budget. Every rank
    gets the same count (the slowest rank's timings decide)."""
    call()
    batch = 1
    while True:
        elapsed = slowest(run_timed(call, batch))
        if elapsed >= budget_s / 10 or batch >= max_iters:
            break
        batch *= 4
    return max(1, min(max_iters, math.ceil(budget_s * batch / max(elapsed, 1e-9))))


def time_cell(call: Callable[[], object], iters: int) -> float:
    """Seconds per call: a few warm-up calls, the ranks lined up by a barrier,
    then `iters` calls; the slowest rank's average."""
    run_timed(call, max(1, min(iters // 10, 100)))
    dist.barrier()
    return slowest(run_timed(call, iters) / iters)
