"""A training run moves between DeepSpeed (0.19.8 on the CPU) and zero, both
ways, at stages 1-3, with the DeepSpeed user's script of tests/dropin_script.py
(a small GPT with tied embeddings, AdamW + WarmupLR, clipping, accumulation 2):

- zero -> DeepSpeed: zero saves after SAVED steps and continues; its
  checkpoint, written in DeepSpeed's layout (python -m zero.to_deepspeed),
  continues on DeepSpeed with the same losses and grad norms, and DeepSpeed's
  get_fp32_state_dict_from_zero_checkpoint (and the zero_to_fp32.py beside it)
  gives exactly zero's own to_fp32 output;
- DeepSpeed -> zero: DeepSpeed saves and continues; zero resumes its
  checkpoint on the same 2 ranks with DeepSpeed's losses, and on 1 and 3
  ranks (resharded) with the losses of plain PyTorch continuing from the same
  state (its own SAVED steps, DeepSpeed's WarmupLR on torch's AdamW).
Each step reports the mean loss over every micro-batch of every rank and the
global grad norm. fp32: both engines sum the same gradients in other orders:
1e-5 relative."""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import struct
import tempfile
import warnings
import zipfile

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from test_zero_checkpoint_safety import TIMEOUT_S, Payload, expect_refusal, flip
from test_zero_dropin import load_script

import zero_reference  # noqa: F401  (puts the repo root on sys.path)
from zero.checkpoint import save

STAGES, SAVED, MORE = (1, 2, 3), 3, 3
# fp32: both engines sum the same gradients in other orders: 1e-5 relative. bf16: their gradients
# differ by bf16 ulps (tests/test_zero_dropin.py's tolerances, measured there): 2e-3 and 1e-3 relative.
# fp16 (more mantissa than bf16) gets bf16's bounds; its dynamic loss scale must move with the checkpoint.
RTOL = {"fp32": {"loss": 1e-5, "grad_norm": 1e-5}, "bf16": {"loss": 2e-3, "grad_norm": 1e-3},
        "fp16": {"loss": 2e-3, "grad_norm": 1e-3, "loss_scale": 0}}
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed not installed (test extra)")


def train(script, engine, rank: int, world_size: int, steps: range) -> dict[str, list[float]]:
    out = {"loss": [], "grad_norm": [], "loss_scale": []}
    for step in steps:
        out["loss_scale"].append(loss_scale(engine))
        total = torch.zeros(1)
        for micro in range(script.ACCUMULATION):
            loss = engine(*script.batch(step, micro, rank))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        out["loss"].append(float(total) / (script.ACCUMULATION * world_size))
        out["grad_norm"].append(float(engine.get_global_grad_norm()))
    return out


def loss_scale(engine) -> float:
    """The current loss scale: DeepSpeed's ZeRO optimizer's (its engine's loss_scale() is the config's), zero's."""
    scale = getattr(engine.optimizer, "loss_scale", None)
    return float(engine.loss_scale if scale is None else scale)


def new_engine(script, stage: int, dtype: str = "fp32", offload: bool = False, scale_power: int = 8):
    torch.manual_seed(0)
    model = script.GPT()
    config = script.config(stage, "fp32" if dtype == "fp16" else dtype)
    if dtype == "fp16":  # dynamic loss scaling (no overflow in these runs)
        config["fp16"] = {"enabled": True, "initial_scale_power": scale_power}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = script.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def kinds(world_size: int) -> list[tuple[int, str]]:
    """(stage, dtype) of each checkpoint saved on `world_size` ranks."""
    dtypes = ("fp32", "bf16", "fp16") if world_size == 2 else ("fp32",)
    return [(stage, dtype) for dtype in dtypes for stage in STAGES]


def path(root: str, stage: int, dtype: str) -> str:
    return os.path.join(root, f"s{stage}_{dtype}")


def start(rank: int, world_size: int, engine: str):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    warnings.simplefilter("ignore")
    script = load_script(engine)
    script.deepspeed.init_distributed(dist_backend="gloo")
    return script


