"""Hierarchical vs flat: the hierarchical transport (shm inside a host,
torch_dist ring across hosts) vs the flat torch_dist ring vs gloo, in one
interleaved run, on simulated hosts.

    python benchmarks/hierarchical.py                    # 4 ranks as 2 hosts x 2 (RINGCOMM_HOST), one machine
    python benchmarks/hierarchical.py --cluster --sizes 64K,1M,16M,128M --json out.json --plot out.png
    python benchmarks/hierarchical.py --cluster --hosts 4 --nproc 4 --link-gbit 1

Without --cluster the hosts are processes of this machine told apart by
RINGCOMM_HOST (they share its /dev/shm, cores and loopback: crossing "hosts"
costs CPU, not link time). With --cluster each host is a set of namespaces
with its own host name, /dev/shm and a tbf-limited link (benchmarks/cluster.py),
and torchrun --nnodes runs the ranks: the link rate is the limit line, and the
bytes each host's link carried (its veth's counters) are printed beside the
model of what it must carry.

Each round times every backend once per (op, size), in a rotating order, so
that drifts of a shared machine hit all of them alike; the table gives the
median and the range over rounds. size is the full buffer S (all_reduce's
tensor, reduce_scatter's input, all_gather's output); busbw = algbw * 2(n-1)/n
for all_reduce and algbw * (n-1)/n for the others (nccl-tests). Every backend's
result is checked against a closed form once per (op, size) before timing.

[Note: link model] The bytes a host's link must carry each way per call, with
H hosts of L ranks (n = H L), placement host-major: the hierarchical transport
moves only its cross-host steps over links, 2(H-1)/H S for all_reduce and
(H-1)/H S for reduce_scatter and all_gather (L rings of S/L each); a flat ring
in rank order crosses each host boundary on one edge each way, which carries
what every ring edge carries, 2(n-1)/n S and (n-1)/n S; gloo rings alike, but
torch emulates its reduce_scatter by a full all_reduce (2(n-1)/n S). Tensors
the hierarchical all_reduce sends whole (up to the shm one-shot size) cross in
every ring: L times more. The limit line is that many bytes at the link rate.
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
    p.add_argument("--interleaved", action="store_true", help="place rank r on host r %% hosts instead "
                                                                 "(not with --cluster)")
    p.add_argument("--cluster", action="store_true", help="hosts as namespaces with rate-limited links")
    p.add_argument("--link-gbit", type=float, default=1.0, help="with --cluster: each host link's rate")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("64K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--sizes", default="", help="comma-separated sizes (overrides -b/-e/-f), e.g. 64K,1M,16M,128M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--moved", type=parse_size, default=parse_size("256M"),
                   help="bytes of buffer per timing: calls = moved / size, 2 to 50")
    p.add_argument("--alloc", default="shm", choices=("shm", "torch"),
                   help="the hierarchical transport's buffers: ringcomm.empty (shared memory on each host, "
                        "no staging copies in the local steps) or torch.empty; the others always use torch.empty")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write busbw vs size (log-log PNG) here")
    args = p.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s] or sizes(args)
    if any(o not in OPS for o in args.ops) or args.nproc % args.hosts or (args.cluster and args.interleaved):
        p.error(f"--ops from {OPS}; --nproc must be a multiple of --hosts; --cluster places host-major")
    return args


def model_nbytes(backend: str, op: str, nbytes: int, hosts: int, per_host: int, whole_max: int) -> float:
    """Bytes each host's link must carry each way per call ([Note: link model])."""
    n = hosts * per_host
    if backend == "hierarchical" and 1 < per_host and hosts > 1:
        factor = (2 if op == "all_reduce" else 1) * (hosts - 1) / hosts
        return factor * nbytes * (per_host if op == "all_reduce" and nbytes <= whole_max else 1)
    emulated = backend == "gloo" and op == "reduce_scatter"
    return (2 if op == "all_reduce" or emulated else 1) * (n - 1) / n * nbytes


