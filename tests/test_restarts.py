"""Restarts under torchrun ([Note: attempt-scoped keys] in ringcomm/core/attempt.py):
torchrun's static rendezvous shares one store with every attempt's workers, so
a restarted rank could read keys of the attempt before; with ringcomm's keys
scoped by attempt, each of 4 attempts (one rank SIGKILLed in each of the first
3) joins: the default group on the backend (shm), a torch_dist group from
ringcomm.new_group, and zero's store barrier. Plain gloo fails here in most
attempts (README, "Reliability")."""
from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import warnings

import pytest

from ringcomm.core import attempt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESTARTS = 3

SCRIPT = """
import datetime, os, signal, sys, torch, torch.distributed as dist, ringcomm
from zero.checkpoint.barrier import store_agree
restarts, marks = int(sys.argv[1]), sys.argv[2]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("ringcomm", timeout=datetime.timedelta(seconds=20))
rank, world_size = dist.get_rank(), dist.get_world_size()
t = torch.full((3,), float(rank + 1)); dist.all_reduce(t)
group = ringcomm.new_group(transport="torch_dist", timeout=20)
u = torch.full((3,), float(attempt)); ringcomm.all_reduce(u, group=group)
assert store_agree("restart test", 20, None) == []
assert t.tolist() == [3.0] * 3 and u.tolist() == [2.0 * attempt] * 3, (t, u)
open(os.path.join(marks, f"attempt{attempt}_rank{rank}"), "w").close()
dist.barrier()  # every rank has marked this attempt before one dies (torchrun then stops the others at once)
if attempt < restarts and rank == attempt % world_size:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()  # survivors of a kill wait here until torchrun stops them
group.close()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(180)
def test_every_attempt_joins_under_torchruns_shared_store() -> None:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "restart.py")
        with open(script, "w") as file:
            file.write(SCRIPT)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
               str(RESTARTS), "--monitor-interval", "0.1", "--master-addr", "127.0.0.1", "--master-port",
               str(free_port()), script, str(RESTARTS), tmp]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=160)
        joined = sorted(os.path.basename(path) for path in glob.glob(os.path.join(tmp, "attempt*_rank*")))
    want = [f"attempt{a}_rank{r}" for a in range(RESTARTS + 1) for r in range(2)]
    assert proc.returncode == 0 and joined == want, \
        f"torchrun exited {proc.returncode}; attempts joined: {joined}\n{proc.stderr[-4000:]}"


def test_scope_follows_torchruns_store(monkeypatch: pytest.MonkeyPatch) -> None:
    one_agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2",
                 "TORCHELASTIC_MAX_RESTARTS": "3", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    for name, value in one_agent.items():
        monkeypatch.setenv(name, value)
    assert attempt.scope() == "attempt2/"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a store of its own per attempt
    assert attempt.scope() == ""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # not under torchrun
    assert attempt.scope() == ""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("WORLD_SIZE", "4")  # two agents: their restart counts may differ
    monkeypatch.setattr(attempt, "_warned", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attempt.scope() == "" and attempt.scope() == ""
    assert len(caught) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(caught[0].message)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_restart_soak_resumes_to_the_uninterrupted_state(tmp_path) -> None:
    """benchmarks/restarts.py --memory, 3 kills: each restart joins, resumes
    with engine.resume() from the in-memory snapshots (a disk checkpoint every 4
    steps) losing at most one step, and the final checkpoint equals an
    uninterrupted run's, tensor for tensor (the script's exit code says all three)."""
    out = tmp_path / "restarts.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "restarts.py"), "--cycles", "3",
                           "--seed", "1", "--memory", "--out", str(out)], capture_output=True, text=True,
                          timeout=220, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["ok"] and all(row["source"] == "memory" for row in rows), rows
    # killed once its step's snapshot is complete, none is lost; with the snapshot in flight, at most that step
    assert all(row["lost"] == (0 if row["when"] == "after_snapshot" else row["lost"]) <= 1 for row in rows), rows
    assert {row["when"] for row in rows} == {"after_snapshot", "snapshot_in_flight"}, "seed 1 kills both ways"
    assert [row["reported_lost"] for row in rows] == [row["lost"] for row in rows], "engine.resumed.lost is right"