def save_worker(rank: int, world_size: int, engine_name: str, root: str) -> dict:
    """SAVED steps, save (root/NAME/sS), MORE steps: the continued run's losses."""
    script, out = start(rank, world_size, engine_name), {}
    for stage, dtype in kinds(world_size):
        engine = new_engine(script, stage, dtype)
        train(script, engine, rank, world_size, range(SAVED))
        engine.save_checkpoint(path(os.path.join(root, engine_name), stage, dtype))
        out[stage, dtype] = train(script, engine, rank, world_size, range(SAVED, SAVED + MORE))
        if hasattr(engine, "destroy"):
            engine.destroy()
    return out


def resume_worker(rank: int, world_size: int, engine_name: str, directory: str, saved_on: int) -> dict:
    """Resumes each checkpoint saved on `saved_on` ranks on `engine_name` and
    trains MORE steps; on zero also stage 3 with the optimizer offloaded."""
    script, out = start(rank, world_size, engine_name), {}
    cases = [(stage, dtype, False) for stage, dtype in kinds(saved_on)]
    if engine_name == "zero" and world_size == saved_on:
        cases.append((3, "fp32", True))
    for stage, dtype, offload in cases:
        engine = new_engine(script, stage, dtype, offload, scale_power=12)  # the saved scale (2**8) must win
        engine.load_checkpoint(path(directory, stage, dtype))
        assert engine.global_steps == SAVED, (engine_name, stage, engine.global_steps)
        out[(stage, dtype, "offload") if offload else (stage, dtype)] = train(script, engine, rank, world_size,
                                                                              range(SAVED, SAVED + MORE))
        if hasattr(engine, "destroy"):
            engine.destroy()
    return out


def plant(path: str, marker: str) -> None:
    """A payload in one of DeepSpeed's files (rewritten by torch.save, so its records' crc32s hold)."""
    state = torch.load(path, weights_only=False)
    state["epoch"] = Payload(marker)
    torch.save(state, path)


