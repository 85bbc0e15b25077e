"""Close/abort soak: for each transport and call path, N cycles of "start a loop
of collectives, close or abort the group from another thread at a random
moment", on 2 local ranks. A cycle fails on a crash (a rank dies), a hang (the
loop still runs 20 s after the kill), a wrong result or an error other than the
documented ones ([Note: group lifetime] in ringcomm/comm/group.py).

    python benchmarks/lifecycle_soak.py                    # 200 cycles per path
    python benchmarks/lifecycle_soak.py --cycles 20 --transports shm

Prints one row per transport and path and writes bench-results/lifecycle_soak.json;
exits 1 if any cycle failed. The worker is tests/lifecycle_stress.py, which the
test suite runs with a few cycles.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from harness import run_ranks  # noqa: E402
from lifecycle_stress import PATHS, stress  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=200, help="cycles per transport and path (default 200)")
    p.add_argument("--transports", default="shm,torch_dist", help="comma-separated (default shm,torch_dist)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated of {','.join(PATHS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("bench-results", "lifecycle_soak.json"))
    return p.parse_args(argv)


def soak(transport: str, path: str, cycles: int, seed: int) -> dict:
    """One transport and path on 2 ranks; a rank that dies or hangs is a failure of the row."""
    start = time.perf_counter()
    try:
        ranks = run_ranks(stress, 2, path, transport, cycles, seed, timeout=60.0 + 5.0 * cycles)
    except AssertionError as err:  # a rank died, hung or raised: run_ranks says which
        return {"transport": transport, "path": path, "crashed_or_hung": str(err)[-2000:],
                "seconds": time.perf_counter() - start}
    outcomes = [r["outcome"] for r in ranks]
    errors: dict[str, int] = {}
    for outcome in outcomes:
        for kind, count in outcome["errors"].items():
            errors[kind] = errors.get(kind, 0) + count
    grown = {f"rank{i} {k}": (r["before"][k], r["after"][k]) for i, r in enumerate(ranks)
             for k in r["after"] if r["after"][k] > r["before"][k] + 2}
    return {"transport": transport, "path": path, "cycles": outcomes[0]["cycles"] - 1,
            "ops": sum(o["ops"] for o in outcomes), "errors": errors,
            "failures": [f for o in outcomes for f in o["failures"]], "grown": grown,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with open("/proc/loadavg") as f:
        print(f"load before: {f.read().split()[0]}")
    rows = []
    print(f"{'transport':<11} {'path':<15} {'cycles':>6} {'ops':>7} {'failures':>8} {'grown':>6} {'s':>6}  errors")
    for transport in args.transports.split(","):
        for seed, path in enumerate(args.paths.split(","), start=args.seed):
            row = soak(transport, path, args.cycles, seed)
            rows.append(row)
            if "crashed_or_hung" in row:
                print(f"{transport:<11} {path:<15} CRASHED OR HUNG: {row['crashed_or_hung'][-300:]}")
                continue
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(row["errors"].items()))
            print(f"{transport:<11} {path:<15} {row['cycles']:>6} {row['ops']:>7} {len(row['failures']):>8} "
                  f"{len(row['grown']):>6} {row['seconds']:>6.1f}  {kinds}", flush=True)
            for failure in row["failures"][:3]:
                print(f"    {failure[:300]}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cycles": args.cycles, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    bad = [r for r in rows if "crashed_or_hung" in r or r["failures"] or r["grown"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
