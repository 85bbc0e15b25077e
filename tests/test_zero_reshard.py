"""Checkpoints beyond the saving world size: a 2-rank checkpoint resumes on 1, 3
and 4 ranks at every stage and trains like plain torch continuing from the same
state with the new global batch; zero.to_fp32 consolidates it into a
state_dict that loads strictly into the plain model."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from harness import run_ranks
from zero_reference import CLIP, LR, MICRO, engine_config, loss_fn, make_batch, make_model

import zero
from zero.checkpoint import load as checkpoint_load, to_fp32

KIND, SAVED_WORLD, SAVED_STEPS, MORE_STEPS = "tied", 2, 2, 3
STAGES = (0, 1, 2, 3)
# fp32 differs from plain torch only by summation order (ranks, buckets): see test_zero_parity's TOLERANCE
LOSS_RTOL = 1e-5


def new_engine(stage: int, world_size: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=make_model(KIND), config=engine_config(stage, "fp32", 1, world_size))
    return engine


def train(engine, rank: int, world_size: int, steps: range) -> list[float]:
    """One micro-batch per rank and step; returns the global mean loss of each step."""
    losses = []
    for step in steps:
        x, y = make_batch(KIND, MICRO * world_size, step)
        lo = rank * MICRO
        loss = loss_fn(KIND, engine(x[lo:lo + MICRO]), y[lo:lo + MICRO])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    return losses


def save_worker(rank: int, world_size: int, directory: str) -> dict:
    """Trains SAVED_STEPS at every stage and saves; rank 0 returns the parameters by name."""
    out = {}
    for stage in STAGES:
        engine = new_engine(stage, world_size)
        train(engine, rank, world_size, range(SAVED_STEPS))
        engine.save_checkpoint(os.path.join(directory, f"stage{stage}"))
        out[stage] = {name: p.numpy() for name, p in zip(engine.parts.param_names, engine.full_params_fp32())}
    engine = big_engine()
    engine.save_checkpoint(os.path.join(directory, "big"))
    return out if rank == 0 else {}  # numpy: pickled by value through the result pipe


def big_model() -> torch.nn.Module:
    """One large parameter (16 MiB in fp32) and 24 MiB in smaller ones."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048, bias=False),
                               *(torch.nn.Linear(1024, 1024, bias=False) for _ in range(6)))


def big_engine():
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=big_model(), config=config)
    return engine


