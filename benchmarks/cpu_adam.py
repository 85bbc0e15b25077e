"""The host optimizer step of ZeRO-Offload, ns per parameter, one process:
global gradient norm, unscale/clip, AdamW update of fp32 master and moments,
bf16 copy-out of the parameter (the whole step as each implementation runs it).

    python benchmarks/cpu_adam.py [--sizes 10e6,100e6] [--threads 2] [--repeats 3]

Rows: the engine (zero/host_adam.py: csrc/cpu/kernels/adam.cpp, one pass incl. unscale
and the bf16 copy), torch's fused AdamW (grad_scale folds the unscale in; a
second pass for the bf16 copy), torch's foreach AdamW (separate unscale pass),
DeepSpeed's path (its unscale pass, DeepSpeedCPUAdam, then the copy; built
through DeepSpeed's op builder, DS_ACCELERATOR=cpu; skipped where it does not
build). Columns: ns/param, the bytes each moves per parameter by the count
below, the GB/s that makes, and the same run's memory bandwidth (a
multi-threaded read+write stream). Writes JSON.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from machine import cpu_line, write_json  # noqa: E402
from zero.optim import host_adam  # noqa: E402

# bytes read + written per parameter: norm (read grad 4); a fused Adam pass (grad
# 4, master/exp_avg/exp_avg_sq read and written 24); a separate unscale (8); a
# separate bf16 copy (read 4, write 2) or the copy inside the pass (write 2);
# torch's foreach AdamW: decay 8, lerp 12, mul+addcmul 20, sqrt 8, div 8, add 8, addcdiv 16
BYTES = {"engine (fused C++)": 4 + 28 + 2, "torch fused": 4 + 28 + 6, "torch foreach": 4 + 8 + 80 + 6,
         "DeepSpeed (CPUAdam)": 4 + 8 + 28 + 6}
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.999), 1e-8, 0.01, 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10e6,100e6", help="parameters, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="bench-results/cpu_adam.json")
    return p.parse_args(argv)


def clip_coef(grad: torch.Tensor, scale: float) -> float:
    norm = float(torch.linalg.vector_norm(grad)) / scale
    return min(1.0, CLIP / (norm + 1e-6)) / scale


def engine_step(numel: int):
    master = torch.randn(numel).requires_grad_()
    opt = torch.optim.AdamW([master], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    out, grad = torch.empty(numel, dtype=torch.bfloat16), torch.randn(numel)

    def step() -> None:
        master.grad = grad
        host_adam.adam_step(opt, clip_coef(grad, 1024.0), {id(master): out})
    return step


def torch_step(numel: int, fused: bool):
    master = torch.randn(numel).requires_grad_()
    opt = torch.optim.AdamW([master], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            fused=fused, foreach=not fused)
    out, grad = torch.empty(numel, dtype=torch.bfloat16), torch.randn(numel)

    def step() -> None:
        master.grad = grad
        coef = clip_coef(grad, 1024.0)
        if fused:
            opt.grad_scale = torch.tensor(1.0 / coef)
        else:
            grad.mul_(coef)
        opt.step()
        opt.__dict__.pop("grad_scale", None)
        out.copy_(master.detach())
    return step


def deepspeed_step(numel: int):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    master = torch.randn(numel).requires_grad_()
    opt = DeepSpeedCPUAdam([master], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    out, grad = torch.empty(numel, dtype=torch.bfloat16), torch.randn(numel)

    def step() -> None:
        master.grad = grad
        grad.mul_(clip_coef(grad, 1024.0))  # DeepSpeed's unscale_and_clip_grads
        opt.step()
        out.copy_(master.detach())  # its fp32 partition to the 16-bit parameters
    return step


def stream_gbps(threads: int, nbytes: int = 512 << 20) -> float:
    """Read+write bandwidth of a multi-threaded copy (torch's, on `threads` threads)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / min(times[1:]) / 1e9


def measure(make, numel: int, repeats: int) -> float:
    step = make(numel)
    step()  # states allocated, pages touched
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / numel * 1e9


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    makers = {"engine (fused C++)": engine_step, "torch fused": lambda n: torch_step(n, True),
              "torch foreach": lambda n: torch_step(n, False), "DeepSpeed (CPUAdam)": deepspeed_step}
    bandwidth = stream_gbps(args.threads)
    rows = []
    for numel in (int(float(s)) for s in args.sizes.split(",")):
        for name, make in makers.items():
            try:
                ns = measure(make, numel, args.repeats)
            except Exception as error:  # DeepSpeed's op builder needs a compiler and its headers
                rows.append({"impl": name, "numel": numel, "error": f"{type(error).__name__}: {error}"[:200]})
                continue
            rows.append({"impl": name, "numel": numel, "ns_per_param": ns, "bytes_per_param": BYTES[name],
                         "gbps": BYTES[name] / ns})
    print(f"# {cpu_line()}")
    print(f"{'params':>8} {'implementation':<22} {'ns/param':>9} {'B/param':>8} {'GB/s':>6} {'stream GB/s':>11}")
    for row in rows:
        if "error" in row:
            print(f"{row['numel'] / 1e6:>7.0f}M {row['impl']:<22} {row['error']}")
            continue
        print(f"{row['numel'] / 1e6:>7.0f}M {row['impl']:<22} {row['ns_per_param']:>9.3f} {row['bytes_per_param']:>8} "
              f"{row['gbps']:>6.1f} {bandwidth:>11.1f}")
    speedups = {}
    for numel in {row["numel"] for row in rows}:
        ns = {row["impl"]: row.get("ns_per_param") for row in rows if row["numel"] == numel}
        if ns.get("DeepSpeed (CPUAdam)") and ns.get("engine (fused C++)"):
            speedups[numel] = ns["DeepSpeed (CPUAdam)"] / ns["engine (fused C++)"]
            print(f"{numel / 1e6:.0f}M: DeepSpeed / engine = {speedups[numel]:.2f}x")
    report = {"threads": args.threads, "stream_gbps": bandwidth, "rows": rows,
              "deepspeed_over_engine": {str(k): v for k, v in speedups.items()}}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
