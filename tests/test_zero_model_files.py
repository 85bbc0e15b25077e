"""The whole model as files without holding it ([Note: sharded model files] in
zero/checkpoint/model_files.py): sizes parse as Hugging Face's, shards are
split as save_pretrained splits them, transformers loads zero.to_fp32's and
save_16bit_model's shards and gives the training model's logits exactly, and
save_checkpoint / save_16bit_model at stage 3 never gather the whole model
and load_checkpoint stages no copy of a rank's states (peak RSS, reset
through /proc/self/clear_refs, stays below half the model)."""
from __future__ import annotations

import json
import os
import random
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks

import zero
from zero.checkpoint import to_fp32
from zero.checkpoint.model_files import ModelLayout, parse_size, plan_files
from zero.checkpoint.tensorfile import SafetensorsReader, TensorSpec


def test_sizes_parse_as_hugging_face_does() -> None:
    assert parse_size("2GB") == 2 * 10**9 and parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5kb") == 1500 and parse_size(4096) == 4096 and parse_size("7") == 7
    for bad in ("", "2 GX", "-1GB", "0", 0, True, "GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_shards_split_greedily_in_order_and_tied_names_follow_their_tensor() -> None:
    rng = random.Random(3)
    for trial in range(200):
        specs = [TensorSpec(f"t{i}", (rng.randint(1, 40),), torch.float32) for i in range(rng.randint(1, 30))]
        tied = {f"alias{i}": specs[rng.randrange(len(specs))].name for i in range(rng.randint(0, 3))}
        limit = rng.randint(4, 400)
        nbytes = {spec.name: spec.nbytes for spec in specs}
        for fmt in ("safetensors", "torch"):
            plans = plan_files(ModelLayout(specs, tied), "model.bin", fmt, limit)
            sizes = [sum(s.nbytes for s in plan.specs) for plan in plans]
            names = [s.name for plan in plans for s in plan.specs if s.name in nbytes]
            assert names == [s.name for s in specs], f"{trial} {fmt}: the order changed"
            for i, plan in enumerate(plans):
                alone = sum(1 for s in plan.specs if s.name in nbytes) == 1
                assert sizes[i] <= limit or alone, f"{trial} {fmt}: shard {i} holds {sizes[i]} > {limit} bytes"
                if i + 1 < len(plans):  # greedy: the next file's first tensor (with its copies) did not fit
                    first = plans[i + 1].specs[0].name
                    copies = sum(1 for target in tied.values() if target == first) if fmt == "safetensors" else 0
                    assert sizes[i] + nbytes[first] * (1 + copies) > limit, f"{trial} {fmt}: shard {i} not full"
            held = {s.name: plan for plan in plans for s in plan.specs}
            for alias, target in tied.items():
                if fmt == "safetensors":  # a copy beside its tensor
                    assert held[alias] is held[target], f"{trial}: {alias} not beside {target}"
                else:  # shares the tensor in its file
                    assert held[target].aliases.get(alias) == target, f"{trial}: {alias} not tied to {target}"
            expected = ["model.bin"] if len(plans) == 1 else \
                [f"model-{i:05d}-of-{len(plans):05d}.bin" for i in range(1, len(plans) + 1)]
            assert [plan.name for plan in plans] == expected


# ---- Hugging Face loads what zero writes ----------------------------------------------------------
SHARD = "60KB"


def hf_files_worker(rank: int, world_size: int, root: str) -> dict:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=128)
    model = transformers.GPT2LMHeadModel(config)  # lm_head tied to the token embedding
    ds = {"train_batch_size": 2 * world_size, "train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=ds)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    ckpt, fp32, z16 = (os.path.join(root, name) for name in ("ckpt", "fp32", "z16"))
    engine.save_checkpoint(ckpt)
    engine.save_16bit_model(z16, "model.safetensors", max_shard_size=SHARD)
    engine.eval()
    probe = torch.arange(24).reshape(2, 12) % 128
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    out = {}
    if rank == 0:
        index = to_fp32.convert(ckpt, fp32, max_shard_size=SHARD)
        assert index == os.path.join(fp32, "model.safetensors.index.json"), index
        for folder in (fp32, z16):
            config.save_pretrained(folder)
            loaded = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
            with torch.no_grad():
                got = loaded(input_ids=probe).logits
            assert got.dtype == torch.float32 and torch.equal(got, logits), \
                f"{folder}: logits differ by {(got - logits).abs().max()}"
            with open(os.path.join(folder, "model.safetensors.index.json")) as f:
                index = json.load(f)
            files = sorted(set(index["weight_map"].values()))
            assert set(index["weight_map"]) == set(model.state_dict()), f"{folder}: the index misses keys"
            for name in files:
                assert re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", name), name
                with SafetensorsReader(os.path.join(folder, name)) as reader:
                    held = sum(spec.nbytes for spec in reader.specs.values())
                    tensors = [spec for spec in reader.specs if spec != "lm_head.weight"]  # a copy of the embedding
                    assert held <= parse_size(SHARD) or len(tensors) == 1, f"{name}: {held} bytes, {tensors}"
            out[os.path.basename(folder)] = len(files)
    dist.barrier()
    return out


def test_transformers_loads_the_shards_with_the_training_logits(tmp_path) -> None:
    pytest.importorskip("transformers")
    shards = run_ranks(hf_files_worker, 2, str(tmp_path), timeout=240)[0]
    assert shards["fp32"] > 2 and shards["z16"] > 2, shards  # the 60 KB limit splits the ~0.5 MB model


def frozen_and_failure_worker(rank: int, world_size: int, root: str) -> dict:
    """save_16bit_model leaves out frozen parameters when asked, and a write that
    fails on rank 0 is the same error on every rank (no rank waits in a gather)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].weight.requires_grad_(False)
    ds = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=ds)
    engine.save_16bit_model(os.path.join(root, "all"))
    engine.save_16bit_model(os.path.join(root, "trainable"), exclude_frozen_parameters=True)
    blocked = os.path.join(root, "a-file")
    if rank == 0:
        with open(blocked, "w") as f:
            f.write("not a folder")
    dist.barrier()
    with pytest.raises(Exception, match="rank 0") as caught:  # rank 0 cannot make its folder
        engine.save_16bit_model(blocked, max_shard_size=1000)
    keys = {}
    if rank == 0:
        for name in ("all", "trainable"):
            keys[name] = sorted(torch.load(os.path.join(root, name, "pytorch_model.bin"), weights_only=True))
    return {"keys": keys, "error": str(caught.value)}


def test_16bit_model_without_frozen_parameters_and_a_failed_write(tmp_path) -> None:
    results = run_ranks(frozen_and_failure_worker, 2, str(tmp_path), timeout=120)
    assert results[0]["keys"] == {"all": ["0.bias", "0.weight", "1.bias", "1.weight"],
                                  "trainable": ["0.bias", "0.weight", "1.bias"]}, results[0]["keys"]
    assert results[0]["error"] == results[1]["error"], results


# ---- no rank holds the model -------------------------------------------------------------------
LAYERS, WIDTH = 16, 1024  # 16M parameters: 64 MiB of fp32 masters


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)[1])


def peak_above_now(fn) -> int:
    """Bytes by which this process's peak RSS rose above its RSS while fn ran."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to VmRSS
    before = status_kib("VmRSS")
    fn()
    return (status_kib("VmHWM") - before) * 1024


def memory_worker(rank: int, world_size: int, root: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    ds = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": WIDTH * WIDTH,
                                "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=ds)
    engine.backward(engine(torch.randn(1, WIDTH)).square().mean())
    engine.step()
    peaks = {"save_checkpoint": peak_above_now(lambda: engine.save_checkpoint(os.path.join(root, "ckpt"))),
             "save_16bit_model": peak_above_now(lambda: engine.save_16bit_model(os.path.join(root, "z16")))}
    # a load writes the saved states into the masters and moments in place: no staged copy of them
    peaks["load_checkpoint"] = peak_above_now(lambda: engine.load_checkpoint(os.path.join(root, "ckpt")))
    dist.barrier()
    if rank == 0:  # the files hold the model: the masters, whole
        saved = torch.load(os.path.join(root, "z16", "pytorch_model.bin"), mmap=True, weights_only=True)
        states = torch.load(os.path.join(root, "ckpt", "global_step1", "model_states.pt"), mmap=True, weights_only=True)
        assert set(saved) == set(states) == {f"{i}.weight" for i in range(LAYERS)}
    full = engine.full_params_fp32()
    if rank == 0:
        for i, master in enumerate(full):
            assert torch.equal(saved[f"{i}.weight"], master) and torch.equal(states[f"{i}.weight"], master), i
    return peaks


def test_stage3_saves_and_loads_without_holding_the_model(tmp_path) -> None:
    model_nbytes = LAYERS * WIDTH * WIDTH * 4
    for rank, peaks in enumerate(run_ranks(memory_worker, 2, str(tmp_path), timeout=240)):
        for what, peak in peaks.items():
            assert peak < model_nbytes // 2, f"rank {rank}: {what} raised the peak RSS by {peak >> 20} MiB " \
                                             f"(the model is {model_nbytes >> 20} MiB)"


@pytest.mark.slow
def test_checkpoint_memory_benchmark_runs(tmp_path, capsys) -> None:
    """benchmarks/checkpoint_memory.py at a tiny size: every phase measured on every rank, the table printed."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import checkpoint_memory
    out = tmp_path / "memory.json"
    assert checkpoint_memory.main(["--layers", "2", "--width", "256", "--max-shard-size", "100KB",
                                   "--json", str(out)]) == 0
    ranks = json.loads(out.read_text())["ranks"]
    phases = ("build", "train", "save_checkpoint", "load_checkpoint", "save_16bit_model", "to_fp32")
    assert [r["rank"] for r in ranks] == [0, 1] and all(tuple(r["phases"]) == phases for r in ranks), ranks
    assert ranks[0]["disk_mib"]["fp32"] > 2 * 256 * 256 * 4 / 2**20 * 0.99, ranks[0]["disk_mib"]  # the fp32 model
    assert "save_checkpoint: peak" in capsys.readouterr().out
