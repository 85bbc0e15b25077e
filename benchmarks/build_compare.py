"""The dispatched build against a build for this machine alone: bus_bw.py,
quant.py and cpu_adam.py run alternately on this checkout (the default build:
kernels chosen when the library loads) and on another checkout built with
RINGCOMM_MARCH=native, rounds times each. Prints, per benchmark, the median
over its cells of (dispatched / native speed), each cell the median of the
rounds, with the range of the cells and of the rounds (each round's pair
alone); writes every sample to JSON.

    git worktree add /tmp/native HEAD && (cd /tmp/native && RINGCOMM_MARCH=native python setup.py build_ext --inplace)
    python benchmarks/build_compare.py --native /tmp/native [--rounds 3] [--benchmarks cpu_adam]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from machine import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (script and arguments, how to read {cell: speed, higher is better} from its JSON)
BENCHMARKS = {
    "bus_bw": (["bus_bw.py", "--backends", "ringcomm", "-b", "8", "-e", "16M", "-f", "8", "-n", "50", "-w", "10"],
               lambda report: {f"{r['op']} {r['size']} B": r["oop"]["busbw"] for r in report["rows"]}),
    "quant": (["quant.py", "--sizes-mib", "1,16", "--no-torch", "--repeats", "5"],
              lambda report: {f"{r['op']} {r['dtype']} {r['format']} {r['mib']} MiB": r["ours_gbps"]
                              for r in report["results"]}),
    "cpu_adam": (["cpu_adam.py", "--sizes", "10e6", "--repeats", "15"],
                 lambda report: {f"{r['impl']} {r['numel']:.0e}": 1.0 / r["ns_per_param"] for r in report["rows"]
                                 if r["impl"].startswith("engine") and "ns_per_param" in r}),
}


def run_once(tree: str, name: str, tmp: str) -> dict[str, float]:
    script, read = BENCHMARKS[name]
    out = os.path.join(tmp, f"{name}.json")
    env = {**os.environ, "PYTHONPATH": tree}
    command = [sys.executable, os.path.join(tree, "benchmarks", script[0]), *script[1:], "--json", out]
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    with open(out) as f:
        return read(json.load(f))


def capability(tree: str) -> str:
    code = "import ringcomm; c = ringcomm.cpu_capabilities(); print(c.active, c.march or 'default')"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                          capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--native", required=True, help="a checkout built in place with RINGCOMM_MARCH=native")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--benchmarks", default=",".join(BENCHMARKS), help=f"a comma-separated subset of {list(BENCHMARKS)}")
    p.add_argument("--json", default="bench-results/build_compare.json")
    args = p.parse_args(argv)
    chosen = args.benchmarks.split(",")
    if unknown := sorted(set(chosen) - set(BENCHMARKS)):
        p.error(f"--benchmarks: unknown {unknown}; choose from {list(BENCHMARKS)}")
    trees = {"dispatched": ROOT, "native": os.path.abspath(args.native)}
    builds = {kind: capability(tree) for kind, tree in trees.items()}
    print("# builds: " + "; ".join(f"{kind}: kernels {b.split()[0]}, -march={b.split()[1]}" for kind, b in builds.items()))
    with open("/proc/loadavg") as f:
        print(f"# loadavg at start {' '.join(f.read().split()[:3])}")
    samples: dict[str, dict[str, dict[str, list[float]]]] = {n: {k: {} for k in trees} for n in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for name in chosen:
                for kind in (("dispatched", "native") if round_index % 2 == 0 else ("native", "dispatched")):
                    for cell, value in run_once(trees[kind], name, tmp).items():
                        samples[name][kind].setdefault(cell, []).append(value)
            print(f"# round {round_index + 1} of {args.rounds} done", file=sys.stderr)
    report = {"builds": builds, "rounds": args.rounds, "benchmarks": {}}
    print(f"{'benchmark':<10} {'cells':>5} {'median dispatched/native':>25} {'range of cells':>16} "
          f"{'range of rounds':>16}")
    for name, by_kind in samples.items():
        cells = [cell for cell in by_kind["dispatched"] if cell in by_kind["native"]]
        ratios = {cell: statistics.median(by_kind["dispatched"][cell]) / statistics.median(by_kind["native"][cell])
                  for cell in cells}
        # each round's pair alone (the median over cells of its ratios): how far one round moves
        per_round = sorted(statistics.median(by_kind["dispatched"][cell][i] / by_kind["native"][cell][i]
                                             for cell in cells) for i in range(args.rounds))
        values = sorted(ratios.values())
        print(f"{name:<10} {len(values):>5} {statistics.median(values):>25.3f} {values[0]:>7.3f}-{values[-1]:.3f} "
              f"{per_round[0]:>9.3f}-{per_round[-1]:.3f}")
        report["benchmarks"][name] = {"ratios": ratios, "round_ratios": per_round, "samples": by_kind}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
