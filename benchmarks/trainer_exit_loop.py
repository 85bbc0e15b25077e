"""Exit soak: N consecutive Hugging Face Trainer runs under torchrun (2 local ranks,
FSDP2 on the "ringcomm" backend by default), each a fresh launch of
tests/hf_trainer_script.py with a tiny GPT-2 and a few steps. A run passes when
torchrun exits 0 within its timeout: a rank that aborts or hangs after training,
at teardown or interpreter exit, fails it.

    python benchmarks/trainer_exit_loop.py                       # 50 runs of ringcomm:fsdp2
    python benchmarks/trainer_exit_loop.py --runs 10 --run gloo:fsdp2

Prints one line per run and a summary, keeps each failing run's output (every
rank's stderr, with faulthandler's stacks of every thread on a fatal signal) in
--log-dir, writes bench-results/trainer_exit_loop.json and exits 1 if a run failed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(REPO, "tests", "hf_trainer_script.py")
sys.path.insert(0, HERE)

from machine import write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50, help="consecutive launches (default 50)")
    p.add_argument("--run", default="ringcomm:fsdp2", help="backend:engine of each launch (default ringcomm:fsdp2)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per launch (default 2)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch (default 2)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per launch before it counts as hung")
    p.add_argument("--log-dir", default=os.path.join("bench-results", "trainer_exit_loop"))
    p.add_argument("--out", default=os.path.join("bench-results", "trainer_exit_loop.json"))
    return p.parse_args(argv)


def launch(args: argparse.Namespace, index: int) -> dict:
    """One torchrun launch; its combined output goes to a log file, kept on failure."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               SCRIPT, "--runs", args.run, "--steps", str(args.steps)]
    log_path = os.path.join(args.log_dir, f"run{index:03d}.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # torchrun and its ranks: the session started for this launch
            proc.wait()
            returncode = None
    seconds = time.perf_counter() - start
    with open(log_path) as log:
        output = log.read()
    done = output.count(": done [")
    if returncode == 0:
        os.remove(log_path)
    return {"index": index, "returncode": returncode, "seconds": round(seconds, 2), "ranks_done": done,
            "log": None if returncode == 0 else log_path}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    rows = []
    for index in range(args.runs):
        row = launch(args, index)
        rows.append(row)
        status = "ok" if row["returncode"] == 0 else ("HUNG" if row["returncode"] is None else "FAILED")
        print(f"run {index:3d}: {status:6} rc={row['returncode']} ranks done {row['ranks_done']}/{args.nproc} "
              f"{row['seconds']:.1f} s" + (f"  log: {row['log']}" if row["log"] else ""), flush=True)
    passed = sum(row["returncode"] == 0 for row in rows)
    print(f"{passed} of {args.runs} launches of {args.run} ({args.nproc} ranks, {args.steps} steps) exited 0")
    write_json(args.out, {"run": args.run, "nproc": args.nproc, "steps": args.steps, "runs": args.runs,
                          "passed": passed, "rows": rows})
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
