"""ZeRO++ on hosts: step time and the bytes that cross hosts per step for
stage 3 plain, qwZ, hpZ, qgZ and all three (zero/sharding/zeropp.py), one
interleaved run.

    python benchmarks/zeropp.py                              # 4 ranks as 2 simulated hosts, one machine
    python benchmarks/zeropp.py --cluster --rounds 3         # 2 hosts x 2 in namespaces, 1 Gbit/s links
    python benchmarks/zeropp.py --cluster --width 768 --json out.json

Every config trains the same bf16 MLP (blocks of Linear(w, 4w), ReLU,
Linear(4w, w); fp32 masters, AdamW, clipping 1.0) on the same data. Each round
runs `--steps` steps of every config, in a rotating order, so that drifts of a
shared machine hit all alike; the table gives the median step time and its
range over rounds. With --cluster the hosts are namespaces with tbf-limited
links (benchmarks/cluster.py): a host's cross-host bytes are counted on its
veth (what it sent, headers included) and printed beside the sum of its
ranks' engine.wire_report().across_host_nbytes (the model, zero/sharding/wire.py).
Without --cluster the hosts are RINGCOMM_HOST names: no link, only the model.
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hierarchical import Links  # noqa: E402
from launch import launch  # noqa: E402

CONFIGS = {
    "stage3": {},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": 0},  # 0: the ranks per host
    "qgZ": {"zero_quantized_gradients": True},
    "all": {"zero_quantized_weights": True, "zero_hpz_partition_size": 0, "zero_quantized_gradients": True},
    # DeepSpeed's own engine (DS_ACCELERATOR=cpu) on the same config: its qwZ and qgZ need a quantizer op
    # that has no CPU build (QuantizerBuilder: "This op had not been implemented on CPU backend"), hpZ runs
    "ds-stage3": {},
    "ds-hpZ": {"zero_hpz_partition_size": 0},
}
DEEPSPEED = ("ds-stage3", "ds-hpZ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--nproc", type=int, default=4, help="ranks in all (host-major)")
    p.add_argument("--cluster", action="store_true", help="hosts as namespaces with rate-limited links")
    p.add_argument("--link-gbit", type=float, default=1.0)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps of each config per round")
    p.add_argument("--warmup", type=int, default=1, help="steps of each config before the rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket", type=float, default=2e6, help="reduce bucket size (elements)")
    p.add_argument("--configs", default=",".join(c for c in CONFIGS if c not in DEEPSPEED),
                   help=f"from {list(CONFIGS)} (the ds- ones need deepspeed)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default="bench-results/zeropp.json")
    args = p.parse_args(argv)
    args.configs = args.configs.split(",")
    if any(c not in CONFIGS for c in args.configs) or args.nproc % args.hosts:
        p.error(f"--configs from {list(CONFIGS)}; --nproc must be a multiple of --hosts")
    return args


def config(args, keys: dict) -> dict:
    per_host = args.nproc // args.hosts
    keys = {k: (per_host if k == "zero_hpz_partition_size" and v == 0 else v) for k, v in keys.items()}
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 10**9, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": int(args.bucket),
                                  "stage3_prefetch_bucket_size": int(args.bucket),
                                  "stage3_param_persistence_threshold": 10 * args.width, **keys}}


class Run:
    """One config's engine and what its steps measured."""

    def __init__(self, args, name: str) -> None:
        import torch
        from torch import nn

        torch.manual_seed(0)
        w = args.width
        model = nn.Sequential(*(nn.Sequential(nn.Linear(w, 4 * w), nn.ReLU(), nn.Linear(4 * w, w))
                                for _ in range(args.layers)))
        if name in DEEPSPEED:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            import deepspeed

            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config(args, CONFIGS[name]))
        else:
            import zero

            self.engine, *_ = zero.initialize(model=model, config=config(args, CONFIGS[name]))
        self.name, self.args, self.seconds, self.counted, self.across, self.losses = name, args, [], [], [], []

    def step(self, i: int) -> int:
        """One step; the bytes this rank's engine says it sent across hosts."""
        import torch
        import torch.distributed as dist

        g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
        x = torch.randn(self.args.batch, self.args.width, generator=g)
        loss = (self.engine(x.bfloat16()).float() - x.roll(1, dims=1)).pow(2).mean()
        self.engine.backward(loss)
        self.engine.step()
        self.losses.append(loss.item())
        return 0 if self.name in DEEPSPEED else self.engine.wire_report().across_host_nbytes


