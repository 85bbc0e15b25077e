"""Comm/compute overlap of BucketScheduler: one MLP step (forward, backward,
gradient sync) with overlap on and off, and gloo DDP as the reference.

    python benchmarks/overlap.py [--world-size 2] [--steps 20] [--transport shm,torch_dist]

On shm the collectives are pure CPU work (copies and reductions), so with no
spare core per rank hiding them cannot shorten a compute-bound step; on
torch_dist (gloo send/recv) part of the collective is waiting, which overlap hides.

Spawns local ranks itself (file rendezvous, one compute thread per rank).
Prints a table and writes JSON (bench-results/overlap.json by default).
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta

from models import mlp  # benchmarks/ is on sys.path: this file runs as a script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8, help="Linear layers of the MLP")
    parser.add_argument("--width", type=int, default=512, help="hidden width (parameters: layers * width^2)")
    parser.add_argument("--batch", type=int, default=512, help="rows per rank: sets how long backward is")
    parser.add_argument("--bucket-mb", type=float, default=2.0, help="bucket_bytes in MiB")
    parser.add_argument("--first-bucket-mb", type=float, default=1.0)
    parser.add_argument("--mode", default="reduce_scatter", choices=("reduce_scatter", "all_reduce"))
    parser.add_argument("--transport", default="shm,torch_dist",
                        help="comma-separated transports to measure, one run each (auto, shm, torch_dist)")
    parser.add_argument("--spin-us", type=float, default=None,
                        help="shm: microseconds a waiting rank spins before it sleeps (default: the transport's)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin rank r (its compute and comm threads) to core r %% cores, so that a comm thread "
                             "waiting for a peer takes time from its own rank only")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="bench-results/overlap.json")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace):
    return mlp(args.layers, args.width)


def ringcomm_step(model, scheduler, batch):
    scheduler.zero_grad()
    model(batch).square().mean().backward()
    return scheduler.finish()


def ddp_step(ddp, batch):
    ddp.zero_grad(set_to_none=False)
    ddp(batch).square().mean().backward()


def run_rank(rank: int, args: argparse.Namespace, transport: str, init_file: str, results) -> None:
    import torch
    import torch.distributed as dist

    import ringcomm

    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world_size,
                            timeout=timedelta(seconds=120))
    shm = None if args.spin_us is None else ringcomm.ShmOptions(spin_us=args.spin_us)
    group = ringcomm.new_group(transport=transport, timeout=120, shm=shm)
    steps = {}
    for name, overlap in (("overlap on", True), ("overlap off", False)):
        model = build_model(args)
        buffers = ringcomm.flat_buffers(model.parameters(), world_size=args.world_size,
                                        bucket_bytes=int(args.bucket_mb * 2**20),
                                        first_bucket_bytes=int(args.first_bucket_mb * 2**20),
                                        allocate=ringcomm.transport_allocator(group))
        scheduler = ringcomm.BucketScheduler(buffers, group, mode=args.mode, overlap=overlap)
        scheduler.register_hooks(model.named_parameters())
        steps[name] = lambda batch, m=model, s=scheduler: ringcomm_step(m, s, batch)
    ddp = torch.nn.parallel.DistributedDataParallel(build_model(args))
    steps["gloo DDP"] = lambda batch: ddp_step(ddp, batch)
    out = time_steps(args, steps, torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank)))
    if rank == 0:
        out.update(num_buckets=sum(len(b.layout.buckets) for b in scheduler.buffers), transport=group.transport.kind)
        results.put(out)
    # The models, schedulers and DDP hold each other through their autograd
    # hooks: a cycle that only gc frees, possibly during interpreter shutdown,
    # where freeing DDP's gloo work aborts the process ("terminate called
    # without an active exception", seen once in CI). Free them while alive.
    del steps, scheduler, buffers, model, ddp
    gc.collect()
    ringcomm.destroy_default_group()
    group.close()
    dist.destroy_process_group()


def time_steps(args: argparse.Namespace, steps: dict, batch) -> dict:
    """Runs the configurations interleaved, in alternating order, so that drift
    and neighbours' load hit all alike; a barrier before each step."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in steps}
    reports: dict[str, list[dict]] = {name: [] for name in steps if name != "gloo DDP"}
    names = list(steps)
    for step in range(args.warmup + args.steps):
        for name in names if step % 2 == 0 else [names[1], names[0], *names[2:]]:
            dist.barrier()
            start = time.perf_counter()
            report = steps[name](batch)
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[name].append(elapsed)
                if name in reports:
                    reports[name].append(report._asdict())
    return {"times": times, "reports": reports}


