"""ZeRO-Infinity at the size it exists for: a GPT-style model whose states do
not fit the machine trains at stage 3 with the optimizer states and the
parameters on NVMe, and each step is set against its floor.

    python benchmarks/infinity.py                              # ~3.0B parameters (48 GB of states), 2 ranks
    python benchmarks/infinity.py --hidden 1024 --layers 12    # ~0.17B, a quick look
    python benchmarks/infinity.py --memory-limit 16            # the ranks in a 16 GiB memory cgroup (root)
    python benchmarks/infinity.py --layers 32 --seq 4 --steps 2 --checkpoint   # + save, load, to_fp32
    python benchmarks/infinity.py --engine deepspeed           # the same run on DeepSpeed (needs libaio-dev)

The model: `--layers` pre-norm decoder blocks (attention with a fused qkv,
an MLP of 4x hidden), untied embedding and head; bf16, AdamW. The config is
the one zero.estimate's out-of-memory ladder writes for its NVMe rung
(sub_group_size 1e7, max_in_cpu 0, pipelined optimizer swaps, DeepSpeed's
defaults elsewhere). It is built under zero.Init, straight into the swap
files. Data: one fixed random sequence per rank, so the loss falls. The first
step is not timed.

Before training the script measures the disk's own sequential write and read
rate in the NVMe folder (dd with O_DIRECT, --probe-gib) and the compute of a
step (one block's forward and backward at the run's shapes, x layers, on one
thread as the ranks run). Per step it counts the bytes the ranks moved to and
from storage (/proc/self/io). The floor of a step is max(compute, read bytes /
read rate + write bytes / write rate): the two ranks share one disk. Prints
one row per step and a summary (peak resident memory per rank as VmHWM, the
cgroup's peak when there is one, disk bytes, step / floor) and writes JSON.

--checkpoint: after the steps each rank saves a checkpoint and loads it back
(`--checkpoint-dir`, on the disk), each phase's peak resident memory against
the training peak and the largest bucket's fp32 master; then `python -m
zero.to_fp32 --max-shard-size` consolidates it in a process of its own (its
peak from wait4), once the ranks and their swap files are gone.
--engine deepspeed runs the same model and config through deepspeed.zero.Init
and deepspeed.initialize (its NVMe offload needs the async_io op: libaio-dev).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import launch  # noqa: E402
from checkpoint_memory import consolidate, measured  # noqa: E402
from machine import cpu_model, disk_rates, io_bytes, join_cgroup, reset_peak, status_kib, write_json  # noqa: E402

GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--layers", type=int, default=38)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=16, help="tokens per micro batch and rank")
    p.add_argument("--steps", type=int, default=4, help="the first is not timed")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--sub-group-size", type=float, default=1e7, help="the ladder's (zero.estimate)")
    p.add_argument("--nvme-path", default="/var/tmp", help="a folder on the disk to swap to (a temporary one in it)")
    p.add_argument("--probe-gib", type=float, default=2.0, help="size of the disk probe's file")
    p.add_argument("--memory-limit", type=float, default=None, help="GiB: run the ranks in a memory cgroup")
    p.add_argument("--engine", default="zero", choices=("zero", "deepspeed"))
    p.add_argument("--checkpoint", action="store_true", help="save, load and consolidate after the steps (zero)")
    p.add_argument("--checkpoint-dir", default="/var/tmp", help="a folder on the disk for the checkpoint")
    p.add_argument("--max-shard-size", default="2GB", help="of python -m zero.to_fp32")
    p.add_argument("--json", default="bench-results/infinity.json")
    return p.parse_args(argv)


def num_params(args) -> int:
    h = args.hidden
    return args.layers * (12 * h * h + 13 * h) + 2 * args.vocab * h + 2 * h


def config(args, nvme_path: str) -> dict:
    """The config zero.estimate's ladder writes for its last rung (stage 3,
    both offloads on NVMe: sub_group_size 1e7, max_in_cpu 0, pipelined
    optimizer reads and writes, DeepSpeed's defaults elsewhere), with AdamW,
    the NVMe folder and --sub-group-size."""
    from zero.estimate import memory_model as mm

    plan = mm.Plan(stage=3, offload_optimizer="nvme", offload_param="nvme", mixed_precision=True,
                   nvme=mm.NVME_RUNG)
    cfg = mm.deepspeed_config(plan, nvme_path=nvme_path)
    cfg["zero_optimization"]["sub_group_size"] = int(args.sub_group_size)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}}
    if args.engine == "deepspeed":  # what DeepSpeed 0.19.8 needs (docs/zero.md: at 2.6B it still fails)
        zero = cfg["zero_optimization"]
        # its pipelined swapper fails: "assert new_alloc_buffers is not None" (pipelined_optimizer_swapper.py)
        zero["offload_optimizer"].update(pipeline_read=False, pipeline_write=False)
        # its param swapper holds a buffer per live parameter: with max_in_cpu 0 the first forward fails
        # ("Not enough buffers 0 for swapping 1") with 5 buffers and with 16; its default max_in_cpu (1e9
        # elements) keeps the shards in memory up to that
        largest = max(4 * args.hidden ** 2, args.vocab * args.hidden)
        del zero["offload_param"]["max_in_cpu"]
        zero["offload_param"].update(buffer_count=16, buffer_size=largest // args.nproc + 1)
    return cfg


def make_model(args):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = args.hidden
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, args.heads, h // args.heads).permute(2, 0, 3, 1, 4)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm, self.head = nn.LayerNorm(args.hidden), nn.Linear(args.hidden, args.vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return GPT, Block


def compute_floor_s(args, Block) -> float:
    """One block's forward and backward at the run's shapes (bf16, this thread), x layers."""
    import torch

    block = Block().to(torch.bfloat16)
    x = torch.randn(1, args.seq, args.hidden, dtype=torch.bfloat16, requires_grad=True)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        block(x).float().square().mean().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * args.layers


def estimated(args):
    """zero.estimate's bytes per rank for this run, and its NVMe bytes read and
    written per step (memory_model.need and nvme_traffic: stage 3,
    both offloads on NVMe, bf16, the config's NVMe sizes, DeepSpeed's default
    bucket sizes; the gather unit is a block)."""
    from zero.estimate import memory_model as mm

    h = args.hidden
    shape = mm.TransformerShape(seq=args.seq, micro_batch=1, hidden=h, layers=args.layers, heads=args.heads,
                                vocab=args.vocab)
    zero = config(args, "")["zero_optimization"]
    optimizer, param = zero["offload_optimizer"], zero["offload_param"]
    default = mm.NvmeSizes()  # DeepSpeed's, where the config leaves a key out
    nvme = mm.NvmeSizes(zero["sub_group_size"], optimizer.get("buffer_count", default.optimizer_buffer_count),
                        param.get("buffer_count", default.param_buffer_count),
                        param.get("buffer_size", default.param_buffer_size),
                        param.get("max_in_cpu", default.max_in_cpu))
    job = mm.Job(num_params(args), args.nproc, max(12 * h * h + 13 * h, args.vocab * h), 0.0, shape, True,
                 largest_param=max(4 * h * h, args.vocab * h), units=args.layers + 3, nvme=nvme)
    plan = mm.Plan(stage=3, offload_optimizer="nvme", offload_param="nvme", mixed_precision=True)
    return mm.need(job, plan), mm.nvme_traffic(job, plan)


def build(args, GPT, nvme_path: str):
    """The model under the engine's Init, straight into the swap files, and its engine."""
    import torch

    if args.engine == "deepspeed":
        import deepspeed
        init, initialize = deepspeed.zero.Init, deepspeed.initialize
    else:
        import zero
        init, initialize = zero.Init, zero.initialize
    cfg = config(args, nvme_path)
    with init(config_dict_or_path=cfg):
        torch.manual_seed(0)
        model = GPT()
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train(args, engine, rank: int) -> list[dict]:
    """--steps steps on this rank's fixed sequence: loss, seconds, bytes read and written."""
    import torch

    tokens = torch.randint(args.vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(rank))
    steps = []
    for _ in range(args.steps):
        read0, write0 = io_bytes()
        start = time.perf_counter()
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, args.vocab), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - start
        read1, write1 = io_bytes()
        steps.append({"loss": loss.item(), "s": seconds, "read": read1 - read0, "write": write1 - write0})
    return steps


