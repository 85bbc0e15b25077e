"""all_reduce, reduce_scatter and all_gather through torch.distributed on the
reference backend and on the "ringcomm" backend, one rank per device: each
result checked against its closed form, then timed.

    python benchmarks/gpu_collectives.py                      # CUDA: one rank per GPU, NCCL vs ringcomm
    python benchmarks/gpu_collectives.py --device cpu --nproc 2 --sizes 4K   # the same code on CPU (gloo)

On CUDA tensors the ringcomm backend forwards every call to its internal NCCL
group, so both columns run NCCL; this checks that forwarding path and prices it.
Times are rank 0's mean over --iters calls after --warmup calls, the device
synchronized before and after; busbw = algbw * 2(n-1)/n (all_reduce) or
algbw * (n-1)/n (reduce_scatter, all_gather), 0 on one rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bus_bw import parse_size  # noqa: E402
from launch import launch  # noqa: E402

from ringcomm.plan.schedule import bus_factor

OPS = ("all_reduce", "reduce_scatter", "all_gather")
REFERENCE = {"cuda": "nccl", "cpu": "gloo"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=sorted(REFERENCE))
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: CUDA devices on cuda, 2 on cpu)")
    p.add_argument("--sizes", default="1M,128M", help="comma-separated full-buffer sizes in bytes (K, M, G)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one collective may take")
    p.add_argument("--json", default=None, help="write every row here")
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if not args.sizes or min(args.sizes) < 4:
        p.error(f"--sizes: need sizes of at least 4 bytes, got {args.sizes}")
    return args


def rank_count(args: argparse.Namespace) -> int:
    """--nproc, or one rank per CUDA device; a CUDA run without a device is refused."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("gpu_collectives: --device cuda but torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    if args.nproc is not None:
        return args.nproc
    return 2 if args.device == "cpu" else torch.cuda.device_count()


def fill_and_run(op: str, full, shard, group, rank: int) -> None:
    """Sets the inputs for the closed form (rank r contributes r + 1), runs `op` once."""
    if op == "all_gather":
        shard.fill_(rank + 1)
    else:
        full.fill_(rank + 1)
    run_once(op, full, shard, group)


def run_once(op: str, full, shard, group) -> None:
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full, group=group)
    else:
        dist.all_gather_into_tensor(full, shard, group=group)


def check_result(op: str, full, shard, rank: int, world_size: int) -> str | None:
    """None when the result is the closed form, else what differs."""
    import torch

    total = world_size * (world_size + 1) / 2
    if op == "all_reduce":
        got, expected = full, torch.full_like(full, total)
    elif op == "reduce_scatter":
        got, expected = shard, torch.full_like(shard, total)
    else:
        got = full.view(world_size, -1)
        expected = torch.arange(1, world_size + 1, dtype=full.dtype, device=full.device).view(-1, 1).expand_as(got)
    if torch.equal(got, expected):
        return None
    wrong = int((got != expected).sum())
    return f"{op}: {wrong} of {got.numel()} elements differ from the closed form on rank {rank}"


def measure(op: str, nbytes: int, group, backend: str, args: argparse.Namespace) -> dict:
    """One row: correctness once, then the mean time of args.iters calls."""
    import torch
    import torch.distributed as dist

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    numel = max(world_size, nbytes // 4 // world_size * world_size)  # float32, splits over the ranks
    device = torch.device(args.device)
    full = torch.empty(numel, dtype=torch.float32, device=device)
    shard = torch.empty(numel // world_size, dtype=torch.float32, device=device)
    row = {"backend": backend, "op": op, "nbytes": numel * 4, "world_size": world_size, "error": None}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        fill_and_run(op, full, shard, group, rank)
        sync()
        row["error"] = check_result(op, full, shard, rank, world_size)
        for _ in range(args.warmup):
            run_once(op, full, shard, group)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            run_once(op, full, shard, group)
        sync()
        seconds = (time.perf_counter() - start) / args.iters
    except Exception as error:  # reported in the row; the other rows still run
        row["error"] = f"{op} on {backend}, rank {rank}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return row
    algbw = numel * 4 / seconds / 1e9
    row.update(time_us=seconds * 1e6, algbw_GBps=algbw,
               busbw_GBps=algbw * bus_factor(op, world_size))
    return row


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'backend':<10}{'op':<16}{'bytes':>12}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}  result"]
    for row in rows:
        if "time_us" in row:
            numbers = f"{row['time_us']:12.1f}{row['algbw_GBps']:12.2f}{row['busbw_GBps']:12.2f}"
        else:
            numbers = f"{'-':>12}" * 3
        lines.append(f"{row['backend']:<10}{row['op']:<16}{row['nbytes']:>12}{numbers}  {row['error'] or 'correct'}")
    return "\n".join(lines)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ringcomm  # noqa: F401  registers the "ringcomm" backend

    warnings.filterwarnings("ignore", message=".*is deprecated. Please use", category=FutureWarning)  # *_tensor names
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    reference = REFERENCE[args.device]
    groups = {reference: dist.new_group(backend=reference), "ringcomm": dist.new_group(backend="ringcomm")}
    rows = [measure(op, nbytes, group, backend, args)
            for backend, group in groups.items() for op in OPS for nbytes in args.sizes]
    errors = [None] * world_size
    dist.all_gather_object(errors, [row["error"] for row in rows])  # a wrong result on any rank marks the row
    for index, row in enumerate(rows):
        row["error"] = next((e[index] for e in errors if e[index]), None)
    if rank != 0:
        return
    print(f"gpu_collectives: {world_size} ranks on {args.device}, {reference} vs ringcomm backend, float32 sum")
    print(format_rows(rows), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "world_size": world_size, "reference": reference, "rows": rows}, f,
                      indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch(worker, args, nproc=rank_count(args), timeout_s=args.timeout, deadline_s=args.timeout * 4 + 60)


if __name__ == "__main__":
    sys.exit(main())
