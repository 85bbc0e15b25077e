"""Step time of the zero engine per ZeRO stage against DeepSpeed (CPU
accelerator), DDP and FSDP2, on 2 ranks, same model, config and data, one run.

    python benchmarks/zero_step.py [--width 512] [--layers 4] [--steps 8]
    torchrun --nproc-per-node 2 benchmarks/zero_step.py

Every framework trains the same bf16 MLP with fp32 master weights, AdamW,
clipping 1.0, the same buckets; a step is forward + backward + optimizer step.
DDP runs fp32 parameters under bf16 autocast (fp32 gradients: torch's bf16
compress hook needs CUDA/NCCL), FSDP2 bf16 parameters / reductions over fp32 shards (ZeRO-3's recipe).
Prints median step times, zero / DeepSpeed, and the MB each rank sent in a
step: zero's counted at zero/sharding/seam.py, DeepSpeed's at torch.distributed's Python
collectives (ring volumes for both); writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import launch  # noqa: E402

from ringcomm.plan.schedule import bus_factor

STAGES = (0, 1, 2, 3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4, help="blocks of Linear(w, 4w), ReLU, Linear(4w, w)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket", type=float, default=2e6, help="reduce/allgather bucket size (elements)")
    p.add_argument("--frameworks", default="zero,zero-unfused,zero-torch,deepspeed,ddp,fsdp2",
                   help="zero-unfused: per-tensor AdamW; "
                        "zero-torch: plain torch.distributed; also zero-inline (overlap_comm false)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank, the default group on NCCL (zero on ringcomm then runs "
                        "torch.distributed's collectives); only the zero frameworks run there")
    p.add_argument("--json", default="bench-results/zero_step.json")
    return p.parse_args(argv)


def device(args):
    import torch
    import torch.distributed as dist
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if args.device == "cuda" else \
        torch.device("cpu")


def make_model(args):
    import torch
    from torch import nn
    torch.manual_seed(0)
    w = args.width
    return nn.Sequential(*(nn.Sequential(nn.Linear(w, 4 * w), nn.ReLU(), nn.Linear(4 * w, w))
                           for _ in range(args.layers))).to(device(args))


def ds_config(args, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket,
                                  "allgather_bucket_size": args.bucket, "overlap_comm": True,
                                  "contiguous_gradients": True, "stage3_prefetch_bucket_size": args.bucket,
                                  "stage3_param_persistence_threshold": 10 * args.width}}


def interleave(args, steps: dict) -> dict:
    """Median seconds per step of each framework. Frameworks take turns step by
    step (the order rotating each round), so a busy machine slows all alike."""
    import torch.distributed as dist
    names = list(steps)
    times: dict = {name: [] for name in names}
    for i in range(args.warmup + args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            steps[name](i)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def batch(args, i: int, dtype):
    import torch
    import torch.distributed as dist
    g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    return torch.randn(args.batch, args.width, generator=g).to(device(args), dtype)


class WireCounter:
    """Bytes this rank would send for the torch.distributed collectives called
    from Python (DeepSpeed's path), with ring volumes: all_reduce 2 S (n-1)/n,
    reduce-scatter / all-gather S (n-1)/n, S the full tensor's bytes."""

    OPS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
           "_reduce_scatter_base": "reduce_scatter", "all_gather_into_tensor": "all_gather",
           "_all_gather_base": "all_gather"}  # torch.distributed's name -> the collective

    def __init__(self) -> None:
        self.nbytes = 0.0

    def install(self) -> None:
        import torch.distributed as dist
        for name, op in self.OPS.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, op))

    def _wrap(self, original, op: str):
        import torch.distributed as dist

        def counted(*args, **kwargs):
            tensors = [a for a in args[:2] if hasattr(a, "numel")] + \
                [kwargs[k] for k in ("tensor", "output_tensor", "input_tensor", "output", "input") if k in kwargs]
            full = max((t.numel() * t.element_size() for t in tensors), default=0)
            world_size = dist.get_world_size(kwargs.get("group"))
            self.nbytes += full * bus_factor(op, world_size)
            return original(*args, **kwargs)
        return counted


WIRE = WireCounter()