def flip_record(path: str) -> None:
    """Flips a byte inside the largest tensor record of a torch.save zip."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        flip(path, info.header_offset + 30 + name_len + extra_len + info.file_size // 2)


OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
# case -> (damage to a copy of DeepSpeed's TAG directory, words the error must hold)
DAMAGE = {
    "data_byte": (lambda d: flip_record(os.path.join(d, OPTIM1)), [OPTIM1, "crc32", "corrupt"]),
    "truncated": (lambda d: os.truncate(os.path.join(d, OPTIM1), os.path.getsize(os.path.join(d, OPTIM1)) // 2),
                  [OPTIM1, "unreadable"]),
    "empty": (lambda d: os.truncate(os.path.join(d, OPTIM1), 0), [OPTIM1, "unreadable"]),
    "missing_rank": (lambda d: os.remove(os.path.join(d, OPTIM1)), [OPTIM1, "are missing"]),
    "pipeline": (lambda d: open(os.path.join(d, "layer_01-model_00-model_states.pt"), "wb").close(),
                 ["pipeline-parallel"]),
    "moe": (lambda d: open(os.path.join(d, "expert_0_mp_rank_00_model_states.pt"), "wb").close(), ["MoE"]),
    "universal": (lambda d: os.mkdir(os.path.join(d, "zero")), ["universal"]),
    "payload": (None, ["refused", "mkdir"]),  # made in the worker: the marker's path
}


def damage_worker(rank: int, world_size: int, root: str) -> None:
    """zero on 2 ranks refuses each damaged copy of DeepSpeed's checkpoint
    alike on every rank, its state unchanged, then loads the good one."""
    script = start(rank, world_size, "zero")
    save.BARRIER_TIMEOUT_S = TIMEOUT_S
    for stage in (2, 3):
        good = path(os.path.join(root, "deepspeed"), stage, "fp32")
        engine = new_engine(script, stage)
        train(script, engine, rank, world_size, range(1))
        for case, (damage, words) in DAMAGE.items():
            damaged, marker = os.path.join(root, f"damaged-{stage}-{case}"), os.path.join(root, f"ran-{stage}-{case}")
            if rank == 0:
                shutil.copytree(good, damaged)
                tag = os.path.join(damaged, f"global_step{SAVED}")
                damage(tag) if damage else plant(os.path.join(tag, "mp_rank_00_model_states.pt" if stage < 3 else
                                                                "zero_pp_rank_0_mp_rank_00_model_states.pt"), marker)
            dist.barrier()
            expect_refusal(engine, rank, damaged, words, f"stage {stage} {case}")
            assert not os.path.exists(marker), f"rank {rank} stage {stage}: the payload ran"
        engine.load_checkpoint(good)
        assert engine.global_steps == SAVED
        engine.destroy()


def plain_torch(saved: int, world_size: int) -> dict[str, list[float]]:
    """SAVED steps on `saved` ranks' global batches, then MORE on `world_size` ranks'."""
    from deepspeed_cpu import import_deepspeed

    script = load_script("zero")
    import_deepspeed()
    from deepspeed.runtime.lr_schedules import WarmupLR

    torch.manual_seed(0)
    model = script.GPT()
    config = script.config(1, "fp32")
    adam, warmup = config["optimizer"]["params"], config["scheduler"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=adam["lr"], betas=adam["betas"], weight_decay=adam["weight_decay"])
    scheduler = WarmupLR(opt, **warmup)
    out = {"loss": [], "grad_norm": []}
    for step in range(SAVED + MORE):
        ranks = saved if step < SAVED else world_size
        batches = [script.batch(step, micro, rank) for micro in range(script.ACCUMULATION) for rank in range(ranks)]
        opt.zero_grad()
        losses = [model(x, y) for x, y in batches]
        loss = sum(losses) / len(losses)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
        opt.step()
        scheduler.step()
        out["loss"].append(float(loss.detach()))
        out["grad_norm"].append(float(norm))
    return {k: v[SAVED:] for k, v in out.items()}


def assert_close(got: dict, want: dict, case: str, dtype: str = "fp32") -> None:
    for key, tolerance in RTOL[dtype].items():
        assert all(math.isclose(a, b, rel_tol=tolerance) for a, b in zip(got[key], want[key], strict=True)), \
            f"{case}: {key} {got[key]} != {want[key]}"


SIZES = {2: (1, 3), 3: (2,)}  # the world sizes saved on, and those each is resharded to


def interop(root: str, world_size: int) -> dict:
    """Both engines save on `world_size` ranks and continue; each resumes the
    other's checkpoint (zero also on the SIZES it is resharded to)."""
    from zero.checkpoint import to_deepspeed

    env = {"DS_ACCELERATOR": "cpu"}
    out = {name: run_ranks(save_worker, world_size, name, root, timeout=300, env=env)[0]
           for name in ("zero", "deepspeed")}
    for stage, dtype in kinds(world_size):
        to_deepspeed.convert(path(os.path.join(root, "zero"), stage, dtype), path(os.path.join(root, "zero2ds"),
                                                                                  stage, dtype))
    out["zero2ds"] = run_ranks(resume_worker, world_size, "deepspeed", os.path.join(root, "zero2ds"), world_size,
                               timeout=300, env=env)[0]
    for size in (world_size, *SIZES[world_size]):
        out[f"ds2zero{size}"] = run_ranks(resume_worker, size, "zero", os.path.join(root, "deepspeed"), world_size,
                                          timeout=300, env=env)[0]
    out["fp32"] = fp32_outputs(root)
    if world_size == 2:
        run_ranks(damage_worker, 2, root, timeout=300, env=env)
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory(prefix="zero-interop-") as root:
        yield {size: interop(os.path.join(root, f"w{size}"), size) for size in SIZES}


