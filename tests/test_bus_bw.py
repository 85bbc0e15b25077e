"""Smoke runs of benchmarks/bus_bw.py: spawned ranks and torchrun's ranks,
both backends, #wrong == 0 and the JSON schema."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bus_bw.py")
SWEEP = ["-b", "1K", "-e", "64K", "-f", "64", "-n", "2", "-w", "1", "--timeout", "60"]
ROW_KEYS = {"op", "backend", "size", "count", "type", "redop", "memcpy_gbps", "oop", "ip"}
CELL_KEYS = {"time_us", "algbw", "busbw", "wrong"}


def check_report(path: str, world_size: int) -> None:
    with open(path) as f:
        report = json.load(f)
    assert set(report) == {"machine", "args", "rows"}, report.keys()
    assert report["machine"]["world_size"] == world_size
    rows = report["rows"]
    assert {(r["op"], r["backend"]) for r in rows} == {
        (op, backend) for op in ("all_reduce", "reduce_scatter", "all_gather") for backend in ("ringcomm", "gloo")}
    for row in rows:  # each size is rounded down to whole elements per rank
        assert any(0 <= requested - row["size"] < 4 * world_size for requested in (1024, 65536)), row
    for row in rows:
        assert ROW_KEYS <= set(row), row
        for cell in (row["oop"], row["ip"]):
            assert CELL_KEYS <= set(cell), cell
            assert cell["wrong"] == 0, row
            assert cell["time_us"] > 0 and cell["busbw"] > 0, row


def run(command: list[str], tmp_path, **env) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env})
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_spawned_ranks(tmp_path):
    out = tmp_path / "bus_bw.json"
    plot = tmp_path / "bus_bw.png"
    result = run([sys.executable, SCRIPT, *SWEEP, "--json", str(out), "--plot", str(plot)], tmp_path)
    assert "Avg bus bandwidth" in result.stdout and "#wrong 0 OK" in result.stdout, result.stdout
    check_report(str(out), 2)
    assert plot.stat().st_size > 1000


@pytest.mark.slow
def test_under_torchrun(tmp_path):
    out = tmp_path / "bus_bw.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", SCRIPT, *SWEEP,
         "--json", str(out)], tmp_path, OMP_NUM_THREADS="1")
    check_report(str(out), 3)


def test_failing_rank_ends_the_run_with_a_message(tmp_path):
    # -o avg: gloo has no AVG, so every rank fails at start; the run must end, naming a rank.
    result = subprocess.run([sys.executable, SCRIPT, *SWEEP, "-o", "avg"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "benchmark failed: rank" in result.stderr and "AVG" in result.stderr, result.stderr


@pytest.mark.parametrize("text, expected", [("8", 8), ("1K", 1024), ("128M", 128 << 20), ("2G", 2 << 30), ("64KB", 65536)])
def test_size_suffixes(text, expected):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from bus_bw import parse_size

    assert parse_size(text) == expected
