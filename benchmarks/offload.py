"""ZeRO-Offload and ZeRO-Infinity on 2 ranks: step time and peak resident
memory per rank for stages 2 and 3 with offload none / cpu / nvme, and the
model-state bytes per rank on device, host and disk from engine.memory_report().

    python benchmarks/offload.py [--width 512] [--blocks 96] [--nvme-path DIR] [--cases 2:none,3:nvme]

The model: bf16 MLP blocks of Linear(w, 4w), ReLU, Linear(4w, w) (96 blocks of
w=512: 201 M parameters), AdamW, clipping 1.0, micro batch 4. Each case runs in
fresh processes. Peak memory is VmHWM, reset (/proc/self/clear_refs) once the
engine is built, so it is the training peak; "added" is that peak minus the
resident memory before the model was made (torch and torch.optim imported,
ringcomm's group set up). The build's own
peak is reported apart. Large blocks are kept mmapped (MALLOC_MMAP_THRESHOLD_),
so memory freed after the build leaves the resident set. nvme: both offload sections at stage 3 (max_in_cpu 0),
the optimizer's at stage 2. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import launch  # noqa: E402
from machine import status_kib  # noqa: E402

CASES = "2:none,2:cpu,2:nvme,3:none,3:cpu,3:nvme"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--blocks", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="the first is not timed")
    p.add_argument("--sub-group-size", type=float, default=1e6)
    p.add_argument("--nvme-path", default=None, help="default: a temporary directory under /tmp")
    p.add_argument("--cases", default=CASES, help="stage:offload, comma-separated")
    p.add_argument("--json", default="bench-results/offload.json")
    return p.parse_args(argv)


def config(args, stage: int, offload: str, nvme_path: str) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 4e6, "stage3_prefetch_bucket_size": 4e6,
            "stage3_param_persistence_threshold": 10 * args.width, "sub_group_size": args.sub_group_size}
    if offload != "none":
        section = {"device": offload, "pin_memory": True}
        if offload == "nvme":
            section.update(nvme_path=nvme_path, buffer_count=4, pipeline_read=True, pipeline_write=True)
        zero["offload_optimizer"] = dict(section)
        if stage == 3:
            zero["offload_param"] = dict(section, buffer_count=5, max_in_cpu=0)
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": zero, "aio": {"block_size": 1 << 20, "thread_count": 2}}


def make_model(args):
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: no fp32 copy of 200 M parameters first
    w = args.width
    model = nn.Sequential(*(nn.Sequential(nn.Linear(w, 4 * w), nn.ReLU(), nn.Linear(4 * w, w))
                            for _ in range(args.blocks)))
    torch.set_default_dtype(torch.float32)
    return model


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import ringcomm
    import zero

    torch.set_num_threads(1)
    rank = dist.get_rank()
    ringcomm.default_group()  # the transport's own memory is no model state: in the baseline,
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # as torch.optim's first-use imports (~70 MiB)
    before_kib = status_kib("VmRSS")
    nvme_path = os.path.join(args.nvme_root, f"rank{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    model = make_model(args)
    numel = sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=config(args, args.stage, args.offload, nvme_path),
                                     comm_backend="ringcomm")
    del model
    build_peak_kib, built_kib = status_kib("VmHWM"), status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.backward(engine(x).float().square().mean())
        engine.step()
        times.append(time.perf_counter() - start)
    report = engine.memory_report()
    row = {"stage": args.stage, "offload": args.offload, "rank": rank,
           "params": numel,
           "step_s": statistics.median(times[1:] or times), "peak_added_mib": (status_kib("VmHWM") - before_kib) / 1024,
           "build_peak_added_mib": (build_peak_kib - before_kib) / 1024,
           "built_added_mib": (built_kib - before_kib) / 1024,
           "device_mib": report.device_nbytes / 2**20, "host_mib": report.host_nbytes / 2**20,
           "disk_mib": report.disk_nbytes / 2**20, "model_state_mib": report.model_state_nbytes / 2**20,
           "comm_buffer_mib": report.comm_buffer_nbytes / 2**20,
           "swap_files_named": len(os.listdir(nvme_path))}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # glibc raises its mmap threshold to the size of each freed mmapped block, after which
    # the model's freed build-time tensors stay resident in the heap and pollute VmHWM:
    # a fixed threshold keeps large blocks mmapped, so freeing returns them to the OS
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero-offload-", dir=args.nvme_path) as root:
        for case in args.cases.split(","):
            stage, offload = case.split(":")
            args.stage, args.offload, args.nvme_root = int(stage), offload, root
            args.out = os.path.join(root, "rows.json")
            code = launch(worker, args, nproc=args.nproc, timeout_s=600, deadline_s=1200)
            if code != 0:
                print(f"offload: stage {stage} {offload} failed (exit {code})", file=sys.stderr)
                return code
            with open(args.out) as f:
                rows.extend(json.load(f))
    print(f"{'stage':>5} {'offload':>7} {'rank':>4} {'step s':>7} {'peak+ MiB':>9} {'build+ MiB':>10} "
          f"{'device MiB':>10} {'host MiB':>8} {'disk MiB':>8}")
    for r in rows:
        print(f"{r['stage']:>5} {r['offload']:>7} {r['rank']:>4} {r['step_s']:>7.2f} {r['peak_added_mib']:>9.0f} "
              f"{r['build_peak_added_mib']:>10.0f} {r['device_mib']:>10.0f} {r['host_mib']:>8.0f} {r['disk_mib']:>8.0f}")
    summary = summarize(rows)
    for line in summary["lines"]:
        print(line)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("out", "nvme_root")}, "rows": rows,
                   "summary": summary}, f, indent=1)
    return 0


def summarize(rows: list[dict]) -> dict:
    """The acceptance ratios: stage-3 nvme peak over stage-3 none (max over
    ranks), stage-2 cpu step time over stage-2 none."""
    def worst(stage: int, offload: str, key: str) -> float | None:
        values = [r[key] for r in rows if r["stage"] == stage and r["offload"] == offload]
        return max(values) if values else None
    out: dict = {"lines": []}
    nvme, none3 = worst(3, "nvme", "peak_added_mib"), worst(3, "none", "peak_added_mib")
    if nvme is not None and none3:
        out["stage3_nvme_over_none_peak"] = nvme / none3
        out["lines"].append(f"stage 3 peak added, nvme / none: {nvme:.0f} / {none3:.0f} MiB = {nvme / none3:.2f}")
    cpu, none2 = worst(2, "cpu", "step_s"), worst(2, "none", "step_s")
    if cpu is not None and none2:
        out["stage2_cpu_over_none_step"] = cpu / none2
        out["lines"].append(f"stage 2 step, cpu / none: {cpu:.2f} / {none2:.2f} s = {cpu / none2:.2f}")
    return out


if __name__ == "__main__":
    sys.exit(main())
