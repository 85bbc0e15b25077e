"""Checkpoints beyond the saving world size: a 2-rank checkpoint resumes on 1, 3
and 4 ranks at every stage and trains like plain torch continuing from the same
state with the new global batch; zero.to_fp32 consolidates it into a
state_dict that loads strictly into the plain model. The converters
(to_fp32, to_deepspeed) never write into their checkpoint, nor over a
non-empty output unless asked, and a failed conversion leaves no output."""
from __future__ import annotations

import errno
import hashlib
import importlib.util
import os
import re
import shutil
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
from zero.checkpoint import load as checkpoint_load, model_files, to_deepspeed, to_fp32

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
        path, client = checkpoint_load.load(engine.checkpoint_parts(), save_dir, **keywords)
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
        checkpoint_load.load(engine.checkpoint_parts(), save_dir, "global_step9")


def test_load_keywords(saved) -> None:
    directory, params = saved
    run_ranks(keywords_worker, 1, directory, params, timeout=120)


# ---- the converters' outputs ([Note: a converter's output] in zero/checkpoint/output.py) ----------
CONVERTERS = {"to_fp32": to_fp32, "to_deepspeed": to_deepspeed}


def tree_digest(root: str) -> dict[str, str]:
    """Every file under `root` by relative path, with the sha256 of its bytes."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def source(saved, tmp_path) -> str:
    """A copy of the stage-1 save_dir, for the converters to be tried on."""
    directory, _ = saved
    return shutil.copytree(os.path.join(directory, "stage1"), str(tmp_path / "save"))


def test_converters_refuse_their_source(source, tmp_path) -> None:
    """An output that is the checkpoint, inside it or around it, by any path (a
    link included), is a ValueError naming both paths (on the command line a
    one-line error and a non-zero exit), and the checkpoint stays byte for byte."""
    checkpoint = os.path.join(source, "global_step2")
    link = str(tmp_path / "link")
    os.symlink(source, link)
    before = tree_digest(source)
    cases = [(source, source, "is"), (source, os.path.join(source, "converted"), "is inside"),
             (checkpoint, os.path.join(checkpoint, "fp32.pt"), "is inside"), (source, str(tmp_path), "contains"),
             (checkpoint, source, "contains"), (source, link, "is"), (source, os.path.join(link, "out"), "is inside"),
             (link, source, "is")]
    for name, converter in CONVERTERS.items():
        for src, dst, how in cases:
            case = f"{name} {src} -> {dst}"
            with pytest.raises(ValueError) as caught:
                converter.convert(src, dst)
            message = str(caught.value)
            assert f"the output {dst}" in message and f"{how} the checkpoint" in message and src in message, \
                f"{case}: {message}"
            assert tree_digest(source) == before, f"{case}: the checkpoint changed"
        with pytest.raises(SystemExit) as exited:
            converter.main([source, source])
        message = exited.value.code
        assert isinstance(message, str) and "\n" not in message and message.count(source) >= 2, f"{name}: {message!r}"
        assert tree_digest(source) == before, f"{name} {source} {source} on the command line: the checkpoint changed"
    state = torch.load(to_fp32.convert(source, str(tmp_path / "after.pt")))
    assert "blocks.0.fc1.weight" in state, sorted(state)


def refused_unless_overwrite(convert, output: str) -> None:
    """convert(overwrite=False) is refused and leaves `output` (a file or a folder) as it was."""
    before = tree_digest(output) if os.path.isdir(output) else open(output).read()
    with pytest.raises(ValueError, match=re.escape(f"the output {output} is not empty") + ".*--overwrite"):
        convert(overwrite=False)
    after = tree_digest(output) if os.path.isdir(output) else open(output).read()
    assert after == before, f"{output}: {before} -> {after}"


def test_to_fp32_writes_over_an_output_only_when_asked(source, tmp_path, monkeypatch) -> None:
    """A non-empty file: refused, then replaced with overwrite=True; a folder
    (DeepSpeed's output_dir) receives pytorch_model.bin; a write that fails
    leaves the old output, no temporary file and no folder it made."""
    out = str(tmp_path / "model.pt")
    with open(out, "w") as f:
        f.write("kept")
    refused_unless_overwrite(lambda **kw: to_fp32.convert(source, out, **kw), out)
    assert torch.load(to_fp32.convert(source, out, overwrite=True)).keys() == make_model(KIND).state_dict().keys()
    folder = str(tmp_path / "hf")
    os.makedirs(folder)
    written = to_fp32.convert(source, folder)
    assert written == os.path.join(folder, "pytorch_model.bin") and os.path.getsize(written) > 0, written
    assert to_fp32.convert(source, os.path.join(str(tmp_path), "new", ""), fmt="safetensors").endswith(
        os.path.join("new", "model.safetensors"))

    def full_disk(path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(model_files, "write_torch", full_disk)
    listed = sorted(os.listdir(tmp_path))
    with open(out, "w") as f:
        f.write("kept")
    for target in (out, os.path.join(str(tmp_path), "made", "deeper", "")):
        with pytest.raises(OSError, match="No space left"):
            to_fp32.convert(source, target, overwrite=True)
        assert sorted(os.listdir(tmp_path)) == listed, f"{target}: {sorted(os.listdir(tmp_path))} != {listed}"
    assert open(out).read() == "kept", "a failed write replaced the old output"


def test_to_deepspeed_writes_into_a_folder_only_when_asked(source, tmp_path, monkeypatch) -> None:
    """A non-empty OUT: refused, then written into with overwrite=True (its other
    files kept); a conversion that fails leaves no OUT it made."""
    out = str(tmp_path / "ds")
    os.makedirs(out)
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("kept")
    refused_unless_overwrite(lambda **kw: to_deepspeed.convert(source, out, **kw), out)
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed: the rest writes DeepSpeed's classes")
    assert to_deepspeed.convert(source, out, overwrite=True) == os.path.join(out, "global_step2")
    assert sorted(os.listdir(out)) == ["global_step2", "latest", "notes.txt", "zero_to_fp32.py"], os.listdir(out)
    assert to_deepspeed.convert(source, out, overwrite=True) == os.path.join(out, "global_step2"), "a second time"
    assert sorted(os.listdir(out)) == ["global_step2", "latest", "notes.txt", "zero_to_fp32.py"], os.listdir(out)

    def fails(source, partial, classes):
        with open(os.path.join(partial, "half.pt"), "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(to_deepspeed, "write_all", fails)
    with pytest.raises(OSError, match="No space left"):
        to_deepspeed.convert(source, str(tmp_path / "new" / "ds"))
    assert not os.path.exists(tmp_path / "new"), os.listdir(tmp_path / "new")
    with pytest.raises(OSError, match="No space left"):
        to_deepspeed.convert(source, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["global_step2", "latest", "notes.txt", "zero_to_fp32.py"], os.listdir(out)
