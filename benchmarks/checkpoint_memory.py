"""Peak memory of each phase of a ZeRO run, per rank: building the model under
zero.Init, training steps, save_checkpoint, load_checkpoint, save_16bit_model
(Hugging Face shards) and, on rank 0, python -m zero.to_fp32 --max-shard-size.
ZeRO's promise is that no phase holds the model: a save or load may rise
above the training peak by at most one bucket.

    python benchmarks/checkpoint_memory.py                       # ~400M parameters, stage 3, bf16, 2 ranks
    python benchmarks/checkpoint_memory.py --layers 48 --width 2048 --dtype fp32

The model is a stack of `--layers` bias-free Linear(width, width) (width^2
parameters each), trained with Adam at the engine's defaults beyond the stage
and precision. Each phase resets the peak (/proc/self/clear_refs) and reports
VmHWM (absolute) and its rise over the RSS at the phase's start. Writes JSON.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import launch  # noqa: E402
from machine import join_cgroup, reset_peak, status_kib, write_json  # noqa: E402

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-shard-size", default="1GB")
    p.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temporary folder)")
    p.add_argument("--json", default="bench-results/checkpoint_memory.json")
    return p.parse_args(argv)


def measured(phases: dict, name: str, fn) -> None:
    """Runs fn as phase `name`: its peak RSS, its rise over the RSS at its start, its time."""
    import torch.distributed as dist
    dist.barrier()
    reset_peak()
    start_kib, start = status_kib("VmRSS"), time.perf_counter()
    fn()
    phases[name] = {"peak_mib": status_kib("VmHWM") / 1024, "rise_mib": (status_kib("VmHWM") - start_kib) / 1024,
                    "seconds": time.perf_counter() - start}


def consolidate(checkpoint: str, out: str, max_shard_size: str, cgroup: str | None = None) -> dict:
    """python -m zero.to_fp32 --max-shard-size on `checkpoint`, in a process of
    its own (joining `cgroup`, a cgroup folder, when given): its peak RSS (from
    wait4), seconds and files."""
    command = [sys.executable, "-m", "zero.to_fp32", checkpoint, out, "--max-shard-size", max_shard_size]
    start = time.perf_counter()
    proc = subprocess.Popen(command, preexec_fn=functools.partial(join_cgroup, cgroup) if cgroup else None)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} exited with {proc.returncode}")
    sizes = [os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))]
    return {"seconds": time.perf_counter() - start, "peak_mib": usage.ru_maxrss / 1024, "files": len(sizes),
            "largest_file_gb": max(sizes) / 1e9, "total_gb": sum(sizes) / 1e9}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import zero
    from zero.checkpoint import to_fp32

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    ds = {"train_batch_size": dist.get_world_size(), "train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
          "bf16": {"enabled": args.dtype == "bf16"}, "zero_optimization": {"stage": args.stage}}
    phases: dict = {}
    built: dict = {}

    def build() -> None:
        with zero.Init(config_dict_or_path=ds, enabled=args.stage == 3):
            model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
        built["engine"], *_ = zero.initialize(model=model, config=ds)
    measured(phases, "build", build)
    engine = built["engine"]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    def train() -> None:
        for _ in range(args.steps):
            x = torch.randn(1, args.width, dtype=dtype)
            engine.backward(engine(x).float().square().mean())
            engine.step()
    measured(phases, "train", train)
    ckpt, out16, out32 = (os.path.join(args.root, name) for name in ("ckpt", "z16", "fp32"))
    measured(phases, "save_checkpoint", lambda: engine.save_checkpoint(ckpt))
    measured(phases, "load_checkpoint", lambda: engine.load_checkpoint(ckpt))
    measured(phases, "save_16bit_model", lambda: engine.save_16bit_model(
        out16, "model.safetensors", max_shard_size=args.max_shard_size))
    measured(phases, "to_fp32", lambda: rank == 0 and to_fp32.convert(ckpt, out32, max_shard_size=args.max_shard_size))
    bucket_mib = max(b.span.numel for b in engine.parts.group.buckets) * 4 / MIB  # fp32: a gathered master
    result = {"rank": rank, "phases": phases, "bucket_mib": bucket_mib, "disk_mib": disk_mib(args.root)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)


def disk_mib(root: str) -> dict:
    sizes = {}
    for name in ("ckpt", "z16", "fp32"):
        total = 0
        for folder, _, files in os.walk(os.path.join(root, name)):
            total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
        sizes[name] = total / MIB
    return sizes


def table(ranks: list[dict]) -> str:
    names = list(ranks[0]["phases"])
    lines = ["| phase | " + " | ".join(f"rank {r['rank']} peak MiB (rise)" for r in ranks) + " | seconds |",
             "| --- |" + " --- |" * (len(ranks) + 1)]
    for name in names:
        cells = [f"{r['phases'][name]['peak_mib']:.0f} ({r['phases'][name]['rise_mib']:+.0f})" for r in ranks]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ranks[0]['phases'][name]['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = args.layers * args.width**2
    root = args.dir or tempfile.mkdtemp(prefix="zero-ckpt-mem-")
    os.makedirs(root, exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        args.out = f.name
    args.root = root
    print(f"{params / 1e6:.0f}M parameters, stage {args.stage}, {args.dtype}, {args.nproc} ranks; files in {root}",
          flush=True)
    try:
        code = launch(worker, args, nproc=args.nproc, timeout_s=1800, deadline_s=7200)
        if code != 0:
            return code
        with open(args.out) as f:
            ranks = json.load(f)
    finally:
        os.unlink(args.out)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    train_peak = max(r["phases"]["train"]["peak_mib"] for r in ranks)
    bucket = ranks[0]["bucket_mib"]
    print(table(ranks))
    print(f"largest bucket (fp32) {bucket:.0f} MiB; files MiB: {ranks[0]['disk_mib']}")
    for name in ("save_checkpoint", "load_checkpoint", "save_16bit_model", "to_fp32"):
        over = max(r["phases"][name]["peak_mib"] for r in ranks) - train_peak
        print(f"{name}: peak {over:+.0f} MiB against the training peak ({'within' if over <= bucket else 'OVER'} "
              f"one bucket)")
    write_json(args.json, {"params": params, "stage": args.stage, "dtype": args.dtype, "nproc": args.nproc,
                           "max_shard_size": args.max_shard_size, "ranks": ranks})
    return 0


if __name__ == "__main__":
    sys.exit(main())
