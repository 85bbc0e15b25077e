"""Checks ringcomm's GPU path in one call, on a machine with CUDA devices:
prints one table (part | status | seconds | detail), writes JSON, and exits 1
when any part failed. Without a CUDA device it checks nothing and says so
(JSON status "no_device", exit 0).

    python benchmarks/gpu_check.py [--json bench-results/gpu_check.json] [--parts pytest,collectives,zero_step]

Parts, each a subprocess with its own timeout (9.5 minutes in all at most):
  pytest       tests/*cuda*.py but the offload one: the CUDA kernels, the ZeRO engine's stages 0-3 on CUDA
  offload      tests/test_zero_offload_cuda.py: ZeRO-Offload with the model on the GPU (pinned
               host masters and states, gradients to host on a side stream, host step, stage-3
               shards pinned on the host, NVMe) against the same runs without offload; with 2
               devices also 2 ranks under NCCL (norms, steps, a save and a load through the gloo
               group beside it); one device skips that case (NCCL refuses 2 ranks on one device)
  collectives  benchmarks/gpu_collectives.py: NCCL vs the "ringcomm" backend on CUDA
               tensors, one rank per GPU, results checked, times compared
  zero_step    benchmarks/zero_step.py --device cuda: the ZeRO engine's step time at
               stages 0-3 on ringcomm and on plain torch.distributed (NCCL), one rank per GPU
"""
from __future__ import annotations

import argparse
import enum
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("pytest", "offload", "collectives", "zero_step")
TIMEOUT_S = {"pytest": 300.0, "offload": 120.0, "collectives": 90.0, "zero_step": 60.0}
OFFLOAD_TESTS = "tests/test_zero_offload_cuda.py"
TAIL_CHARS = 4000  # of a part's output, kept in the JSON


class Status(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True, slots=True)
class PartResult:
    part: str
    status: Status
    seconds: float
    detail: str
    output_tail: str = ""


class Finished(NamedTuple):
    returncode: int
    output: str
    timed_out: bool


def run_command(command: list[str], timeout_s: float) -> Finished:
    """Runs `command` in ROOT in its own session; on timeout kills the whole
    session (pytest's and the launcher's child processes too)."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return Finished(proc.returncode, output, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return Finished(proc.returncode, output, True)


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


# ---- part: pytest -----------------------------------------------------------------------

def cuda_test_files() -> list[str]:
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*cuda*.py")
                  if str(path.relative_to(ROOT)) != OFFLOAD_TESTS)


def test_file(case: ElementTree.Element) -> str:
    """The test module of a JUnit testcase ("tests.test_cuda.TestX" -> "test_cuda")."""
    dotted = case.get("classname") or case.get("name", "")  # a collection error has no classname
    parts = dotted.split(".")
    return parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]


def pytest_verdict(junit_xml: str) -> tuple[Status, str]:
    """Status and detail (counts per test file, skip reasons) from pytest's
    JUnit XML: FAIL on any failure or error (or nothing collected), SKIP when
    every test skipped, else PASS."""
    cases = list(ElementTree.fromstring(junit_xml).iter("testcase"))
    if not cases:
        return Status.FAIL, "no tests collected"
    counts: dict[str, dict[str, int]] = {}
    failed, reasons = [], set()
    for case in cases:
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
            failed.append(f"{test_file(case)}::{case.get('name', '')}")
        elif case.find("skipped") is not None:
            outcome = "skipped"
            reasons.add((case.find("skipped").get("message") or "").removeprefix("Skipped: ")[:120])
        file_counts = counts.setdefault(test_file(case), {"passed": 0, "failed": 0, "skipped": 0})
        file_counts[outcome] += 1
    detail = "; ".join(f"{name}: " + ", ".join(f"{n} {outcome}" for outcome, n in c.items() if n or outcome == "passed")
                       for name, c in counts.items())
    if failed:
        return Status.FAIL, f"{detail}; failed: {', '.join(failed[:3])}{' ...' if len(failed) > 3 else ''}"
    detail += f" (skipped: {'; '.join(sorted(reasons))})" if reasons else ""
    num_passed = sum(c["passed"] for c in counts.values())
    return (Status.SKIP if num_passed == 0 else Status.PASS), detail


def run_pytest(timeout_s: float, files: list[str] | None = None) -> tuple[Status, str, str]:
    files = files or cuda_test_files()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        junit = Path(tmp) / "junit.xml"
        done = run_command([sys.executable, "-m", "pytest", "-q", "-rs", f"--junitxml={junit}", *files], timeout_s)
        if done.timed_out:
            return Status.FAIL, f"timed out after {timeout_s:.0f} s: {' '.join(files)}", done.output
        if not junit.exists():
            return Status.FAIL, f"pytest exited {done.returncode} without a report: {last_line(done.output)}", done.output
        status, detail = pytest_verdict(junit.read_text())
    if status is not Status.FAIL and done.returncode != 0:
        status, detail = Status.FAIL, f"pytest exited {done.returncode}; {detail}"
    return status, detail, done.output


# ---- part: collectives ------------------------------------------------------------------

def collectives_verdict(report: dict) -> tuple[Status, str]:
    """FAIL on any wrong or failed row; else PASS with ringcomm's time over the
    reference's at the largest size, per op."""
    rows = report["rows"]
    errors = [row["error"] for row in rows if row["error"]]
    if errors:
        return Status.FAIL, f"{len(errors)} of {len(rows)} rows wrong or failed; first: {errors[0]}"
    largest = max(row["nbytes"] for row in rows)
    times = {(row["backend"], row["op"]): row["time_us"] for row in rows if row["nbytes"] == largest}
    reference = report["reference"]
    ratios = ", ".join(f"{op} {times[('ringcomm', op)] / times[(reference, op)]:.2f}x"
                       for op in ("all_reduce", "reduce_scatter", "all_gather"))
    return Status.PASS, (f"{report['world_size']} ranks, {len(rows)} results correct; ringcomm / {reference} "
                         f"time at {largest / 2**20:g} MiB: {ratios}")


