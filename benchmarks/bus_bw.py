"""nccl-tests-style bus bandwidth of all_reduce, reduce_scatter and all_gather:
ringcomm and the reference backend (gloo) side by side, in one run.

    python benchmarks/bus_bw.py                       # 2 local ranks, 8 B .. 128 MiB
    python benchmarks/bus_bw.py -b 8 -e 128M -f 16 --json out.json --plot out.png
    torchrun --nproc-per-node 4 benchmarks/bus_bw.py  # the launcher's ranks (clusters)

size is the full buffer S in bytes (all_reduce's tensor, reduce_scatter's input,
all_gather's output); algbw = S / time; busbw = algbw * 2(n-1)/n for all_reduce
and algbw * (n-1)/n for reduce_scatter and all_gather (the bytes each rank's
link must carry, comparable across world sizes). memcpy is the rate of one copy
of S bytes on this machine, measured in the same run: the limit line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import launch  # noqa: E402

OPS = ("all_reduce", "reduce_scatter", "all_gather")
DTYPES = {"float": "float32", "float32": "float32", "double": "float64", "float64": "float64", "bfloat16": "bfloat16",
          "half": "float16", "float16": "float16", "int": "int32", "int32": "int32", "int64": "int64"}
REDOPS = ("sum", "prod", "min", "max", "avg")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("128M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1, help="1: count wrong results (#wrong) once per size")
    p.add_argument("-o", "--op", default="sum", choices=REDOPS)
    p.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES))
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--backends", default="ringcomm,gloo", help="comma-separated: ringcomm, gloo")
    p.add_argument("--transport", default="auto", choices=("auto", "shm", "torch_dist"))
    p.add_argument("--alloc", default="shm", choices=("shm", "torch"),
                   help="ringcomm's buffers: ringcomm.empty (shared memory, no staging copies) or torch.empty")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn when not under a launcher")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any one collective may take")
    p.add_argument("--json", default=None, help="write every row and the machine info here")
    p.add_argument("--plot", default=None, help="write busbw vs size (PNG) here")
    args = p.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    args.backends = [b for b in args.backends.split(",") if b]
    for op in args.ops:
        if op not in OPS:
            p.error(f"--ops: unknown op {op!r}")
    for backend in args.backends:
        if backend not in ("ringcomm", "gloo"):
            p.error(f"--backends: unknown backend {backend!r} (ringcomm, gloo)")
    if args.minbytes < 1 or args.maxbytes < args.minbytes or args.stepfactor < 2:
        p.error("need 1 <= -b <= -e and -f >= 2")
    return args


def sizes(args: argparse.Namespace) -> list[int]:
    out, size = [], args.minbytes
    while size <= args.maxbytes:
        out.append(size)
        size *= args.stepfactor
    return out


def machine_info(world_size: int, transport: str) -> dict:
    import torch

    from machine import cpu_line, cpu_model

    return {"host": platform.node(), "processor": cpu_model(), "cpu": cpu_line(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "world_size": world_size, "ringcomm_transport": transport}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from bus_bw_cases import Runner, format_header, format_row, summary_lines

    runner = Runner(args)
    rank = dist.get_rank()
    rows = []
    cases = [(op, size) for op in args.ops for size in sizes(args)]
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(cases) * len(args.backends), desc="bus_bw", unit="case", file=sys.stderr,
                        dynamic_ncols=True, leave=False, disable=not sys.stderr.isatty())
        from machine import cpu_line

        progress.write(f"# {cpu_line()}")
    for index, (op, size) in enumerate(cases):
        if rank == 0 and (index == 0 or cases[index - 1][0] != op):
            progress.write(format_header(op, args, runner))
        measured = runner.measure_size(op, size, progress)
        rows.extend(measured)
        if rank == 0:
            for row in measured:
                progress.write(format_row(row, measured))
        if rank == 0 and (index + 1 == len(cases) or cases[index + 1][0] != op):
            progress.write("\n".join(summary_lines(op, [r for r in rows if r["op"] == op], args.backends)) + "\n")
    if rank != 0:
        return
    progress.close()
    info = machine_info(dist.get_world_size(), runner.transport_kind)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        from bus_bw_plot import plot

        plot(rows, args, info, args.plot)
        print(f"# wrote {args.plot}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = args.timeout * 10 + 600
    return launch(worker, args, nproc=args.nproc, timeout_s=args.timeout, deadline_s=deadline)


if __name__ == "__main__":
    sys.exit(main())