def resume_worker(rank: int, world_size: int, directory: str) -> dict:
    out = {}
    for stage in STAGES:
        engine = new_engine(stage, world_size)
        path, _ = engine.load_checkpoint(os.path.join(directory, f"stage{stage}"))
        assert engine.global_steps == SAVED_STEPS, f"rank {rank}/{world_size} stage {stage}: {engine.global_steps=}"
        out[stage] = train(engine, rank, world_size, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    return out


def reference_resume(world_size: int) -> list[float]:
    """Plain torch: SAVED_STEPS on the 2-rank global batch, then MORE_STEPS on
    `world_size` ranks' global batch, AdamW + clipping as engine_config."""
    model = make_model(KIND)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    losses = []
    for step in range(SAVED_STEPS + MORE_STEPS):
        ranks = SAVED_WORLD if step < SAVED_STEPS else world_size
        x, y = make_batch(KIND, MICRO * ranks, step)
        opt.zero_grad()
        loss = loss_fn(KIND, model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return losses[SAVED_STEPS:]


@pytest.fixture(scope="module")
def saved():
    with tempfile.TemporaryDirectory(prefix="zero-reshard-") as directory:
        params = run_ranks(save_worker, SAVED_WORLD, directory, timeout=180)[0]
        yield directory, params


def test_to_fp32_loads_strictly(saved, tmp_path) -> None:
    directory, params = saved
    plain = make_model(KIND)
    for stage in STAGES:
        save_dir = os.path.join(directory, f"stage{stage}")
        for out, load in ((tmp_path / f"s{stage}.safetensors", load_file), (tmp_path / f"s{stage}.pt", torch.load)):
            to_fp32.convert(save_dir, str(out))
            state = load(str(out))
            assert state.keys() == plain.state_dict().keys(), f"stage {stage} {out.name}: {sorted(state)}"
            plain.load_state_dict(state, strict=True)
            for name, value in plain.named_parameters():
                assert torch.equal(value.detach(), torch.from_numpy(params[stage][name])), f"stage {stage} {out.name}: {name}"
        assert plain.head.weight is plain.embed.weight, "strict loading keeps the model's tie"
        tied = torch.load(str(tmp_path / f"s{stage}.pt"))
        assert tied["head.weight"].data_ptr() == tied["embed.weight"].data_ptr(), "torch format shares tied storage"
        states = torch.load(os.path.join(save_dir, "global_step2", "model_states.pt"))
        assert states.keys() == plain.state_dict().keys(), f"stage {stage}: model_states.pt {sorted(states)}"


def test_to_fp32_command_line(saved, tmp_path) -> None:
    directory, params = saved
    out = tmp_path / "model.bin"
    subprocess.run([sys.executable, "-m", "zero.to_fp32", os.path.join(directory, "stage3"), str(out),
                    "--format", "safetensors"], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    state = load_file(str(out))
    assert torch.equal(state["blocks.0.fc1.weight"], torch.from_numpy(params[3]["blocks.0.fc1.weight"]))


PEAK_SCRIPT = """
import sys
from zero.checkpoint import save, to_fp32
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
for output in sys.argv[2:]:
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    base = status("VmRSS:")
    to_fp32.convert(sys.argv[1], output)
    print(status("VmHWM:") - base)
"""
FIXED_NBYTES = 8 << 20  # headers, the index of shards, Python objects; not proportional to the model


def test_to_fp32_streams(saved, tmp_path) -> None:
    """Peak memory of a conversion: the largest parameter plus a fixed buffer, not the model."""
    directory, _ = saved
    model = big_model()
    largest = max(p.numel() * 4 for p in model.parameters())
    total = sum(p.numel() * 4 for p in model.parameters())
    assert largest + FIXED_NBYTES < total, "the model must be able to tell streaming from loading it whole"
    outputs = [str(tmp_path / "big.safetensors"), str(tmp_path / "big.pt")]
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, os.path.join(directory, "big"), *outputs], check=True,
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    for output, peak in zip(outputs, map(int, done.stdout.split())):
        assert peak <= largest + FIXED_NBYTES, f"{output}: peak {peak / 2**20:.1f} MiB > largest parameter " \
                                               f"{largest / 2**20:.1f} MiB + {FIXED_NBYTES / 2**20:.0f} MiB"
    reference = big_model().state_dict()
    for state in (load_file(outputs[0]), torch.load(outputs[1])):
        assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in reference)


@pytest.mark.parametrize("world_size", [1, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_resume_on_other_world_size(saved, world_size: int) -> None:
    directory, _ = saved
    results = run_ranks(resume_worker, world_size, directory, timeout=240)
    reference = reference_resume(world_size)
    for stage in STAGES:
        losses = results[0][stage]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=LOSS_RTOL, atol=LOSS_RTOL,
                                   msg=lambda m: f"stage {stage}, 2 -> {world_size} ranks: {losses} vs {reference}: {m}")


def keywords_worker(rank: int, world_size: int, directory: str, params: dict) -> None:
    """DeepSpeed's load_checkpoint keywords, through checkpoint_load.load (a 2-rank stage 2 save, loaded on 1 rank)."""
    save_dir = os.path.join(directory, "stage2")
    for keywords, steps, has_states in (({}, SAVED_STEPS, True), ({"load_optimizer_states": False}, SAVED_STEPS, False),
                                        ({"load_module_only": True}, 0, False)):
        engine = new_engine(2, world_size)
        path, client = checkpoint_load.load(engine, save_dir, **keywords)
        assert path.endswith("global_step2") and client == {}, f"{keywords}: {path} {client}"
        assert engine.global_steps == steps, f"{keywords}: {engine.global_steps=}"
        states = [s for s in engine.optimizer.state.values() if s]
        assert bool(states) == has_states, f"{keywords}: optimizer states {len(states)}"
        if has_states:
            assert all(float(s["step"]) == SAVED_STEPS for s in states), f"{keywords}: steps"
        for name, value in zip(engine.parts.param_names, engine.full_params_fp32()):
            assert torch.equal(value, torch.from_numpy(params[2][name])), f"{keywords}: {name}"
    engine = new_engine(2, world_size)
    with pytest.raises(ValueError, match="no checkpoint directory"):
        checkpoint_load.load(engine, save_dir, "global_step9")


def test_load_keywords(saved) -> None:
    directory, params = saved
    run_ranks(keywords_worker, 1, directory, params, timeout=120)