def fp32_outputs(root: str) -> dict:
    """Per stage: zero's to_fp32 of its checkpoint, DeepSpeed's consolidation of
    the converted one, and (stage 3) DeepSpeed's zero_to_fp32.py script's."""
    from deepspeed_cpu import import_deepspeed

    from zero.checkpoint import to_fp32

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = {}
    for stage in STAGES:
        ours = to_fp32.convert(path(os.path.join(root, "zero"), stage, "fp32"), os.path.join(root, f"fp32_{stage}.pt"))
        converted = path(os.path.join(root, "zero2ds"), stage, "fp32")
        out[stage] = (torch.load(ours), get_fp32_state_dict_from_zero_checkpoint(converted))
    # the script itself, as a pipeline loads it from beside the checkpoint (its command line also wants
    # huggingface_hub, which DeepSpeed does not install)
    converted = path(os.path.join(root, "zero2ds"), 3, "fp32")
    spec = importlib.util.spec_from_file_location("zero_to_fp32_beside", os.path.join(converted, "zero_to_fp32.py"))
    beside = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(beside)
    out["script"] = beside.get_fp32_state_dict_from_zero_checkpoint(converted)
    return out


CASES = [(size, stage, dtype) for size in SIZES for stage, dtype in kinds(size)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size, stage, dtype", CASES)
def test_zero_checkpoint_continues_on_deepspeed(runs, world_size: int, stage: int, dtype: str) -> None:
    run = runs[world_size]
    assert_close(run["zero2ds"][stage, dtype], run["zero"][stage, dtype],
                 f"{world_size} ranks, stage {stage} {dtype}: DeepSpeed resuming zero's", dtype)


@pytest.mark.parametrize("world_size, stage", [(size, stage) for size in SIZES for stage in STAGES])
def test_deepspeed_consolidates_zero_checkpoint(runs, world_size: int, stage: int) -> None:
    """The same names (DeepSpeed lists the tied name last, zero beside its first) and the same values."""
    ours, theirs = runs[world_size]["fp32"][stage]
    assert sorted(ours) == sorted(theirs), f"stage {stage}: keys {sorted(ours)} != {sorted(theirs)}"
    for key, value in ours.items():
        assert torch.equal(value, theirs[key].to(value.dtype)), f"stage {stage}: {key} differs"
    if stage == 3:
        script = runs[world_size]["fp32"]["script"]
        assert all(torch.equal(value, script[key]) for key, value in ours.items()), "zero_to_fp32.py's output"


@pytest.mark.parametrize("world_size, stage, dtype", CASES)
def test_zero_resumes_deepspeed_checkpoint(runs, world_size: int, stage: int, dtype: str) -> None:
    run = runs[world_size]
    assert_close(run[f"ds2zero{world_size}"][stage, dtype], run["deepspeed"][stage, dtype],
                 f"{world_size} ranks, stage {stage} {dtype}: zero resuming DeepSpeed's", dtype)


def test_zero_resumes_deepspeed_checkpoint_offloaded(runs) -> None:
    """Stage 3 with the optimizer states offloaded to the host (zero's offload path)."""
    assert_close(runs[2]["ds2zero2"][3, "fp32", "offload"], runs[2]["deepspeed"][3, "fp32"],
                 "stage 3, offloaded: zero resuming DeepSpeed's")


def test_damaged_deepspeed_checkpoints_change_nothing(runs) -> None:
    """Checked in the fixture (damage_worker): it raises on any failure."""
    assert runs[2]["zero2ds"], "the fixture ran"


@pytest.mark.parametrize("saved, world_size", [(saved, size) for saved, sizes in SIZES.items() for size in sizes])
def test_zero_reshards_deepspeed_checkpoint(runs, saved: int, world_size: int) -> None:
    assert_close(plain_torch(saved, saved), runs[saved]["deepspeed"][1, "fp32"],
                 "plain torch (the reference) against DeepSpeed")
    want = plain_torch(saved, world_size)
    for stage in STAGES:
        assert_close(runs[saved][f"ds2zero{world_size}"][stage, "fp32"], want,
                     f"stage {stage}: zero on {world_size} rank(s) resuming DeepSpeed's from {saved}")

