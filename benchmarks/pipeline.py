"""A torch.distributed.pipelining schedule on "ringcomm" against gloo: two
stages of an MLP on 2 ranks, trained with SGD, the step time of each backend
in interleaved rounds (median [min-max]), and the losses compared (they must
be equal: point-to-point only moves the activations and their gradients).

    python benchmarks/pipeline.py                       # GPipe, hidden 1024, 8 microbatches of 64
    python benchmarks/pipeline.py --schedule 1f1b --hidden 4096 --rounds 7

With no launcher it spawns its 2 ranks (benchmarks/launch.py)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import launch  # noqa: E402

BACKENDS = ("gloo", "ringcomm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    p.add_argument("--hidden", type=int, default=1024, help="width of the MLP (an activation: batch x hidden floats)")
    p.add_argument("--microbatch", type=int, default=64, help="rows per microbatch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per backend per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the backend order alternates)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default="bench-results/pipeline.json")
    return p.parse_args(argv)


def make_schedule(args, group, rank: int):
    """Stage `rank` of a 4-layer MLP (the same initial weights on both backends), its schedule and optimizer."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    h = args.hidden
    stages = [torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh(), torch.nn.Linear(h, h), torch.nn.Tanh()),
              torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh(), torch.nn.Linear(h, 16))]
    stage = PipelineStage(stages[rank], rank, 2, torch.device("cpu"), group=group)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = schedule_class(stage, n_microbatches=args.microbatches, loss_fn=torch.nn.functional.mse_loss)
    return schedule, torch.optim.SGD(stages[rank].parameters(), lr=0.01)


def run_steps(args, schedule, optimizer, batches, rank: int, losses: list[float]) -> float:
    """Seconds per step over the batches; stage 1 appends its microbatch losses."""
    import torch.distributed as dist

    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            step_losses: list = []
            schedule.step(target=y, losses=step_losses)
            losses += [loss.item() for loss in step_losses]
        optimizer.step()
    elapsed = (time.perf_counter() - start) / len(batches)
    return max(_all_ranks(elapsed, dist))


def _all_ranks(value: float, dist) -> list[float]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ringcomm  # noqa: F401  (registers the backend)

    rank = dist.get_rank()
    groups = {name: dist.new_group(backend=name) for name in BACKENDS}
    schedules = {name: make_schedule(args, group, rank) for name, group in groups.items()}
    generator = torch.Generator().manual_seed(1)
    rows = args.microbatch * args.microbatches
    losses: dict[str, list[float]] = {name: [] for name in BACKENDS}
    seconds: dict[str, list[float]] = {name: [] for name in BACKENDS}
    load = [_load_average()]
    warm = [(torch.randn(rows, args.hidden, generator=generator), torch.randn(rows, 16, generator=generator))]
    for name in BACKENDS:
        run_steps(args, *schedules[name], warm, rank, losses[name])
    for round_index in range(args.rounds):
        batches = [(torch.randn(rows, args.hidden, generator=generator), torch.randn(rows, 16, generator=generator))
                   for _ in range(args.steps)]
        for name in BACKENDS if round_index % 2 == 0 else BACKENDS[::-1]:
            dist.barrier()
            seconds[name].append(run_steps(args, *schedules[name], batches, rank, losses[name]))
    load.append(_load_average())
    if rank == 1:
        same = losses["gloo"] == losses["ringcomm"]
        dist.send_object_list([losses, same], dst=0)
    else:
        received = [None, None]
        dist.recv_object_list(received, src=1)
        report(args, seconds, received[0], received[1], load)


def report(args, seconds: dict, losses: dict, same: bool, load: list[str]) -> None:
    activation = args.microbatch * args.hidden * 4
    print(f"# pipeline: {args.schedule}, 2 stages on 2 ranks, MLP hidden {args.hidden}, {args.microbatches} microbatches "
          f"of {args.microbatch} rows (activation {activation >> 10} KiB), fp32, {args.steps} steps x {args.rounds} "
          f"rounds; loadavg {load[0]} -> {load[1]}")
    stats = {}
    for name in BACKENDS:
        values = [s * 1e3 for s in seconds[name]]
        stats[name] = {"median_ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values)}
        print(f"{name:9s} step {stats[name]['median_ms']:.2f} ms [{stats[name]['min_ms']:.2f}-{stats[name]['max_ms']:.2f}]")
    ratios = sorted(g / r for g, r in zip(seconds["gloo"], seconds["ringcomm"]))
    print(f"gloo / ringcomm step time: {statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}] (per round)")
    print(f"losses ({len(losses['gloo'])} microbatches): {'identical' if same else 'DIFFERENT'} on both backends")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "seconds": seconds, "stats": stats, "ratios": ratios, "losses_equal": same,
                   "loadavg": load}, f, indent=1)
    print(f"# wrote {args.json}")
    if not same:
        raise SystemExit("pipeline: the losses differ between gloo and ringcomm")


def _load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch(worker, args, nproc=2, timeout_s=args.timeout, deadline_s=1800)


if __name__ == "__main__":
    sys.exit(main())
