"""Hugging Face Trainer and Accelerate on the "ringcomm" backend, as a user runs
them: tests/hf_trainer_script.py initializes torch.distributed on the backend
before TrainingArguments / Accelerator and trains a tiny GPT-2 (from a config,
no download) on random learnable data, on gloo and on ringcomm in one launch
of 2 CPU ranks; every rank's losses and the final parameters must agree.
Launched by torchrun (Trainer) and by `accelerate launch --config_file`
(a plain Accelerate loop)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers not installed (test extra)")
pytest.importorskip("accelerate", reason="accelerate not installed (test extra)")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "hf_trainer_script.py")
STEPS = 3

# What `accelerate launch` needs for 2 processes on a CPU-only host: MULTI_GPU
# chooses torchrun's launcher (MULTI_CPU starts one process, or mpirun with a
# hostfile), and use_cpu keeps the processes on the CPU (ACCELERATE_USE_CPU).
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
num_machines: 1
machine_rank: 0
use_cpu: true
mixed_precision: 'no'
"""


def run_launch(command: list[str], runs: str, out: str) -> dict:
    """One launch of the script: `runs` in turn in the same 2 processes."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command + [SCRIPT, "--runs", runs, "--steps", str(STEPS), "--out", out], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{command[:4]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(out) as file:
        return json.load(file)


def assert_same_training(results: dict, reference: str, run: str) -> None:
    """`run` trained as `reference` did: every rank's losses and every parameter.
    fp32, 2 ranks: a sum of two is the same in either order, so gloo and ringcomm
    agree to the bit here; 1e-6 relative leaves room for another reduction order."""
    want, got = results[reference], results[run]
    assert got["backend"] == run.split(":")[0], f"{run}: ran on {got['backend']}"
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=0,
                               msg=lambda m: f"{run} vs {reference}: losses per rank and step: {m}")
    assert got["params"].keys() == want["params"].keys(), f"{run} vs {reference}: parameter names"
    for name, value in want["params"].items():
        torch.testing.assert_close(torch.tensor(got["params"][name]), torch.tensor(value), rtol=1e-6, atol=1e-7,
                                   msg=lambda m, n=name: f"{run} vs {reference}: parameter {n}: {m}")


def assert_learned(results: dict, run: str) -> None:
    """The data is learnable and the ranks see different batches: a test that would
    pass with a frozen model or one rank's data on both is no test."""
    losses = results[run]["losses"]
    assert all(rank_losses[-1] < rank_losses[0] for rank_losses in losses), f"{run}: losses did not fall: {losses}"
    assert losses[0] != losses[1], f"{run}: both ranks saw the same data: {losses}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_under_torchrun(tmp_path) -> None:
    """Trainer with DDP; and Trainer given fsdp=True on CPU, which Accelerate runs
    as DDP (FSDP needs an accelerator there): the parameters stay whole."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    results = run_launch(command, "gloo:ddp,ringcomm:ddp,ringcomm:fsdp2", str(tmp_path / "out.json"))
    assert_learned(results, "gloo:ddp")
    assert_same_training(results, "gloo:ddp", "ringcomm:ddp")
    assert results["ringcomm:ddp"]["wrapper"] == "DistributedDataParallel", results["ringcomm:ddp"]["wrapper"]
    fsdp = results["ringcomm:fsdp2"]
    assert not fsdp["sharded"] and fsdp["distributed_type"] == "MULTI_CPU", \
        f"Trainer ran fsdp=True on CPU as {fsdp['wrapper']} ({fsdp['distributed_type']}, sharded {fsdp['sharded']}): " \
        f"Accelerate now shards on CPU; compare it with gloo and update the README"
    assert_same_training(results, "gloo:ddp", "ringcomm:fsdp2")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_launch_config_file(tmp_path) -> None:
    config = tmp_path / "accelerate.yaml"
    config.write_text(ACCELERATE_CONFIG)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    results = run_launch(command, "gloo:accelerate,ringcomm:accelerate", str(tmp_path / "out.json"))
    assert_learned(results, "gloo:accelerate")
    assert_same_training(results, "gloo:accelerate", "ringcomm:accelerate")
    assert results["ringcomm:accelerate"]["wrapper"] == "DistributedDataParallel", results["ringcomm:accelerate"]

