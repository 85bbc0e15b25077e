"""One rank of peers.py: set up every peer asked for (or say why it is off),
then the interleaved rounds of every size x op x peer."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from peers_cells import (PEER_OPS, Handles, calibrate, count_wrong, make_buffers, make_call, time_cell,
                         zero_inputs)
from machine import cpu_line
from peers_setup import build_deepspeed_op, floor_backend, load_deepspeed_comm


def set_up_peers(args, rank: int, world_size: int) -> tuple[Handles, list[str], dict[str, str], dict]:
    """(handles, the peers that run, {peer: why it is off}, the header's facts).
    Collective: every rank makes the same groups in the same order."""
    handles, notes = Handles(), {}
    timeout = timedelta(seconds=args.timeout)
    if {"rc_plain", "rc_window"} & set(args.peers):
        handles.group = ringcomm.new_group(timeout=args.timeout)
    if "rc_dist" in args.peers:
        handles.backend_group = dist.new_group(backend="ringcomm", timeout=timeout)
    if "dist_floor" in args.peers:
        handles.floor_group = floor_backend()
    if "mpi" in args.peers:
        _set_up_mpi(args, handles, notes, rank, world_size)
    if "deepspeed" in args.peers:
        _set_up_deepspeed(args, handles, notes, rank, world_size)
    peers = [p for p in args.peers if p not in notes]
    return handles, peers, notes, _facts(args, handles, world_size)


def _set_up_mpi(args, handles: Handles, notes: dict[str, str], rank: int, world_size: int) -> None:
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        notes["mpi"] = args.mpi_note or "ranks not started by mpirun"
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (rank, world_size):
        raise RuntimeError(f"peers: MPI rank {comm.Get_rank()}/{comm.Get_size()} != torch rank {rank}/{world_size}")
    handles.mpi, handles.mpi_comm = MPI, comm


def _set_up_deepspeed(args, handles: Handles, notes: dict[str, str], rank: int, world_size: int) -> None:
    """Rank 0 builds (or finds) the op with a timeout; every rank loads it or none does."""
    result = [build_deepspeed_op(args.ds_build_timeout) if rank == 0 else None]
    dist.broadcast_object_list(result, src=0)
    path, note = result[0]
    if path is None:
        notes["deepspeed"] = note
        if rank == 0:
            print(f"# DeepSpeed shm column '-': {note}", flush=True)
        return
    handles.deepspeed_comm = load_deepspeed_comm(path, world_size)


def _version(package: str) -> str:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(package)
    return "-"


def _facts(args, handles: Handles, world_size: int) -> dict:
    transport = handles.group.transport if handles.group is not None else None
    describe = getattr(transport, "describe", lambda: getattr(transport, "kind", "-"))
    mpi_library = handles.mpi.Get_library_version().splitlines()[0].split(",")[0] if handles.mpi else "-"
    mca = " ".join(f"{k[9:]}={v}" for k, v in sorted(os.environ.items()) if k.startswith("OMPI_MCA_") and
                   k[9:] in ("pml", "btl", "smsc", "mpi_yield_when_idle"))
    return {"host": platform.node(), "cpus": os.cpu_count(), "cpu": cpu_line(), "world_size": world_size,
            "torch": torch.__version__, "open_mpi": mpi_library, "mpi4py": _version("mpi4py"),
            "deepspeed": _version("deepspeed"), "ringcomm_transport": describe() if transport else "-",
            "launch": f"mpirun ({mca}; {_ptrace_scope()})" if "OMPI_COMM_WORLD_RANK" in os.environ
            else args.launched_by}


def _ptrace_scope() -> str:
    """What decides whether CMA (process_vm_readv between sibling ranks) may work."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f"yama ptrace_scope {f.read().strip()}"
    except OSError:
        return "no yama ptrace_scope"


# -- the rounds ------------------------------------------------------------------------------
def measure(args, handles: Handles, peers: list[str], rank: int, world_size: int, *, contended: bool,
            busy: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> dict:
    """{(op, nbytes, peer): {"seconds": [per round], "iters": n, "wrong": w}}.
    Round r: every size x op x peer once; `busy` runs around each round."""
    cells: dict = {}
    for round_index in range(args.rounds):
        start = time.monotonic()
        with busy():
            dist.barrier()
            for nbytes in args.sizes:
                if rank == 0 and sys.stderr.isatty():
                    print(f"# {'contended' if contended else 'quiet'} round {round_index + 1}/{args.rounds}: "
                          f"{nbytes} B", file=sys.stderr, flush=True)
                _measure_size(args, handles, peers, cells, nbytes, round_index, rank, world_size)
        if rank == 0:
            phase = "contended" if contended else "quiet"
            print(f"# {phase} round {round_index + 1}/{args.rounds} done in {time.monotonic() - start:.0f} s", flush=True)
    return cells


def _measure_size(args, handles: Handles, peers: list[str], cells: dict, nbytes: int, round_index: int,
                  rank: int, world_size: int) -> None:
    bufs = make_buffers(nbytes, handles, rank, world_size, windows="rc_window" in peers)
    plan = [(op, peer) for op in args.ops for peer in _rotated(peers, op, round_index) if peer != "memcpy"]
    if "memcpy" in peers:
        plan.insert(round_index % (len(plan) + 1), ("copy", "memcpy"))
    for op, peer in plan:
        call = make_call(peer, op, bufs, handles, rank)
        cell = cells.setdefault((op, nbytes, peer), {"seconds": []})
        if "wrong" not in cell:  # once per size, on the first round
            cell["wrong"] = count_wrong(peer, op, bufs, call, rank, world_size)
        zero_inputs(peer, op, bufs)
        if "iters" not in cell:
            cell["iters"] = calibrate(call, args.budget_s, args.max_iters)
        cell["seconds"].append(time_cell(call, cell["iters"]))


def _rotated(peers: list[str], op: str, round_index: int) -> list[str]:
    """The peers that run `op`, in an order that rotates per round, so that no
    peer always runs right after the same neighbour."""
    mine = [p for p in peers if op in PEER_OPS.get(p, (op,))]
    shift = round_index % max(1, len(mine))
    return mine[shift:] + mine[:shift]