def run_collectives(timeout_s: float) -> tuple[Status, str, str]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        report_path = Path(tmp) / "collectives.json"
        command = [sys.executable, "benchmarks/gpu_collectives.py", "--device", "cuda", "--json", str(report_path)]
        done = run_command(command, timeout_s)
        if done.timed_out:
            return Status.FAIL, f"timed out after {timeout_s:.0f} s", done.output
        if done.returncode != 0 or not report_path.exists():
            return Status.FAIL, f"exited {done.returncode}: {last_line(done.output)}", done.output
        status, detail = collectives_verdict(json.loads(report_path.read_text()))
    return status, detail, done.output


# ---- part: zero_step --------------------------------------------------------------------

def run_zero_step(timeout_s: float) -> tuple[Status, str, str]:
    import torch

    frameworks = ("zero", "zero-torch")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        report_path = Path(tmp) / "zero_step.json"
        command = [sys.executable, "benchmarks/zero_step.py", "--device", "cuda", "--nproc",
                   str(torch.cuda.device_count()), "--frameworks", ",".join(frameworks), "--steps", "4",
                   "--warmup", "1", "--json", str(report_path)]
        done = run_command(command, timeout_s)
        if done.timed_out:
            return Status.FAIL, f"timed out after {timeout_s:.0f} s", done.output
        if done.returncode != 0 or not report_path.exists():
            return Status.FAIL, f"exited {done.returncode}: {last_line(done.output)}", done.output
        seconds = json.loads(report_path.read_text())["seconds"]
    failed = [f"{f} stage {stage}: {value}" for f in frameworks for stage, value in seconds.get(f, {}).items()
              if not isinstance(value, float)]
    if failed or any(len(seconds.get(f, {})) != 4 for f in frameworks):
        return Status.FAIL, f"not every stage ran: {failed[:2] or seconds}", done.output
    times = ", ".join(f"{f} " + "/".join(f"{seconds[f][s] * 1e3:.1f}" for s in sorted(seconds[f])) + " ms"
                      for f in frameworks)
    return Status.PASS, f"step time, stages 0/1/2/3: {times}", done.output


def run_offload(timeout_s: float) -> tuple[Status, str, str]:
    return run_pytest(timeout_s, [OFFLOAD_TESTS])


RUNNERS = {"pytest": run_pytest, "offload": run_offload, "collectives": run_collectives, "zero_step": run_zero_step}


def run_part(part: str) -> PartResult:
    timeout_s = TIMEOUT_S.get(part, 0.0)
    limit = f" (timeout {timeout_s:.0f} s)" if timeout_s else ""
    print(f"gpu_check: {part}{limit} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    status, detail, output = RUNNERS[part](timeout_s)
    return PartResult(part, status, time.perf_counter() - start, detail, output[-TAIL_CHARS:])


def format_table(results: list[PartResult]) -> str:
    lines = [f"{'part':<12} {'status':<6} {'seconds':>8}  detail"]
    lines += [f"{r.part:<12} {r.status.value:<6} {r.seconds:8.1f}  {r.detail}" for r in results]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="bench-results/gpu_check.json", help="write the results here")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    args = p.parse_args(argv)
    args.parts = [part for part in args.parts.split(",") if part]
    for part in args.parts:
        if part not in PARTS:
            p.error(f"--parts: unknown part {part!r} ({', '.join(PARTS)})")
    return args


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"gpu_check: wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    machine = {"torch": torch.__version__, "cuda_build": torch.version.cuda}
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device found (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "nothing was checked")
        write_json(args.json, {"status": "no_device", **machine, "devices": [], "parts": []})
        return 0
    results = [run_part(part) for part in args.parts]
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]  # after: no context held
    for result in results:
        if result.status is Status.FAIL:
            print(f"---- {result.part} failed; the end of its output:\n{result.output_tail}\n")
    print(f"gpu_check: {len(devices)} CUDA devices: {', '.join(devices)}")
    print(format_table(results))
    failed = any(r.status is Status.FAIL for r in results)
    parts = [{**asdict(r), "status": r.status.value} for r in results]
    write_json(args.json, {"status": "fail" if failed else "pass", **machine, "devices": devices, "parts": parts})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
