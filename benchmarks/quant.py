"""Blockwise quantization kernels (ringcomm.kernels.quant) against torch doing the same work and
against the same run's memcpy, one process, GB/s per byte of the float side; with
--collectives, the quantized collectives themselves on local ranks.

    python benchmarks/quant.py [--sizes-mib 1,4,16,64] [--repeats 7] [--quick] [--json PATH]
    python benchmarks/quant.py --collectives [--transports shm,torch_dist,hierarchical] [--nproc 2]

For bf16 and fp32 inputs of each size: int8 (block 4096, qwZ) and int4 (block 1024, qgZ);
ops quantize, dequantize, dequantize_sum with k = 2 and 4 (GB/s counts the float output
once, as a fused kernel writes it). "torch" is the vectorised plain-torch reference of
tests/quant_reference.py (same results bit for bit). "memcpy" is torch's dst.copy_(src) of
the float side's bytes; /memcpy = ours / memcpy. /touched judges the kernel by all the bytes it
reads and writes (float side, data and scales of every row) against memcpy moving as many
(it reads and writes each byte it copies): touched bytes per second / (2 * memcpy).
--collectives times quantized_all_gather (1 MiB fp32 output, int8 in blocks of 4096) and
quantized_reduce_scatter (1 MiB fp32 input, int4 in blocks of 1024) on --nproc local ranks
per transport (hierarchical: half the ranks on each of two simulated hosts): the median over
--repeats of the mean call time of a batch of calls.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import quant_reference as ref  # noqa: E402
from launch import launch  # noqa: E402
from machine import cpu_line, write_json  # noqa: E402
import torch  # noqa: E402

from ringcomm.kernels import quant

FORMATS = {"int8": (8, 4096), "int4": (4, 1024)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="1,4,16,64", help="float-side MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions; the median is reported")
    p.add_argument("--quick", action="store_true", help="1 and 16 MiB, 3 repeats")
    p.add_argument("--no-torch", action="store_true", help="skip the plain-torch rows (slow at 64 MiB)")
    p.add_argument("--json", default="bench-results/quant.json")
    p.add_argument("--collectives", action="store_true", help="time the quantized collectives instead")
    p.add_argument("--transports", default="shm,torch_dist", help="--collectives: comma-separated")
    p.add_argument("--nproc", type=int, default=2, help="--collectives: local ranks")
    p.add_argument("--collective-mib", type=int, default=1, help="--collectives: full buffer, MiB of fp32")
    return p.parse_args(argv)


def median_s(fn, repeats: int) -> float:
    fn()  # warm: page faults, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cases(x: torch.Tensor, bits: int, block: int) -> dict:
    """{op: (ours, torch)} closures doing the same work on x's data."""
    n, dtype = x.numel(), x.dtype
    data, scales = quant.quantize(x, bits=bits, block=block)
    out = torch.empty_like(x)
    rows = {k: (data.expand(k, -1).contiguous(), scales.expand(k, -1).contiguous()) for k in (2, 4)}
    ops = {"quantize": (lambda: quant.quantize_into(x, data, scales, bits=bits, block=block),
                        lambda: ref.quantize(x, bits=bits, block=block)),
           "dequantize": (lambda: quant.dequantize(data, scales, out, bits=bits, block=block),
                          lambda: ref.dequantize(data, scales, n, dtype, bits=bits, block=block))}
    for k, (d, s) in rows.items():
        ops[f"dequantize_sum k={k}"] = (
            lambda d=d, s=s: quant.dequantize_sum(d, s, out, bits=bits, block=block),
            lambda d=d, s=s: ref.dequantize_sum(d, s, n, dtype, bits=bits, block=block))
    return ops


def touched_nbytes(op: str, nbytes: int, numel: int, bits: int, block: int) -> int:
    """Bytes an op reads plus writes: the float side once, data and scales once per row."""
    rows = int(op.split("k=")[1]) if "k=" in op else 1
    return nbytes + rows * (quant.packed_nbytes(numel, bits) + 4 * quant.num_blocks(numel, block))