def worker(args) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")  # DeepSpeed's deprecation warnings, once per collective
    rank = dist.get_rank()
    if args.cgroup:
        join_cgroup(args.cgroup)
    GPT, Block = make_model(args)
    compute_s = compute_floor_s(args, Block)
    reset_peak()  # the peak from here is the build's and training's
    started_kib = status_kib("VmRSS")
    nvme_path = os.path.join(args.root, f"rank{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    start = time.perf_counter()
    engine = build(args, GPT, nvme_path)
    build_s, build_peak_kib = time.perf_counter() - start, status_kib("VmHWM")
    reset_peak()  # the training's own peak from here
    steps = train(args, engine, rank)
    row = {"rank": rank, "steps": steps, "compute_s": compute_s, "build_s": build_s,
           "build_peak_mib": build_peak_kib / 1024, "train_peak_mib": status_kib("VmHWM") / 1024,
           "peak_mib": max(build_peak_kib, status_kib("VmHWM")) / 1024, "started_mib": started_kib / 1024}
    if args.engine == "zero":
        report = engine.memory_report()
        row.update(disk_nbytes=report.disk_nbytes, report=dataclasses.asdict(report))
    else:  # DeepSpeed's swap files stay in the folder
        row["disk_nbytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nvme_path) for f in fs)
    if args.checkpoint:
        row["phases"], saved = {}, os.path.join(args.checkpoint_at, "ckpt")
        measured(row["phases"], "save_checkpoint", lambda: engine.save_checkpoint(saved, tag="infinity"))
        measured(row["phases"], "load_checkpoint", lambda: engine.load_checkpoint(saved, tag="infinity"))
        row["bucket_mib"] = max(b.span.numel for b in engine.parts.group.buckets) * 4 / 2**20  # fp32 master
    engine.destroy()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


def checkpoint_lines(args, rows: list[dict], fp32: dict) -> list[str]:
    lines = [f"checkpoint ({args.checkpoint_at}): peak resident memory per rank against the training peak "
             f"(allowed: one bucket, {rows[0]['bucket_mib']:.0f} MiB of fp32 master)"]
    for name in ("save_checkpoint", "load_checkpoint"):
        rise = [r["phases"][name]["peak_mib"] - r["train_peak_mib"] for r in rows]
        cells = [f"rank {r['rank']} {r['phases'][name]['peak_mib']:.0f} MiB ({up:+.0f})" for r, up in zip(rows, rise)]
        over = max(rise)
        lines.append(f"  {name:<16} {max(r['phases'][name]['seconds'] for r in rows):7.1f} s  " + ", ".join(cells)
                     + ("  within one bucket" if over <= rows[0]["bucket_mib"] else "  OVER one bucket"))
    lines.append(f"  python -m zero.to_fp32 --max-shard-size {args.max_shard_size}: {fp32['seconds']:.1f} s, "
                 f"peak {fp32['peak_mib']:.0f} MiB, {fp32['files']} files ({fp32['total_gb']:.1f} GB, "
                 f"largest {fp32['largest_file_gb']:.2f} GB)")
    return lines


def make_cgroup(limit_gib: float) -> str:
    """A child of this process's cgroup v1 memory cgroup, limited to `limit_gib`."""
    from ringcomm.core import host

    found = host.memory_cgroup_folder()
    if found is None or found[1] != 1:
        raise SystemExit("infinity: --memory-limit needs a cgroup v1 memory controller (/sys/fs/cgroup/memory)")
    folder = os.path.join(found[0], f"infinity-{uuid.uuid4().hex[:8]}")
    os.mkdir(folder)
    with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
        f.write(str(int(limit_gib * 2**30)))
    return folder


def summarize(args, rows: list[dict], write_rate: float, read_rate: float, cgroup_peak: int | None) -> dict:
    timed = range(1, args.steps)
    step_s = [max(r["steps"][i]["s"] for r in rows) for i in timed]
    read = [sum(r["steps"][i]["read"] for r in rows) for i in timed]
    written = [sum(r["steps"][i]["write"] for r in rows) for i in timed]
    disk_s = statistics.median(read) / GB / read_rate + statistics.median(written) / GB / write_rate
    compute_s = max(r["compute_s"] for r in rows)
    floor = max(compute_s, disk_s)
    losses = [statistics.fmean(r["steps"][i]["loss"] for r in rows) for i in range(args.steps)]
    return {"step_s": statistics.median(step_s), "step_s_range": [min(step_s), max(step_s)], "compute_s": compute_s,
            "disk_s": disk_s, "floor_s": floor, "step_over_floor": statistics.median(step_s) / floor,
            "read_gb_per_step": statistics.median(read) / GB, "write_gb_per_step": statistics.median(written) / GB,
            "losses": losses, "loss_falls": all(map(math.isfinite, losses)) and losses[-1] < losses[0], "disk_gb": sum(r["disk_nbytes"] for r in rows) / GB,
            "peak_mib": [r["peak_mib"] for r in rows], "cgroup_peak_mib": cgroup_peak and cgroup_peak / 2**20}


def run(args) -> tuple[int, dict]:
    """Probes the disk, runs the ranks (in the cgroup, when asked) and, with
    --checkpoint, the consolidation; (exit code, what they measured)."""
    with tempfile.TemporaryDirectory(prefix="zero-infinity-", dir=args.nvme_path) as root:
        write_rate, read_rate = disk_rates(root, args.probe_gib)
        print(f"# disk ({args.nvme_path}): write {write_rate:.2f} GB/s, read {read_rate:.2f} GB/s (dd, O_DIRECT)")
        args.root, args.out = root, os.path.join(root, "rows.json")
        args.checkpoint_at = tempfile.mkdtemp(prefix="zero-infinity-ckpt-", dir=args.checkpoint_dir) \
            if args.checkpoint else None
        args.cgroup = make_cgroup(args.memory_limit) if args.memory_limit else None
        got = {"write_rate": write_rate, "read_rate": read_rate, "rows": None, "peak": None, "fp32": None}
        try:
            code = launch(worker, args, nproc=args.nproc, timeout_s=1800, deadline_s=14400)
            if args.cgroup:
                got["peak"] = int(open(os.path.join(args.cgroup, "memory.max_usage_in_bytes")).read())
            if code == 0:
                with open(args.out) as f:
                    got["rows"] = json.load(f)
                if args.checkpoint:
                    got["fp32"] = consolidate(os.path.join(args.checkpoint_at, "ckpt"),
                                              os.path.join(args.checkpoint_at, "fp32"), args.max_shard_size,
                                              args.cgroup)
        finally:
            if args.cgroup:
                time.sleep(0.5)
                os.rmdir(args.cgroup)
            if args.checkpoint_at:
                shutil.rmtree(args.checkpoint_at)
    return code, got


def memory_line(args, rows: list[dict], summary: dict) -> str:
    """The peak memory the build and training added per rank; for zero's engine
    against zero.estimate, with the NVMe bytes and traffic (into summary)."""
    added = [r["peak_mib"] - r["started_mib"] for r in rows]
    peaks = (f"build {max(r['build_peak_mib'] - r['started_mib'] for r in rows) / 1024:.2f} GiB, "
             f"training {max(r['train_peak_mib'] - r['started_mib'] for r in rows) / 1024:.2f} GiB")
    if args.engine != "zero":  # the estimate is of zero's engine
        return f"per rank, peak resident memory added: {max(added) / 1024:.2f} GiB ({peaks})"
    need, (read, written) = estimated(args)
    est = summary["estimate"] = {"memory_gb": (need.device_nbytes + need.host_nbytes) / GB,
                                 "nvme_gb": need.nvme_nbytes / GB, "measured_memory_gb": max(added) * 2**20 / GB,
                                 "measured_nvme_gb": max(r["disk_nbytes"] for r in rows) / GB,
                                 "read_gb_per_step": read / GB, "write_gb_per_step": written / GB}
    return (f"per rank, zero.estimate vs measured: memory {est['memory_gb']:.2f} vs {est['measured_memory_gb']:.2f} GB "
            f"(peak resident memory added by the build and training; {peaks}), NVMe {est['nvme_gb']:.2f} vs "
            f"{est['measured_nvme_gb']:.2f} GB (swap files); per step read {read / GB:.2f} vs "
            f"{summary['read_gb_per_step'] / args.nproc:.2f} GB, written {written / GB:.2f} vs "
            f"{summary['write_gb_per_step'] / args.nproc:.2f} GB")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.checkpoint and args.engine != "zero":
        raise SystemExit("infinity: --checkpoint measures zero's checkpoints (--engine zero)")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))  # freed blocks leave the resident set
    params = num_params(args)
    print(f"# infinity: {params / 1e9:.2f}B parameters, {16 * params / GB:.0f} GB of model states, {args.nproc} ranks, "
          f"seq {args.seq}; {cpu_model()}; {os.cpu_count()} cpus; loadavg {open('/proc/loadavg').read().split()[:3]}")
    code, got = run(args)
    if code != 0:
        return code
    rows = got["rows"]
    print(f"{'step':>4} {'loss':>8} {'s':>8} {'read GB':>8} {'write GB':>8}")
    for i in range(args.steps):
        print(f"{i:>4} {statistics.fmean(r['steps'][i]['loss'] for r in rows):>8.4f} "
              f"{max(r['steps'][i]['s'] for r in rows):>8.2f} {sum(r['steps'][i]['read'] for r in rows) / GB:>8.2f} "
              f"{sum(r['steps'][i]['write'] for r in rows) / GB:>8.2f}")
    summary = summarize(args, rows, got["write_rate"], got["read_rate"], got["peak"])
    print(f"step {summary['step_s']:.1f} s (median of steps 1-{args.steps - 1}), floor {summary['floor_s']:.1f} s "
          f"(compute {summary['compute_s']:.1f} s, disk {summary['disk_s']:.1f} s): {summary['step_over_floor']:.2f}x")
    print(memory_line(args, rows, summary))
    print(f"peak resident memory per rank (VmHWM): {[round(p) for p in summary['peak_mib']]} MiB; cgroup peak: "
          f"{summary['cgroup_peak_mib'] and round(summary['cgroup_peak_mib'])} MiB; swap files {summary['disk_gb']:.1f} GB; "
          f"build {max(r['build_s'] for r in rows):.0f} s; loss falls: {summary['loss_falls']}")
    if got["fp32"]:
        summary["to_fp32"] = got["fp32"]
        print("\n".join(checkpoint_lines(args, rows, got["fp32"])))
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("root", "out", "cgroup", "checkpoint_at")},
                           "disk_gbps": {"write": got["write_rate"], "read": got["read_rate"]}, "rows": rows,
                           "summary": summary})
    print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
