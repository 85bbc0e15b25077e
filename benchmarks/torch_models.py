"""Step time of unmodified DDP and FSDP2 (fully_shard) on gloo vs on the
"ringcomm" torch.distributed backend, in one run, same model and data.

    python benchmarks/torch_models.py [--nproc 2] [--width 1024] [--layers 4] [--steps 20]
    torchrun --nproc-per-node 2 benchmarks/torch_models.py   # the launcher's ranks

Prints a table (median step time per wrapper and backend, and the ratio
gloo / ringcomm) and writes JSON (bench-results/torch_models.json).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import launch  # noqa: E402
from models import mlp  # noqa: E402

WRAPPERS = ("ddp", "fsdp2")
BACKENDS = ("gloo", "ringcomm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to spawn when not under a launcher")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (parameters: layers * width^2)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any one collective may take")
    parser.add_argument("--json", default="bench-results/torch_models.json")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace):
    return mlp(args.layers, args.width)


def wrap(name: str, base, pg):
    """The model wrapped by DDP or FSDP2 over process group `pg`, and its optimizer."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = copy.deepcopy(base)
    if name == "ddp":
        model = DistributedDataParallel(model, process_group=pg)
    else:
        mesh = DeviceMesh.from_group(pg, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def step_time(model, optimizer, batch, pg) -> float:
    import torch.distributed as dist

    dist.barrier(group=pg)
    start = time.perf_counter()
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    """Steps the gloo and the ringcomm copy of each wrapper in turn, so that any
    load from outside falls on both alike."""
    import torch
    import torch.distributed as dist

    import ringcomm  # noqa: F401  (registers the backend)

    rank, world_size = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "ringcomm": dist.new_group(backend="ringcomm")}
    base = build_model(args)
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    results = {}
    for name in WRAPPERS:
        runs = {backend: wrap(name, base, groups[backend]) for backend in BACKENDS}
        times: dict[str, list[float]] = {backend: [] for backend in BACKENDS}
        for step in range(args.warmup + args.steps):
            for backend, (model, optimizer) in runs.items():
                elapsed = step_time(model, optimizer, batch, groups[backend])
                if step >= args.warmup:
                    times[backend].append(elapsed)
        for backend in BACKENDS:
            slowest = torch.tensor([statistics.median(times[backend])])
            dist.all_reduce(slowest, dist.ReduceOp.MAX, group=groups["gloo"])  # the slowest rank sets the pace
            results[(name, backend)] = slowest.item()
    if rank == 0:
        report(results, args, world_size, sum(p.numel() for p in base.parameters()))


def report(results: dict[tuple[str, str], float], args: argparse.Namespace, world_size: int, num_params: int) -> None:
    print(f"torch_models: {world_size} ranks, MLP {args.layers} x {args.width}^2 ({num_params / 1e6:.1f} M "
          f"parameters, fp32), batch {args.batch} per rank, median of {args.steps} steps")
    print(f"{'wrapper':<8} {'gloo ms':>9} {'ringcomm ms':>12} {'gloo/ringcomm':>14}")
    rows = []
    for name in WRAPPERS:
        gloo, ours = results[(name, "gloo")] * 1e3, results[(name, "ringcomm")] * 1e3
        rows.append({"wrapper": name, "gloo_ms": gloo, "ringcomm_ms": ours, "ratio": gloo / ours})
        print(f"{name:<8} {gloo:>9.1f} {ours:>12.1f} {gloo / ours:>13.2f}x")
    ratios = ", ".join(f"{row['wrapper']} {row['ratio']:.2f}x" for row in rows)
    print(f"note: step time gloo / ringcomm: {ratios} (> 1: faster on ringcomm; same model, data and ranks, "
          f"steps of both backends interleaved)")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as file:
        record = {"world_size": world_size, "num_params": num_params, "args": vars(args), "rows": rows}
        json.dump(record, file, indent=2)
    print(f"wrote {args.json}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = 60.0 + 2 * len(WRAPPERS) * len(BACKENDS) * args.timeout
    return launch(worker, args, nproc=args.nproc, timeout_s=args.timeout, deadline_s=deadline)


if __name__ == "__main__":
    sys.exit(main())
