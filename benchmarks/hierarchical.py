"""Hierarchical vs flat: ranks as simulated hosts (RINGCOMM_HOST), the
hierarchical transport (shm inside a host, torch_dist ring across hosts) vs the
flat torch_dist ring vs gloo, in one interleaved run.

    python benchmarks/hierarchical.py                    # 4 ranks as 2 hosts x 2, 64 KiB .. 64 MiB
    python benchmarks/hierarchical.py --hosts 2 --nproc 4 --rounds 7 --json out.json

Each round times every backend once per (op, size), in a rotating order, so
that drifts of a shared machine hit all of them alike; the table gives the
median and the range over rounds. size is the full buffer (all_reduce's tensor,
reduce_scatter's input, all_gather's output); busbw = algbw * 2(n-1)/n for
all_reduce and algbw * (n-1)/n for the others (nccl-tests). Every backend's
result is checked against a closed form once per (op, size) before timing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bus_bw import parse_size, sizes  # noqa: E402
from launch import launch  # noqa: E402

OPS = ("all_reduce", "reduce_scatter", "all_gather")
BACKENDS = ("hierarchical", "torch_dist", "gloo")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts; ranks placed host-major")
    p.add_argument("--interleaved", action="store_true", help="place rank r on host r %% hosts instead")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("64K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--alloc", default="shm", choices=("shm", "torch"),
                   help="the hierarchical transport's buffers: ringcomm.empty (shared memory on each host, "
                        "no staging copies in the local steps) or torch.empty; the others always use torch.empty")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    if any(o not in OPS for o in args.ops) or args.nproc % args.hosts:
        p.error(f"--ops from {OPS}; --nproc must be a multiple of --hosts")
    return args


def iterations(nbytes: int) -> int:
    """Calls per timing: about 256 MiB moved, 3 to 50 calls."""
    return max(3, min(50, (256 << 20) // nbytes))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        import ringcomm

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        per_host = self.world_size // args.hosts
        host = self.rank % args.hosts if args.interleaved else self.rank // per_host
        os.environ["RINGCOMM_HOST"] = f"sim-host-{host}"
        self.groups = {kind: ringcomm.new_group(transport=kind, timeout=args.timeout)
                       for kind in ("hierarchical", "torch_dist")}
        self.describe = self.groups["hierarchical"].transport.describe()
        self.alloc = args.alloc

    def call(self, backend: str, op: str, full, chunk):
        """The collective as a no-argument callable (float32, sum)."""
        import torch.distributed as dist

        import ringcomm

        if backend == "gloo":
            from bus_bw_cases import GATHER, SCATTER

            return {"all_reduce": lambda: dist.all_reduce(full), "reduce_scatter": lambda: SCATTER(chunk, full),
                    "all_gather": lambda: GATHER(full, chunk)}[op]
        group = self.groups[backend]
        return {"all_reduce": lambda: ringcomm.all_reduce(full, group=group),
                "reduce_scatter": lambda: ringcomm.reduce_scatter(chunk, full, group=group),
                "all_gather": lambda: ringcomm.all_gather(full, chunk, group=group)}[op]

    def check(self, backend: str, op: str, full, chunk) -> None:
        """Closed form: rank r contributes r + 1; all_gather's chunk g holds g + 1."""
        import torch

        n = self.world_size
        if op == "all_gather":
            chunk.fill_(self.rank + 1)
            self.call(backend, op, full, chunk)()
            ok = torch.equal(full, torch.arange(1, n + 1, dtype=full.dtype).repeat_interleave(chunk.numel()))
        else:
            full.fill_(self.rank + 1)
            self.call(backend, op, full, chunk)()
            result = full if op == "all_reduce" else chunk
            ok = bool(torch.all(result == n * (n + 1) // 2))
        if not ok:
            raise AssertionError(f"{backend} {op} {full.numel()} elements: wrong result on rank {self.rank}")

    def time(self, call, iters: int) -> float:
        """Seconds per call, as the slowest rank saw it."""
        import torch
        import torch.distributed as dist

        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, dist.ReduceOp.MAX)
        return float(elapsed)

    def buffer(self, backend: str, numel: int):
        import torch

        import ringcomm

        if backend == "hierarchical" and self.alloc == "shm":
            return ringcomm.empty(numel, group=self.groups[backend])
        return torch.empty(numel)

    def measure(self, op: str, nbytes: int, rounds: int) -> list[dict]:
        numel = max(self.world_size, nbytes // 4 // self.world_size * self.world_size)
        calls = {}
        for backend in BACKENDS:
            full, chunk = self.buffer(backend, numel), self.buffer(backend, numel // self.world_size)
            self.check(backend, op, full, chunk)
            full.zero_(), chunk.zero_()  # zeros stay zeros: no overflow however often it runs
            calls[backend] = self.call(backend, op, full, chunk)
            calls[backend]()  # warm-up
        iters = iterations(numel * 4)
        seconds: dict[str, list[float]] = {b: [] for b in BACKENDS}
        for round_index in range(rounds):
            order = BACKENDS[round_index % 3:] + BACKENDS[:round_index % 3]
            for backend in order:
                seconds[backend].append(self.time(calls[backend], iters))
        factor = BUS_FACTOR[op](self.world_size)
        rows = []
        for backend in BACKENDS:
            busbw = sorted(numel * 4 / s / 1e9 * factor for s in seconds[backend])
            rows.append(dict(op=op, backend=backend, nbytes=numel * 4, iters=iters,
                             time_us=statistics.median(seconds[backend]) * 1e6, busbw=statistics.median(busbw),
                             busbw_min=busbw[0], busbw_max=busbw[-1]))
        return rows


def format_rows(rows: list[dict]) -> list[str]:
    by = {r["backend"]: r for r in rows}
    hier = by["hierarchical"]["busbw"]
    lines = []
    for r in rows:
        ratios = "" if r["backend"] != "hierarchical" else \
            f"{hier / by['torch_dist']['busbw']:7.2f}x {hier / by['gloo']['busbw']:7.2f}x"
        lines.append(f"{r['op']:>14} {r['nbytes']:>10} {r['backend']:>13} {r['time_us']:>11.1f} "
                     f"{r['busbw']:>7.2f} [{r['busbw_min']:.2f}-{r['busbw_max']:.2f}] {ratios}")
    return lines


def worker(args: argparse.Namespace) -> None:
    import torch

    bench = Bench(args)
    if bench.rank == 0:
        print(f"# {bench.world_size} ranks, {args.hosts} simulated hosts; {bench.describe}; buffers {args.alloc}; "
              f"float32 sum; {args.rounds} rounds; loadavg {open('/proc/loadavg').read().split()[:3]}")
        print(f"# {'op':>12} {'size (B)':>10} {'backend':>13} {'median (us)':>11} {'busbw GB/s (range)':>20} "
              f"{'vs flat':>8} {'vs gloo':>8}", flush=True)
    rows = []
    for op in args.ops:
        for nbytes in sizes(args):
            measured = bench.measure(op, nbytes, args.rounds)
            rows.extend(measured)
            if bench.rank == 0:
                print("\n".join(format_rows(measured)), flush=True)
    if bench.rank == 0 and args.json:
        info = dict(host=platform.node(), cpus=os.cpu_count(), torch=torch.__version__, world_size=bench.world_size,
                    hosts=args.hosts, interleaved=args.interleaved, transport=bench.describe,
                    loadavg_end=open("/proc/loadavg").read().split()[:3])
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}")
    for group in bench.groups.values():
        group.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch(worker, args, nproc=args.nproc, timeout_s=args.timeout, deadline_s=args.timeout * 20 + 600)


if __name__ == "__main__":
    sys.exit(main())
