"""benchmarks/gpu_check.py without a GPU: it says no CUDA device was found,
checks nothing and claims no success; its verdicts from pytest's JUnit XML and
from gpu_collectives.py's rows; gpu_collectives.py's own code run on CPU ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gpu_check import Status, collectives_verdict, pytest_verdict  # noqa: E402


def run_script(name: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: gpu_check would run every part")
def test_no_device_checks_nothing(tmp_path) -> None:
    report_path = tmp_path / "gpu_check.json"
    result = run_script("gpu_check.py", "--json", str(report_path), cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}:\n{output}"
    assert "no CUDA device found" in result.stdout and "nothing was checked" in result.stdout, output
    assert "PASS" not in output, output
    report = json.loads(report_path.read_text())
    assert report["status"] == "no_device" and report["parts"] == [] and report["devices"] == [], report


def junit(*cases: str) -> str:
    return f'<testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>'


def case(name: str, body: str = "", module: str = "test_x") -> str:
    return f'<testcase classname="tests.{module}" name="{name}">{body}</testcase>'


SKIPPED = '<skipped type="pytest.skip" message="needs a CUDA device">why</skipped>'


@pytest.mark.parametrize("xml, status, words", [
    (junit(case("a"), case("b", SKIPPED)), Status.PASS, ["test_x: 1 passed, 1 skipped", "needs a CUDA device"]),
    (junit(case("a"), case("b", '<failure message="boom">trace</failure>')), Status.FAIL,
     ["test_x: 1 passed, 1 failed", "failed: test_x::b"]),
    (junit(case("a", '<error message="fixture">trace</error>')), Status.FAIL, ["1 failed", "test_x::a"]),
    (junit(case("a", SKIPPED), case("b", SKIPPED)), Status.SKIP, ["test_x: 0 passed, 2 skipped"]),
    (junit(case("a"), case("b", SKIPPED, module="test_y")), Status.PASS, ["test_x: 1 passed; test_y: 0 passed, 1 skipped"]),
    (junit(), Status.FAIL, ["no tests collected"]),
])
def test_pytest_verdict(xml: str, status: Status, words: list[str]) -> None:
    got, detail = pytest_verdict(xml)
    assert got is status, (xml, got, detail)
    for word in words:
        assert word in detail, (xml, detail)


def test_collectives_verdict() -> None:
    rows = [{"backend": backend, "op": op, "nbytes": nbytes, "time_us": time_us, "error": None}
            for backend, time_us in (("nccl", 10.0), ("ringcomm", 12.0))
            for op in ("all_reduce", "reduce_scatter", "all_gather") for nbytes in (1 << 20, 128 << 20)]
    status, detail = collectives_verdict({"world_size": 8, "reference": "nccl", "rows": rows})
    assert status is Status.PASS and "all_reduce 1.20x" in detail and "128 MiB" in detail, detail
    rows[3]["error"] = "all_reduce: 4 of 8 elements differ from the closed form on rank 1"
    status, detail = collectives_verdict({"world_size": 8, "reference": "nccl", "rows": rows})
    assert status is Status.FAIL and "closed form on rank 1" in detail, detail


def test_collectives_script_on_cpu(tmp_path) -> None:
    """The collectives part's script, on 2 CPU ranks (gloo as the reference)."""
    report_path = tmp_path / "collectives.json"
    result = run_script("gpu_collectives.py", "--device", "cpu", "--nproc", "2", "--sizes", "4K,64K", "--iters", "2",
                        "--warmup", "1", "--json", str(report_path), cwd=tmp_path)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    report = json.loads(report_path.read_text())
    assert {(r["backend"], r["op"]) for r in report["rows"]} == {
        (backend, op) for backend in ("gloo", "ringcomm") for op in ("all_reduce", "reduce_scatter", "all_gather")}
    status, detail = collectives_verdict(report)
    assert status is Status.PASS, detail
