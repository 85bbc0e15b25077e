"""The "ringcomm" backend under every init method (env://, tcp://, store=) and
under torchrun, single node and multi-node (--nnodes 2 on one host)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import ringcomm  # noqa: F401  (registers the backend)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_method_worker(rank: int, world_size: int, scheme: str, port: int) -> None:
    dist.barrier()  # every rank has finished connecting the harness's gloo group before any leaves it
    dist.destroy_process_group()
    kwargs = {"rank": rank, "world_size": world_size, "timeout": timedelta(seconds=60)}
    if scheme == "env":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        dist.init_process_group("ringcomm", init_method="env://", **kwargs)
    elif scheme == "tcp":
        dist.init_process_group("ringcomm", init_method=f"tcp://127.0.0.1:{port}", **kwargs)
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("ringcomm", store=store, **kwargs)
    tensor = torch.full((5,), float(rank + 1))
    dist.all_reduce(tensor)
    want = world_size * (world_size + 1) / 2
    assert torch.all(tensor == want), f"rank {rank}: {scheme}: all_reduce {tensor} != {want}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["env", "tcp", "store"])
def test_init_methods(scheme: str) -> None:
    run_ranks(init_method_worker, 2, scheme, free_port(), timeout=50)


TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist, ringcomm
dist.init_process_group("ringcomm")
rank, world_size = dist.get_rank(), dist.get_world_size()
t = torch.full((4,), float(rank + 1)); dist.all_reduce(t)
out = torch.empty(world_size * 2); dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
assert torch.all(t == world_size * (world_size + 1) / 2), t
assert out.tolist() == [float(r) for r in range(world_size) for _ in (0, 1)], out
print(f"OK rank {rank} transport {dist.group.WORLD._group.transport.kind}")
dist.destroy_process_group()
"""


def run_torchrun(script: str, *launches: list[str], env: dict[str, str]) -> list[str]:
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, script], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for args in launches]
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, f"torchrun {proc.args} failed:\n{out}"
        outputs.append(out)
    return outputs


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_torchrun_single_and_multi_node() -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as file:
            file.write(TORCHRUN_SCRIPT)
        single = run_torchrun(script, ["--standalone", "--nproc-per-node", "2"], env=env)
        assert single[0].count("OK rank") == 2 and "transport shm" in single[0], single[0]
        endpoint = f"127.0.0.1:{free_port()}"  # two "nodes" on this host; force the cross-host transport
        nodes = [["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", endpoint, "--rdzv-id", "ringcomm-test"] for n in range(2)]
        multi = run_torchrun(script, *nodes, env={**env, "RINGCOMM_TRANSPORT": "torch_dist"})
        assert all("OK rank" in out and "transport torch_dist" in out for out in multi), multi
