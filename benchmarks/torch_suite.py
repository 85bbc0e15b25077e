"""PyTorch's own distributed test suite (the gloo-eligible CPU tests of
DistributedTest._DistTestBase from the torch wheel) on gloo and on ringcomm, side
by side: passed, failed and skipped per world size, and every test that passes
on gloo but not on ringcomm, with its error's first line.

    python benchmarks/torch_suite.py                          # world sizes 2 and 3 (5-7 min on 2 cores)
    python benchmarks/torch_suite.py -w 3 -k "all_reduce or DistributedDataParallel" --json out.json
    python benchmarks/torch_suite.py -w 8 -k group             # the suite's subgroup tests need 8 ranks

Each (backend, world size) is one pytest subprocess (tests/torch_suite.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from torch_suite import (BACKENDS, TEST_TIMEOUT_S, WORLD_SIZES, Status, SuiteRun, expected_failure,  # noqa: E402
                         run_suite)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-w", "--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("-k", "--keyword", help="pytest -k expression selecting tests by name")
    parser.add_argument("--test-timeout", type=int, default=TEST_TIMEOUT_S, help="seconds per test, all ranks")
    parser.add_argument("--profiler-events", action="store_true",
                        help="check the profiler events '<backend>:<op>' on ringcomm too (the suite does on gloo)")
    parser.add_argument("--json", help="write the outcomes of every test here")
    args = parser.parse_args(argv)
    if any(ws < 2 for ws in args.world_sizes):
        parser.error(f"--world-sizes {args.world_sizes}: the suite needs at least 2 ranks")
    return args


def gloo_only_passes(gloo: SuiteRun, ringcomm: SuiteRun) -> list[dict]:
    """Tests that pass on gloo and fail or skip on ringcomm."""
    rows = []
    for name in gloo.names(Status.PASSED):
        outcome = ringcomm.outcomes.get(name)
        if outcome is None or outcome.status is not Status.PASSED:
            expected = expected_failure(name, outcome) if outcome else None
            rows.append({"world_size": gloo.world_size, "test": name,
                         "ringcomm": outcome.status.value if outcome else "missing",
                         "error": outcome.message if outcome else "", "expected": expected and expected.reason})
    return rows


def counts(run: SuiteRun) -> dict[str, int]:
    return {status.value: len(run.names(status)) for status in Status}


def print_table(runs: dict[tuple[str, int], SuiteRun]) -> None:
    columns = f"{'passed':>6} {'failed':>6} {'skipped':>7} {'wall_s':>6}"
    print(f"{'':>10}" + "".join(f" | {backend:^{len(columns)}}" for backend in BACKENDS))
    print(f"{'world_size':>10}" + f" | {columns}" * len(BACKENDS))
    for world_size in sorted({ws for _, ws in runs}):
        line = f"{world_size:>10}"
        for backend in BACKENDS:
            run, c = runs[backend, world_size], counts(runs[backend, world_size])
            line += f" | {c['passed']:>6} {c['failed']:>6} {c['skipped']:>7} {run.wall_s:>6.0f}"
        print(line)


def print_differences(rows: list[dict]) -> None:
    print(f"\npasses on gloo, not on ringcomm: {len(rows)} "
          f"({sum(row['expected'] is None for row in rows)} not in tests/torch_suite.py's EXPECTED_FAILURES)")
    for row in rows:
        mark = "expected" if row["expected"] else "NEW"
        print(f"  ws={row['world_size']} {row['test']} [{mark}] {row['ringcomm']}: {row['error']}")
    reasons = {row["expected"]: [] for row in rows if row["expected"]}
    for row in rows:
        if row["expected"] and row["test"] not in reasons[row["expected"]]:
            reasons[row["expected"]].append(row["test"])
    for reason, tests in reasons.items():
        print(f"\n  expected, {', '.join(tests)}: {reason}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    runs: dict[tuple[str, int], SuiteRun] = {}
    for world_size in args.world_sizes:
        for backend in BACKENDS:
            runs[backend, world_size] = run = run_suite(backend, world_size, keyword=args.keyword,
                                                        test_timeout_s=args.test_timeout,
                                                        profiler_events=args.profiler_events)
            print(f"{backend} world_size {world_size}: {counts(run)} in {run.wall_s:.0f} s", file=sys.stderr)
    rows = [row for ws in args.world_sizes for row in gloo_only_passes(runs["gloo", ws], runs["ringcomm", ws])]
    print_table(runs)
    print_differences(rows)
    print(f"\ntotal {time.monotonic() - start:.0f} s")
    if args.json:
        report = {
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "args": vars(args),
            "runs": [{"backend": run.backend, "world_size": run.world_size, "wall_s": round(run.wall_s, 1),
                      "counts": counts(run),
                      "outcomes": {name: {"status": o.status.value, "message": o.message}
                                   for name, o in sorted(run.outcomes.items())}} for run in runs.values()],
            "gloo_only_passes": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(row["expected"] is None for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
