"""Atomic checkpoints: a rank SIGKILLed at each phase of save_checkpoint (with a
fixed tag that already exists, and with the default tag) leaves a checkpoint
that loads: the previous one, or the new one once it is complete."""
from __future__ import annotations

import os
import signal
import tempfile

import pytest
import torch

from harness import run_ranks
from test_zero_reshard import new_engine, train

from zero.checkpoint import save
from zero.checkpoint.parts import CheckpointOptions

STAGE = 2
# (phase at which rank 0 dies, fixed tag?) -> which checkpoint must load afterwards. Rank 1 dies at
# the same phase ("written") or while waiting for rank 0's commit: the whole job is killed.
CASES = {
    ("written", True): "before", ("committing", True): "before", ("renamed_old", True): "before",
    ("before_latest", True): "after",
    ("written", False): "before", ("committing", False): "before", ("before_latest", False): "before",
}


def kill_worker(rank: int, world_size: int, save_dir: str, phase: str, victims: tuple[int, ...], fixed: bool) -> str:
    """Saves after a step, writes the parameters at both saves next to the
    checkpoint, then saves again after another step and is killed at `phase`."""
    tag = "fixed" if fixed else None
    engine = new_engine(STAGE, world_size)
    engine.checkpoint_options = CheckpointOptions(timeout_s=3.0)  # a survivor stops waiting for a dead rank
    train(engine, rank, world_size, range(1))
    engine.save_checkpoint(save_dir, tag)
    before = engine.full_params_fp32()
    train(engine, rank, world_size, range(1, 2))
    after = engine.full_params_fp32()
    if rank == 0:
        torch.save({"before": before, "after": after}, save_dir + ".expected.pt")

    def hook(at: str, at_rank: int) -> None:
        if rank in victims and at in (phase, "waiting"):
            os.kill(os.getpid(), signal.SIGKILL)
    engine.checkpoint_options = CheckpointOptions(timeout_s=3.0, on_phase=hook)
    try:
        engine.save_checkpoint(save_dir, tag)
    except RuntimeError as error:  # a dead rank fails the barrier
        return str(error)
    return "saved"


def load_worker(rank: int, world_size: int, cases: dict) -> None:
    """Loads each killed save's directory on one rank and checks which parameters it holds."""
    for (phase, fixed), (save_dir, which) in cases.items():
        case = f"killed at {phase}, {'fixed' if fixed else 'default'} tag"
        expected = torch.load(save_dir + ".expected.pt")[which]
        engine = new_engine(STAGE, world_size)
        engine.load_checkpoint(save_dir, "fixed" if fixed else None)
        for i, (a, b) in enumerate(zip(engine.full_params_fp32(), expected, strict=True)):
            assert torch.equal(a, b), f"{case}: parameter {i} is not the {which} checkpoint's"
        if fixed:  # the next save with that tag completes, and loads
            train(engine, rank, world_size, range(2, 3))
            engine.save_checkpoint(save_dir, "fixed")
            resumed = new_engine(STAGE, world_size)
            resumed.load_checkpoint(save_dir)
            for a, b in zip(resumed.full_params_fp32(), engine.full_params_fp32()):
                assert torch.equal(a, b), f"{case}: the save after the kill does not load"
            assert not [f for f in os.listdir(save_dir) if f.startswith(".")], f"{case}: {os.listdir(save_dir)}"


@pytest.mark.slow
def test_kill_during_save() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-kill-") as directory:
        loads = {}
        for (phase, fixed), which in CASES.items():
            save_dir = os.path.join(directory, f"{phase}-{fixed}")
            results = run_ranks(kill_worker, 2, save_dir, phase, (0, 1), fixed, timeout=120, may_die=frozenset({0, 1}))
            assert results == [None, None], f"{phase}: both ranks were to be killed, got {results}"
            loads[(phase, fixed)] = (save_dir, which)
        save_dir = os.path.join(directory, "one-rank")  # rank 1 alone dies: rank 0 gets an error, not a hang
        results = run_ranks(kill_worker, 2, save_dir, "written", (1,), True, timeout=120, may_die=frozenset({1}))
        assert results[1] is None and "rank(s) [1] of 2 did not arrive" in results[0], f"rank 0 after rank 1 died: {results}"
        loads[("one rank", True)] = (save_dir, "before")
        run_ranks(load_worker, 1, loads, timeout=120)


@pytest.mark.parametrize("tag", ["../x", ".hidden", ""])
def test_bad_tag(tag: str) -> None:
    with pytest.raises(ValueError, match="tag"):
        save.save(None, "/nonexistent", tag)