def measure(args: argparse.Namespace) -> list[dict]:
    sizes = [1, 16] if args.quick else [int(s) for s in args.sizes_mib.split(",")]
    repeats = 3 if args.quick else args.repeats
    results = []
    for mib in sizes:
        for dname, dtype in DTYPES.items():
            numel = (mib << 20) // torch.finfo(dtype).bits * 8
            x = torch.randn(numel).to(dtype)
            dst = torch.empty_like(x)
            nbytes = x.numel() * x.element_size()
            memcpy = nbytes / median_s(lambda: dst.copy_(x), repeats) / 1e9
            for fname, (bits, block) in FORMATS.items():
                for op, (ours, theirs) in cases(x, bits, block).items():
                    seconds = median_s(ours, repeats)
                    row = {"mib": mib, "dtype": dname, "format": fname, "op": op, "memcpy_gbps": memcpy,
                           "ours_gbps": nbytes / seconds / 1e9, "torch_gbps": None}
                    if not args.no_torch:
                        row["torch_gbps"] = nbytes / median_s(theirs, max(1, repeats // 2)) / 1e9
                    row["ratio_memcpy"] = row["ours_gbps"] / memcpy
                    touched = touched_nbytes(op, nbytes, numel, bits, block)
                    row["ratio_touched"] = touched / seconds / 1e9 / (2 * memcpy)
                    results.append(row)
                    print_row(row)
    return results


def time_collectives(args: argparse.Namespace) -> None:
    """On every rank (under launch): each transport's quantized collectives; rank 0 prints and writes JSON."""
    import torch.distributed as dist

    import ringcomm

    rank, world_size = dist.get_rank(), dist.get_world_size()
    numel = (args.collective_mib << 20) // 4
    chunk = numel // world_size
    x, gathered = torch.randn(chunk), torch.empty(chunk * world_size)
    y, reduced = torch.randn(chunk * world_size), torch.empty(chunk)
    results = []
    for transport in args.transports.split(","):
        os.environ["RINGCOMM_HOST"] = "ab"[rank * 2 // world_size] if transport == "hierarchical" else "a"
        group = ringcomm.new_group(transport=transport, timeout=60.0)
        calls = {"quantized_all_gather": lambda: ringcomm.quantized_all_gather(gathered, x, group),
                 "quantized_reduce_scatter": lambda: ringcomm.quantized_reduce_scatter(reduced, y, group=group)}
        for op, call in calls.items():
            batch = 20
            seconds = median_s(lambda: [call() for _ in range(batch)], args.repeats) / batch
            row = {"transport": transport, "op": op, "mib": args.collective_mib, "world_size": world_size,
                   "us": seconds * 1e6}
            results.append(row)
            if rank == 0:
                print(f"{transport:>12} {op:<26} {args.collective_mib:>4} MiB {world_size:>3} ranks "
                      f"{row['us']:10.1f} us", flush=True)
        group.close()
    if rank == 0 and args.json:
        write_json(args.json, {"results": results})


def print_row(row: dict) -> None:
    torch_gbps = row["torch_gbps"]
    torch_text = f"{torch_gbps:8.2f} {row['ours_gbps'] / torch_gbps:7.1f}x" if torch_gbps else f"{'-':>8} {'-':>8}"
    print(f"{row['mib']:>4} {row['dtype']:>5} {row['format']:>5} {row['op']:<20} {row['ours_gbps']:8.2f} "
          f"{torch_text} {row['memcpy_gbps']:8.2f} {row['ratio_memcpy']:7.2f} {row['ratio_touched']:8.2f}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with open("/proc/loadavg") as f:
        loadavg = f.read().split()[:3]
    print(f"# {cpu_line()}")
    print(f"loadavg {' '.join(loadavg)}; torch threads {torch.get_num_threads()}")
    if args.collectives:
        if launch(time_collectives, args, nproc=args.nproc, timeout_s=120.0, deadline_s=1800.0):
            raise SystemExit(1)
        return {}
    print(f"{'MiB':>4} {'dtype':>5} {'fmt':>5} {'op':<20} {'ours':>8} {'torch':>8} {'vs torch':>8} "
          f"{'memcpy':>8} {'/memcpy':>7} {'/touched':>8}   (GB/s of the float side)")
    report = {"loadavg": loadavg, "torch_threads": torch.get_num_threads(), "results": measure(args)}
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
