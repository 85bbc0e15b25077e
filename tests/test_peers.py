"""benchmarks/peers.py: a --quick run with every installed peer (under mpirun
when mpi4py and Open MPI are here, spawned ranks without them), the JSON's
shape and every result verified; the table's ratio and WRONG cells on
made-up numbers; the size list and the mpirun line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCH, "peers.py")
OPS = ("all_reduce", "reduce_scatter", "all_gather")
sys.path.insert(0, BENCH)
from peers_setup import installed  # noqa: E402

HAVE_MPI = installed("mpi4py")


def run_quick(tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "peers.json"
    result = subprocess.run([sys.executable, SCRIPT, "--quick", "--json", str(out), *extra], cwd=tmp_path,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"peers.py failed:\n{result.stdout}\n{result.stderr}"
    with open(out) as f:
        return json.load(f), result.stdout


def check_cells(report: dict, ops: tuple[str, ...], sizes: list[int]) -> None:
    """One verified cell per (op, size) for every peer that ran, and none for the others."""
    on = [p for p, state in report["peers"].items() if state["on"]]
    expected = {("copy" if p == "memcpy" else op, n, p) for p in on for n in sizes
                for op in (("all_reduce",) if p == "deepspeed" else ops)}
    cells = {(c["op"], c["requested_nbytes"], c["peer"]) for c in report["cells"] if c["phase"] == "quiet"}
    assert cells == expected, (cells ^ expected)
    for cell in report["cells"]:
        assert cell["wrong"] == 0, cell
        assert cell["iters"] >= 1 and len(cell["seconds"]) == report["args"]["rounds"], cell
        assert 0 < cell["time_us"]["min"] <= cell["time_us"]["median"] <= cell["time_us"]["max"], cell
    assert report["verified"] is True
    for peer, state in report["peers"].items():
        assert state["on"] or state["note"], f"{peer} is off without a note"


def test_quick_run_every_installed_peer(tmp_path):
    plot = tmp_path / "peers.png"
    report, stdout = run_quick(tmp_path, "--plot", str(plot))
    assert set(report) == {"header", "args", "peers", "cells", "ratios", "verified"}
    header = report["header"]
    assert header["world_size"] == 2 and header["cpus"] >= 1 and header["loadavg_start"] and header["loadavg_end"]
    assert report["peers"]["mpi"]["on"] is HAVE_MPI, report["peers"]["mpi"]
    for peer in ("rc_plain", "rc_window", "rc_dist", "dist_floor", "gloo", "memcpy"):
        assert report["peers"][peer]["on"], (peer, report["peers"][peer])
    check_cells(report, OPS, [8, 4096, 65536])
    assert {(r["op"], r["requested_nbytes"]) for r in report["ratios"]} == {(op, n) for op in OPS for n in (8, 4096, 65536)}
    assert all(r["plain"] > 0 and r["dist_over_floor"] > 0 for r in report["ratios"]), report["ratios"]
    assert "| all_reduce 8 B (us) |" in stdout and "all correct" in stdout, stdout
    assert "dist.* time / floor" in stdout, stdout
    # the header names the CPU and the kernels it runs
    assert header["cpu"].startswith("cpu ") and "ringcomm kernels:" in header["cpu"], header["cpu"]
    assert f"# {header['cpu']}" in stdout, stdout
    assert plot.stat().st_size > 1000


@pytest.mark.skipif(not HAVE_MPI, reason="without mpi4py the run above already spawns its ranks")
@pytest.mark.slow
def test_spawned_ranks_show_mpi_as_off(tmp_path):
    report, stdout = run_quick(tmp_path, "--launcher", "spawn", "--peers", "rc_plain,mpi", "--ops", "all_reduce",
                               "-e", "8")
    assert report["peers"]["mpi"] == {"on": False, "note": "--launcher spawn"}, report["peers"]
    check_cells(report, ("all_reduce",), [8])
    assert "Open MPI: '-' (--launcher spawn)" in stdout, stdout


@pytest.mark.slow
def test_send_recv_ping_pong_against_the_peers(tmp_path):
    report, stdout = run_quick(tmp_path, "--ops", "send_recv", "--peers", "rc_plain,rc_dist,mpi,gloo,memcpy",
                               "-e", "64K", "--plot", "")
    sizes = [8, 4096, 65536]
    on = [p for p, state in report["peers"].items() if state["on"]]
    cells = {(c["op"], c["requested_nbytes"], c["peer"]) for c in report["cells"]}
    assert cells == {("copy" if p == "memcpy" else "send_recv", n, p) for p in on for n in sizes}, cells
    assert report["verified"] is True and "| send_recv 8 B (us) |" in stdout, stdout


def fake_cell(seconds: float, wrong: int = 0) -> dict:
    return {"seconds": [seconds, seconds * 2, seconds * 3], "iters": 10, "wrong": wrong}


def test_ratio_takes_the_best_verified_peer_and_flags_wrong_results():
    from peers_report import cell_text, ratio, summaries

    cells = {("all_reduce", 1 << 20, "rc_plain"): fake_cell(1e-3),
             ("all_reduce", 1 << 20, "mpi"): fake_cell(2e-3),
             ("all_reduce", 1 << 20, "gloo"): fake_cell(1e-4, wrong=5),  # fast but wrong
             ("all_reduce", 1 << 20, "deepspeed"): fake_cell(4e-3),
             ("all_reduce", 8, "rc_plain"): fake_cell(4e-6),
             ("all_reduce", 8, "mpi"): fake_cell(1e-6),
             ("all_reduce", 8, "gloo"): fake_cell(300e-6)}
    stats = summaries(cells, world_size=2)
    assert ratio(stats, "all_reduce", 1 << 20, "rc_plain") == (pytest.approx(2.0), "mpi")
    assert ratio(stats, "all_reduce", 8, "rc_plain") == (pytest.approx(0.25), "mpi")  # 8 B: times
    assert cell_text(stats[("all_reduce", 1 << 20, "gloo")], 1 << 20) == "WRONG (5)"
    # rounds of 1, 2, 3 ms; all_reduce, 2 ranks: busbw = algbw * 2 (n-1) / n = algbw
    busbw = [(1 << 20) / seconds / 1e9 for seconds in (2e-3, 3e-3, 1e-3)]
    assert cell_text(stats[("all_reduce", 1 << 20, "rc_plain")], 1 << 20) == \
        f"{busbw[0]:.2f} [{busbw[1]:.2f}-{busbw[2]:.2f}]"


def test_dist_over_floor_is_the_ratio_of_times_in_one_run():
    from peers_report import over_floor, summaries

    cells = {("all_reduce", 8, "rc_dist"): fake_cell(9e-6), ("all_reduce", 8, "dist_floor"): fake_cell(3e-6),
             ("all_reduce", 1 << 20, "rc_dist"): fake_cell(4e-4, wrong=1), ("all_reduce", 1 << 20, "dist_floor"):
             fake_cell(3e-6), ("all_gather", 8, "rc_dist"): fake_cell(5e-6)}
    stats = summaries(cells, world_size=2)
    assert over_floor(stats, "all_reduce", 8) == pytest.approx(3.0)
    assert over_floor(stats, "all_reduce", 1 << 20) is None  # a wrong result has no ratio
    assert over_floor(stats, "all_gather", 8) is None  # no floor measured


def test_sizes_and_mpirun_line():
    from peers import parse_args
    from peers_setup import mpirun_command

    assert {8, 4096, 65536, 1 << 20, 16 << 20, 128 << 20} <= set(parse_args([]).sizes)
    assert parse_args(["--quick"]).sizes == [8, 4096, 65536]
    assert parse_args(["-b", "8", "-e", "4K", "-f", "8"]).sizes == [8, 64, 512, 4096]
    cores = os.cpu_count() or 1
    line = mpirun_command("mpirun", cores, 1234, ["peers.py"])
    assert "--oversubscribe" not in line and ["--mca", "btl", "self,sm"] == line[line.index("btl") - 1:line.index("btl") + 2]
    assert "--oversubscribe" in mpirun_command("mpirun", cores + 1, 1234, ["peers.py"])


@pytest.mark.skipif(not installed("deepspeed"), reason="DeepSpeed not installed")
def test_deepspeed_build_never_hangs_on_a_stale_lock(tmp_path, monkeypatch):
    # A killed build leaves torch's `lock`; the next build waits on it forever. The
    # benchmark's build must stop at its timeout, name the lock, and leave it alone.
    from peers_setup import SHM_OP, build_deepspeed_op

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / SHM_OP / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert build_deepspeed_op(0) == (None, f"{SHM_OP} not built yet (a run without --quick builds it, ~1 min)")
    path, note = build_deepspeed_op(6)
    assert path is None and "over 6 s" in note and str(lock) in note, note
    assert lock.exists()
