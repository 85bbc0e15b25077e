"""A checkpoint written by an earlier version of zero (tests/data/zero_ckpt_v1,
made by its make_fixture.py) loads into today's engine exactly: every rank's
fp32 master slices and Adam states, the loss scale, the LR, the counters, and
the next step; and today's save writes the same files (the on-disk format
does not drift)."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from safetensors import safe_open

from harness import run_ranks

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "zero_ckpt_v1")
sys.path.insert(0, FIXTURE)

import make_fixture as fx  # noqa: E402  (the fixture's config and training loop)


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def fixture_worker(rank: int, world_size: int, out: str) -> None:
    for stage in fx.STAGES:
        case = f"rank {rank} stage {stage}"
        expected = torch.load(os.path.join(FIXTURE, f"stage{stage}_expected_rank{rank}.pt"), weights_only=True)
        engine = fx.new_engine(stage)
        path, client = engine.load_checkpoint(os.path.join(FIXTURE, f"stage{stage}"), tag="saved")
        assert client == {}, f"{case}: {client}"
        got = fx.held(engine)
        for key in expected:
            if key in got:
                assert same(got[key], expected[key]), f"{case}: {key} differs from the fixture"
        assert same([t.clone() for t in engine.full_params_fp32()], expected["full"]), f"{case}: full params"
        engine.save_checkpoint(os.path.join(out, f"stage{stage}"), tag="saved")
        fx.train(engine, rank, range(fx.SAVED_STEPS, fx.SAVED_STEPS + 1))
        assert same([t.clone() for t in engine.full_params_fp32()], expected["full_after_next_step"]), \
            f"{case}: the step after the resume differs"


def tensors(path: str) -> dict:
    with safe_open(path, "pt") as f:
        metadata = {k: json.loads(v) if k != "format" else v for k, v in f.metadata().items()}
        return {"metadata": metadata, **{k: f.get_tensor(k) for k in f.keys()}}  # json: order is not format


def test_fixture_loads_exactly_and_saves_the_same_files() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-fixture-") as out:
        run_ranks(fixture_worker, 2, out, timeout=120)
        for stage in fx.STAGES:
            old, new = (os.path.join(d, f"stage{stage}", "saved") for d in (FIXTURE, out))
            assert sorted(os.listdir(old)) == sorted(os.listdir(new)), f"stage {stage}: the files differ"
            for r in range(2):
                name = f"zero_shards_rank{r}_of2.safetensors"
                same_file = same(tensors(os.path.join(old, name)), tensors(os.path.join(new, name)))
                assert same_file, f"stage {stage}: {name}"
            for name in ("engine_state.pt", "model_states.pt"):
                a, b = (torch.load(os.path.join(d, name), weights_only=True) for d in (old, new))
                assert same(a, b), f"stage {stage}: {name} differs"
            with open(os.path.join(old, "manifest.json")) as f, open(os.path.join(new, "manifest.json")) as g:
                a, b = json.load(f), json.load(g)
            assert a["format"] == b["format"] and a["files"].keys() == b["files"].keys(), f"stage {stage}: manifest"