def rounds(args, runs: dict[str, Run], links: Links, per_host: int) -> None:
    import torch
    import torch.distributed as dist

    names = list(runs)
    for r in range(-1, args.rounds):  # round -1: warm-up, not recorded
        for name in names[r % len(names):] + names[:r % len(names)]:
            steps = args.warmup if r < 0 else args.steps
            dist.barrier()
            before, start, across = links.read(), time.perf_counter(), 0
            for i in range(steps):
                across += runs[name].step(i + r * args.steps)
            dist.barrier()
            took, after = time.perf_counter() - start, links.read()
            mine = torch.tensor([across], dtype=torch.float64)
            everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            if r < 0:
                continue
            run = runs[name]
            run.seconds.append(took / steps)
            run.across.append([sum(float(t) for t in everyone[h * per_host:(h + 1) * per_host]) / steps
                               for h in range(args.hosts)])
            run.counted.append([(a[0] - b[0]) / steps for a, b in zip(after, before)])


def summary(args, runs: dict[str, Run]) -> list[dict]:
    base = runs.get("stage3")
    rows = []
    for name, run in runs.items():
        row = {"config": name, "step_ms": [s * 1e3 for s in run.seconds],
               "model_across_nbytes": [max(a) for a in run.across],
               "counted_across_nbytes": [max(c) for c in run.counted] if run.counted[0] else [],
               "final_loss": run.losses[-1]}
        row["median_ms"] = statistics.median(row["step_ms"])
        if base is not None:
            row["time_vs_stage3"] = [s / b for s, b in zip(run.seconds, base.seconds)]
            bytes_of = "counted_across_nbytes" if row["counted_across_nbytes"] else "model_across_nbytes"
            base_bytes = [max(c) for c in (base.counted if row["counted_across_nbytes"] else base.across)]
            row["bytes_vs_stage3"] = [b / max(z, 1) for b, z in zip(row[bytes_of], base_bytes)]
        rows.append(row)
    return rows


def _med(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})" if values else "-"


def table(rows: list[dict]) -> str:
    lines = [f"# {'config':>7} {'step ms (range)':>22} {'vs stage3':>18} {'across MB/host':>20} "
             f"{'model MB':>9} {'counted/model':>13} {'bytes vs stage3':>18} {'loss':>8}"]
    for row in rows:
        counted, model = row["counted_across_nbytes"], row["model_across_nbytes"]
        shown = counted or model
        ratio = _med([c / m for c, m in zip(counted, model)], ".3f") if counted and min(model) > 0 else "-"
        lines.append(f"  {row['config']:>7} {_med(row['step_ms'], '.1f'):>22} "
                     f"{_med(row.get('time_vs_stage3', []), '.2f'):>18} {_med([b / 1e6 for b in shown], '.2f'):>20} "
                     f"{statistics.median(model) / 1e6:>9.2f} {ratio:>13} "
                     f"{_med(row.get('bytes_vs_stage3', []), '.3f'):>18} {row['final_loss']:>8.4f}")
    return "\n".join(lines)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_host = world_size // args.hosts
    links = Links()
    if not links.names:
        os.environ["RINGCOMM_HOST"] = f"sim-host-{rank // per_host}"
    runs = {name: Run(args, name) for name in args.configs}
    describe = runs["stage3"].engine.parts.comm.group.transport.describe() if "stage3" in runs else ""
    if rank == 0:
        where = (f"{args.hosts} hosts in namespaces, {links.gbit:g} Gbit/s links" if links.names
                 else f"{args.hosts} simulated hosts (RINGCOMM_HOST)")
        params = args.layers * 8 * args.width ** 2 + args.layers * 5 * args.width
        print(f"# {world_size} ranks, {where}; {describe}; MLP width {args.width} x {args.layers} "
              f"({params / 1e6:.1f} M params, bf16); {args.rounds} rounds x {args.steps} steps; "
              f"loadavg {open('/proc/loadavg').read().split()[:3]}", flush=True)
    rounds(args, runs, links, per_host)
    rows = summary(args, runs)
    for run in runs.values():
        if run.name not in DEEPSPEED:
            run.engine.destroy()
    if rank == 0:
        print(table(rows), flush=True)
        info = dict(host=platform.node(), cpus=os.cpu_count(), torch=torch.__version__, world_size=world_size,
                    hosts=args.hosts, transport=describe, link_gbit=links.gbit,
                    loadavg_end=open("/proc/loadavg").read().split()[:3])
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)
            print(f"# wrote {args.json}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cluster and "RCC_LINKS" not in os.environ:
        from cluster import Cluster

        argv = sys.argv[1:] if argv is None else argv
        with Cluster(args.hosts, link_gbit=args.link_gbit) as machines:
            results = machines.run([os.path.abspath(__file__), *argv], nproc_per_host=args.nproc // args.hosts,
                                   timeout_s=args.timeout * 20 + 1800)
        for r in results:
            if r.returncode != 0 or r.rank == 0:
                print(f"===== rank {r.rank} on host {r.host}: exit {r.returncode}\n{r.output[-6000:]}",
                      file=sys.stderr if r.returncode else sys.stdout)
        return 1 if any(r.returncode != 0 for r in results) else 0
    return launch(worker, args, nproc=args.nproc, timeout_s=args.timeout, deadline_s=args.timeout * 20 + 1800)


if __name__ == "__main__":
    sys.exit(main())