def engine_step(args, stage: int, framework: str):
    import torch
    model = make_model(args)
    # zero-unfused: the caller picks the per-tensor AdamW, so the engine does not
    # switch the master shard to torch's fused kernel (what DeepSpeed runs here)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False if framework == "zero-unfused" else None)
    if framework == "deepspeed":
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args, stage))
    else:
        import zero
        backend = "torch" if framework == "zero-torch" else "ringcomm"
        config = ds_config(args, stage)
        config["zero_optimization"]["overlap_comm"] = framework != "zero-inline"
        engine, *_ = zero.initialize(model=model, optimizer=optimizer, config=config, comm_backend=backend)

    def step(i: int) -> None:
        before = WIRE.nbytes
        loss = engine(batch(args, i, torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        step.sent_nbytes = engine.wire_report().sent_nbytes if framework != "deepspeed" else WIRE.nbytes - before
    return step


def ddp_step(args):
    import torch
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(make_model(args), bucket_cap_mb=args.bucket * 4 / 2**20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch(args, i, torch.float32)).float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return step


def fsdp2_step(args):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = make_model(args)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> None:
        loss = model(batch(args, i, torch.bfloat16)).float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return step


def measure_stage(args, stage: int, frameworks: list[str]) -> dict:
    """{framework: seconds or error text} at one stage (DDP: stage 0, FSDP2: stage 3)."""
    steps, out = {}, {}
    for framework in frameworks:
        if (framework == "ddp" and stage != 0) or (framework == "fsdp2" and stage != 3):
            continue
        if args.device == "cuda" and not framework.startswith("zero"):
            out[framework] = "runs on CPU only in this benchmark"
            continue
        try:
            steps[framework] = (ddp_step(args) if framework == "ddp" else fsdp2_step(args)
                                if framework == "fsdp2" else engine_step(args, stage, framework))
        except Exception as error:  # reported in the table; the other columns still run
            out[framework] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
    out.update(interleave(args, steps))
    for name in ("zero", "deepspeed"):  # bytes this rank sent in the last step
        if name in steps:
            out[f"{name} MB/step"] = steps[name].sent_nbytes / 1e6
    return out


def table(results: dict) -> str:
    def cell(v) -> str:
        return f"{v * 1e3:9.1f}" if isinstance(v, float) else f"{'-':>9}"
    lines = [f"{'framework':<12}" + "".join(f"{'stage ' + str(s) + ' ms':>11}" for s in STAGES)]
    for framework, row in results.items():
        if framework.endswith("MB/step"):
            lines.append(f"{framework.replace('deepspeed', 'DS'):<12}" + "".join(f"{row.get(s, 0):11.1f}" for s in STAGES))
            continue
        lines.append(f"{framework:<12}" + "".join(f"{cell(row.get(s)):>11}" for s in STAGES))
    zero, ds = results.get("zero", {}), results.get("deepspeed", {})
    ratios = [f"{zero[s] / ds[s]:11.2f}" if isinstance(zero.get(s), float) and isinstance(ds.get(s), float)
              else f"{'-':>11}" for s in STAGES]
    lines.append(f"{'zero / DS':<12}" + "".join(ratios))
    for framework, row in results.items():
        for s, v in row.items():
            if isinstance(v, str):
                lines.append(f"note: {framework} stage {s}: {v}")
    return "\n".join(lines)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    WIRE.install()
    frameworks = args.frameworks.split(",")
    results: dict = {f: {} for f in frameworks}
    for stage in STAGES:
        for framework, value in measure_stage(args, stage, frameworks).items():
            results.setdefault(framework, {})[stage] = value
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in make_model(args).parameters())
        print(f"zero_step: {dist.get_world_size()} ranks on {args.device}, bf16 MLP {args.layers}x(w={args.width}), "
              f"{params / 1e6:.1f} M parameters, micro batch {args.batch}, median of {args.steps} steps")
        print(table(results), flush=True)
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "params": params, "seconds": results}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    backend = "nccl" if args.device == "cuda" else "gloo"
    return launch(worker, args, nproc=args.nproc, timeout_s=300, deadline_s=1200, backend=backend)


if __name__ == "__main__":
    sys.exit(main())
