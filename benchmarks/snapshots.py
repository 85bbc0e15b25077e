"""The cost of in-memory snapshots (config checkpoint.in_memory, zero/checkpoint/snapshot.py)
on the step: a ~100M-parameter GPT-2 (12 layers, width 768, vocabulary 16384),
fp32, AdamW, 2 ranks on the "ringcomm" backend, a snapshot after every
optimizer step (asynchronous, one buddy copy), against the same run without
snapshots, alternating, per stage.

    python benchmarks/snapshots.py                     # stages 2 and 3, 3 rounds
    python benchmarks/snapshots.py --stages 2 --rounds 1 --layers 2

Prints per stage the median step (after --warmup steps: the first, and the
first two snapshots, which allocate their slots in /dev/shm) with snapshots and
without (and of it engine.step(), which writes the snapshot: [Note: the step
writes the snapshot] in zero/checkpoint/snapshot.py), their ratio per round and
its median and range, and the shared
memory the snapshots hold per rank: measured (memory_report().snapshot_nbytes,
the files in /dev/shm) against zero.estimate's snapshot_nbytes, and where a
snapshot's time goes (PARTS: the median per timed step of each part of
zero/checkpoint/snapshot.py, in the step or on its thread). Writes
bench-results/snapshots.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from launch import launch  # noqa: E402
from machine import cpu_line, write_json  # noqa: E402


# The parts of a snapshot timed in the runs with snapshots: (label, module, owner, function)
PARTS = (("slots, before the step", "snapshot", "Snapshots", "before_step"),
         ("take, in the step", "snapshot", "Snapshots", "take"),
         ("  copy into the slot", "tensorfile", "MappedSafetensors", "copy"),
         ("word sums left (thread)", "tensorfile", "MappedSafetensors", "sums"),
         ("copy's rest (thread)", "tensorfile", "MappedSafetensors", "copy_from"),
         ("buddy on another host (thread)", "snapshot", "Snapshots", "_exchange"),
         ("piece.json (thread)", "snapshot", None, "write_piece_json"))


def time_parts() -> dict[str, list[float]]:
    """Wraps each of PARTS in a timer; returns the lists each call appends its seconds to."""
    import functools
    import importlib

    times: dict[str, list[float]] = {}
    for label, module_name, owner_name, name in PARTS:
        module = importlib.import_module(f"zero.checkpoint.{module_name}")
        owner = getattr(module, owner_name) if owner_name else module
        function, calls = getattr(owner, name), times.setdefault(label, [])

        @functools.wraps(function)
        def timed(*args, _function=function, _calls=calls, **kwargs):
            start = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                _calls.append(time.perf_counter() - start)
        setattr(owner, name, timed)
    return times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (each: without, with, per stage)")
    p.add_argument("--steps", type=int, default=12,
                   help="optimizer steps per run; the first --warmup are not timed (a backward varies by up to 25%%)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps: the first, and the first two snapshots (they allocate their slots)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--json", default=os.path.join("bench-results", "snapshots.json"))
    p.add_argument("--case", help=argparse.SUPPRESS)  # a worker's: stage,snapshots,output file
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import zero
    from zero.estimate.memory_model import snapshot_nbytes

    stage, snapshots, out = args.case.split(",")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                       vocab_size=args.vocab, n_positions=args.seq))
    num_params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": int(stage)}}
    parts = time_parts() if snapshots == "on" else {}
    if snapshots == "on":
        config["checkpoint"] = {"in_memory": {"enabled": True, "path": out + ".shm"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=config)
    times, optimizer_times, forward_times = [], [], []
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq),
                               generator=torch.Generator().manual_seed(step * world_size + rank))
        start = time.perf_counter()
        loss = engine(tokens, labels=tokens).loss
        forward_times.append(time.perf_counter() - start)
        engine.backward(loss)
        stepping = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        optimizer_times.append(time.perf_counter() - stepping)
    if snapshots == "on":
        engine.parts.snapshots.wait()
    result = {"rank": rank, "num_params": num_params, "times": times[args.warmup:], "warmup": times[:args.warmup],
              "optimizer_times": optimizer_times[args.warmup:], "forward_times": forward_times[args.warmup:],
              "snapshot_nbytes": engine.memory_report().snapshot_nbytes,
              "estimate_nbytes": snapshot_nbytes(num_params, world_size, int(stage)),
              "parts": {label: calls[args.warmup:args.steps] for label, calls in parts.items()}}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    engine.destroy()


def run_case(args: argparse.Namespace, stage: int, snapshots: str, folder: str) -> list[dict]:
    out = os.path.join(folder, f"s{stage}-{snapshots}")
    case = argparse.Namespace(**{**vars(args), "case": f"{stage},{snapshots},{out}"})
    code = launch(worker, case, nproc=2, timeout_s=300, deadline_s=1200, backend="ringcomm")
    if code != 0:
        raise SystemExit(f"stage {stage}, snapshots {snapshots}: the run failed ({code})")
    shutil.rmtree(out + ".shm", ignore_errors=True)
    results = []
    for rank in range(2):
        with open(f"{out}.rank{rank}") as f:
            results.append(json.load(f))
    return results


def step_time(results: list[dict], key: str = "times") -> float:
    """The median step (key "optimizer_times": its engine.step() alone): per step the slower rank's time."""
    return statistics.median(max(steps) for steps in zip(*(r[key] for r in results)))