def summarize(args: argparse.Namespace, out: dict) -> list[dict]:
    """Medians over the timed steps (robust to a neighbour stealing the CPU for a step)."""
    rows = []
    for name, times in out["times"].items():
        reports = out["reports"].get(name, [])
        row = {"config": name, "step_ms": statistics.median(times) * 1e3, "comm_ms": None, "exposed_ms": None,
               "wait_ms": None, "hidden_fraction": None}
        if reports:
            row.update(comm_ms=statistics.median(r["comm_s"] for r in reports) * 1e3,
                       wait_ms=statistics.median(r["wait_s"] for r in reports) * 1e3,
                       exposed_ms=statistics.median(r["exposed_s"] for r in reports) * 1e3,
                       hidden_fraction=statistics.median(r["hidden_fraction"] for r in reports))
        rows.append(row)
    return rows


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    width = spec.split(".")[0].lstrip(">")
    return format("-", f">{width}") if value is None else format(value * scale, spec)


def print_table(args: argparse.Namespace, out: dict, rows: list[dict]) -> None:
    params = args.layers * (args.width * args.width + args.width)
    print(f"overlap benchmark: {args.world_size} ranks, transport {out['transport']}, mode {args.mode}, "
          f"MLP {args.layers}x{args.width} ({params * 4 / 2**20:.1f} MiB fp32 grads), batch {args.batch}/rank, "
          f"{out['num_buckets']} buckets of {args.bucket_mb} MiB (first {args.first_bucket_mb} MiB), "
          f"median of {args.steps} steps")
    print(f"{'config':<12} {'step ms':>9} {'comm ms':>9} {'exposed ms':>11} {'finish ms':>10} {'hidden %':>9}")
    for row in rows:
        print(f"{row['config']:<12} {row['step_ms']:>9.2f} {_fmt(row['comm_ms'], '>9.2f')} "
              f"{_fmt(row['exposed_ms'], '>11.2f')} {_fmt(row['wait_ms'], '>10.2f')} "
              f"{_fmt(row['hidden_fraction'], '>9.1f', 100)}")
    on, off = rows[0], rows[1]
    print(f"overlap on vs off: step {on['step_ms']:.2f} ms vs {off['step_ms']:.2f} ms; paired per-step speedup "
          f"{out['speedup']:.2f}x (median of off/on); {on['hidden_fraction'] * 100:.1f}% of communication hidden "
          f"behind backward (overlap off: {off['hidden_fraction'] * 100:.1f}%)")


def _wait_result(results, procs, deadline: float) -> dict:
    """Rank 0's result; fails as soon as a rank dies without one, or at the deadline."""
    import queue

    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"overlap benchmark: ranks (rank, exit code) {dead} died without a result")
    for proc in procs:
        proc.kill()
    raise RuntimeError("overlap benchmark: no result within the deadline; killed the ranks")


def run_transport(args: argparse.Namespace, transport: str) -> dict:
    """Spawns the ranks for one transport; prints its table; returns its summary."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=run_rank, args=(r, args, transport, init_file, results))
                 for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        out = _wait_result(results, procs, deadline=time.monotonic() + 600)
        for proc in procs:
            proc.join(timeout=60)
        if any(proc.exitcode != 0 for proc in procs):
            raise RuntimeError(f"overlap benchmark: rank exit codes {[proc.exitcode for proc in procs]}")
    rows = summarize(args, out)
    out["speedup"] = statistics.median(off / on for on, off in zip(out["times"]["overlap on"],
                                                                     out["times"]["overlap off"]))
    print_table(args, out, rows)
    return {"transport": out["transport"], "num_buckets": out["num_buckets"], "rows": rows,
            "paired_speedup": out["speedup"]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    runs = []
    for transport in args.transport.split(","):
        runs.append(run_transport(args, transport.strip()))
        print()
    summary = {"args": vars(args), "runs": runs}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