class Links:
    """The byte counters of every host's link (the bridge end of its veth,
    named in RCC_LINKS by benchmarks/cluster.py): rx is what the host sent."""

    def __init__(self) -> None:
        self.names = [n for n in os.environ.get("RCC_LINKS", "").split(",") if n]
        self.gbit = float(os.environ.get("RCC_LINK_GBIT", "0") or 0)

    def read(self) -> list[tuple[int, int]]:
        counts = []
        for name in self.names:
            with open(f"/sys/class/net/{name}/statistics/rx_bytes") as rx, \
                    open(f"/sys/class/net/{name}/statistics/tx_bytes") as tx:
                counts.append((int(rx.read()), int(tx.read())))
        return counts


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        import ringcomm

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.per_host = self.world_size // args.hosts
        self.links = Links()
        if not self.links.names:  # one machine: the hosts are names only
            host = self.rank % args.hosts if args.interleaved else self.rank // self.per_host
            os.environ["RINGCOMM_HOST"] = f"sim-host-{host}"
        self.groups = {kind: ringcomm.new_group(transport=kind, timeout=args.timeout)
                       for kind in ("hierarchical", "torch_dist")}
        transport = self.groups["hierarchical"].transport
        self.describe = transport.describe()
        self.whole_max = transport.whole_max_nbytes if transport.kind == "hierarchical" else 0
        self.alloc, self.moved = args.alloc, args.moved

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

    def time(self, call, iters: int) -> tuple[float, list[float]]:
        """Seconds per call as the slowest rank saw it, and (rank 0, on a
        cluster) the bytes per call each host's link carried, the busier way."""
        import torch
        import torch.distributed as dist

        dist.barrier()
        before = self.links.read() if self.rank == 0 else []
        start = time.perf_counter()
        for _ in range(iters):
            call()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, dist.ReduceOp.MAX)
        after = self.links.read() if self.rank == 0 else []
        carried = [max(a[0] - b[0], a[1] - b[1]) / iters for a, b in zip(after, before)]
        return float(elapsed), carried

    def buffer(self, backend: str, numel: int):
        import torch

        import ringcomm

        if backend == "hierarchical" and self.alloc == "shm":
            return ringcomm.empty(numel, group=self.groups[backend])
        return torch.empty(numel)

    def measure(self, op: str, nbytes: int, rounds: int, hosts: int) -> list[dict]:
        numel = max(self.world_size, nbytes // 4 // self.world_size * self.world_size)
        calls = {}
        for backend in BACKENDS:
            full, chunk = self.buffer(backend, numel), self.buffer(backend, numel // self.world_size)
            self.check(backend, op, full, chunk)
            full.zero_(), chunk.zero_()  # zeros stay zeros: no overflow however often it runs
            calls[backend] = self.call(backend, op, full, chunk)
            calls[backend]()  # warm-up
        iters = max(2, min(50, self.moved // (numel * 4)))
        seconds: dict[str, list[float]] = {b: [] for b in BACKENDS}
        carried: dict[str, list[list[float]]] = {b: [] for b in BACKENDS}
        for round_index in range(rounds):
            order = BACKENDS[round_index % 3:] + BACKENDS[:round_index % 3]
            for backend in order:
                took, counted = self.time(calls[backend], iters)
                seconds[backend].append(took)
                carried[backend].append(counted)
        return [self.row(op, backend, numel * 4, iters, seconds[backend], carried[backend], hosts)
                for backend in BACKENDS]

    def row(self, op: str, backend: str, nbytes: int, iters: int, seconds: list[float],
            carried: list[list[float]], hosts: int) -> dict:
        factor = BUS_FACTOR[op](self.world_size)
        busbw = sorted(nbytes / s / 1e9 * factor for s in seconds)
        row = dict(op=op, backend=backend, nbytes=nbytes, iters=iters, time_us=statistics.median(seconds) * 1e6,
                   busbw=statistics.median(busbw), busbw_min=busbw[0], busbw_max=busbw[-1])
        if self.links.names and self.rank == 0:  # rank 0 reads the counters
            model = model_nbytes(backend, op, nbytes, hosts, self.per_host, self.whole_max)
            limit_s = model / (self.links.gbit * 1e9 / 8)
            per_host = [statistics.median(c[h] for c in carried) for h in range(len(self.links.names))]
            row.update(model_nbytes=model, carried_nbytes=per_host, limit_s=limit_s,
                       limit_busbw=nbytes / limit_s / 1e9 * factor, of_limit=limit_s / statistics.median(seconds),
                       of_limit_range=[limit_s / max(seconds), limit_s / min(seconds)])
        return row


def format_rows(rows: list[dict]) -> list[str]:
    by = {r["backend"]: r for r in rows}
    hier = by["hierarchical"]["busbw"]
    lines = []
    for r in rows:
        ratios = "" if r["backend"] != "hierarchical" else \
            f"{hier / by['torch_dist']['busbw']:5.2f}x {hier / by['gloo']['busbw']:5.2f}x"
        line = (f"{r['op']:>14} {r['nbytes']:>10} {r['backend']:>13} {r['time_us']:>11.1f} "
                f"{r['busbw']:>7.3f} [{r['busbw_min']:.3f}-{r['busbw_max']:.3f}] {ratios:>13}")
        if "model_nbytes" in r:
            low, high = r["of_limit_range"]
            counted = "/".join(f"{c / r['model_nbytes']:.3f}" for c in r["carried_nbytes"])
            line += (f" {100 * r['of_limit']:5.1f}% [{100 * low:.1f}-{100 * high:.1f}] of the link limit "
                     f"({r['limit_busbw']:.3f} GB/s); link bytes/model per host {counted} "
                     f"(model {r['model_nbytes'] / 2**20:.2f} MiB)")
        lines.append(line)
    return lines


def plot(rows: list[dict], info: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for color, backend in zip(("C0", "C2", "C4"), BACKENDS):
            mine = [r for r in rows if r["op"] == op and r["backend"] == backend]
            sizes = [r["nbytes"] for r in mine]
            ax.errorbar(sizes, [r["busbw"] for r in mine], color=color, marker="o", capsize=3, label=backend,
                        yerr=[[r["busbw"] - r["busbw_min"] for r in mine], [r["busbw_max"] - r["busbw"] for r in mine]])
            if mine and "limit_busbw" in mine[0]:
                ax.plot(sizes, [r["limit_busbw"] for r in mine], color=color, linestyle="--",
                        label=f"{backend}: link limit")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="size (bytes)", ylabel="bus bandwidth (GB/s)", title=op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{info['world_size']} ranks on {info['hosts']} hosts, links {info['link_gbit'] or '-'} Gbit/s; "
                 f"{info['transport']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def worker(args: argparse.Namespace) -> None:
    import torch

    bench = Bench(args)
    if bench.rank == 0:
        where = (f"{args.hosts} hosts in namespaces, {bench.links.gbit:g} Gbit/s links" if bench.links.names
                 else f"{args.hosts} simulated hosts (RINGCOMM_HOST)")
        print(f"# {bench.world_size} ranks, {where}; {bench.describe}; buffers {args.alloc}; "
              f"float32 sum; {args.rounds} rounds; loadavg {open('/proc/loadavg').read().split()[:3]}")
        print(f"# {'op':>12} {'size (B)':>10} {'backend':>13} {'median (us)':>11} {'busbw GB/s (range)':>20} "
              f"{'vs flat vs gloo':>15}", flush=True)
    rows = []
    for op in args.ops:
        for nbytes in args.sizes:
            measured = bench.measure(op, nbytes, args.rounds, args.hosts)
            rows.extend(measured)
            if bench.rank == 0:
                print("\n".join(format_rows(measured)), flush=True)
    info = dict(host=platform.node(), cpus=os.cpu_count(), torch=torch.__version__, world_size=bench.world_size,
                hosts=args.hosts, interleaved=args.interleaved, transport=bench.describe,
                link_gbit=bench.links.gbit, loadavg_end=open("/proc/loadavg").read().split()[:3])
    if bench.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}")
    if bench.rank == 0 and args.plot:
        plot(rows, info, args.plot)
        print(f"# wrote {args.plot}")
    for group in bench.groups.values():
        group.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cluster and "RCC_LINKS" not in os.environ:
        from cluster import Cluster

        argv = sys.argv[1:] if argv is None else argv
        with Cluster(args.hosts, link_gbit=args.link_gbit) as machines:
            with machines.launch([os.path.abspath(__file__), *argv], nproc_per_host=args.nproc // args.hosts,
                                 timeout_s=args.timeout * 20 + 3600) as launched:
                results = launched.wait(echo=0)
                if any(r.returncode is None for r in results):
                    print(launched.agent_logs()[-6000:], file=sys.stderr)
        failed = [r for r in results if r.returncode != 0]
        for r in failed:
            print(f"===== rank {r.rank} on host {r.host}: exit {r.returncode}\n{r.output[-4000:]}", file=sys.stderr)
        return 1 if failed else 0
    return launch(worker, args, nproc=args.nproc, timeout_s=args.timeout, deadline_s=args.timeout * 20 + 600)


if __name__ == "__main__":
    sys.exit(main())