def print_parts(rows: dict[int, list[dict]]) -> None:
    """Where a snapshot's time goes: each part's median ms per timed step (both ranks, every round)."""
    print("\nper rank and step, ms (median)" + "".join(f"{f'stage {stage}':>10}" for stage in rows))
    for label, *_ in PARTS:
        print(f"{label:<30}" + "".join(f"{statistics.median(r['parts_s'][label] for r in stage_rows) * 1e3:>10.0f}"
                                       for stage_rows in rows.values()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        return 0
    stages = [int(s) for s in args.stages.split(",")]
    with open("/proc/loadavg") as f:
        print(f"{cpu_line()}; load before: {f.read().split()[0]}")
    rows = {stage: [] for stage in stages}
    with tempfile.TemporaryDirectory(prefix="zero-snapshots-", dir="/dev/shm") as folder:
        for round_ in range(args.rounds):
            for stage in stages:
                off = run_case(args, stage, "off", folder)
                on = run_case(args, stage, "on", folder)
                row = {"round": round_, "off_s": step_time(off), "on_s": step_time(on), "off": off, "on": on,
                       "optimizer_off_s": step_time(off, "optimizer_times"),
                       "optimizer_on_s": step_time(on, "optimizer_times"),
                       "snapshot_nbytes": [r["snapshot_nbytes"] for r in on],
                       "estimate_nbytes": on[0]["estimate_nbytes"], "num_params": on[0]["num_params"],
                       "parts_s": {label: statistics.median(t for r in on for t in r["parts"][label])
                                   for label, *_ in PARTS}}
                rows[stage].append(row)
                print(f"round {round_} stage {stage}: step {row['off_s'] * 1e3:.0f} ms without snapshots, "
                      f"{row['on_s'] * 1e3:.0f} ms with: {row['on_s'] / row['off_s']:.3f}x (engine.step() "
                      f"{row['optimizer_off_s'] * 1e3:.0f} -> {row['optimizer_on_s'] * 1e3:.0f} ms)", flush=True)
    print(f"\n{rows[stages[0]][0]['num_params'] / 1e6:.1f}M parameters, 2 ranks, a snapshot every step")
    print(f"{'stage':>5} {'without (ms)':>13} {'with (ms)':>10} {'ratio median':>12} {'range':>13} "
          f"{'shm/rank (MiB)':>15} {'estimate (MiB)':>15}")
    summary = {}
    for stage, stage_rows in rows.items():
        ratios = [r["on_s"] / r["off_s"] for r in stage_rows]
        measured = statistics.median(n for r in stage_rows for n in r["snapshot_nbytes"])
        summary[stage] = {"ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                          "snapshot_nbytes": measured, "estimate_nbytes": stage_rows[0]["estimate_nbytes"]}
        print(f"{stage:>5} {statistics.median(r['off_s'] for r in stage_rows) * 1e3:>13.0f} "
              f"{statistics.median(r['on_s'] for r in stage_rows) * 1e3:>10.0f} {statistics.median(ratios):>12.3f} "
              f"{min(ratios):>6.3f}-{max(ratios):<6.3f} {measured / 2**20:>15.1f} "
              f"{stage_rows[0]['estimate_nbytes'] / 2**20:>15.1f}")
    print_parts(rows)
    write_json(args.json, {"args": vars(args), "cpu": cpu_line(), "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
