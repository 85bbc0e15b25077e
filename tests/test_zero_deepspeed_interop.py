"""A training run moves between DeepSpeed (0.19.8 on the CPU) and zero, both
ways, at stages 1-3, with the DeepSpeed user's script of tests/dropin_script.py
(a small GPT with tied embeddings, AdamW + WarmupLR, clipping, accumulation 2),
with each optimizer DeepSpeed builds for its AdamW (OPTIMIZERS: torch's with
torch_adam, by default FusedAdam, with offload_optimizer DeepSpeedCPUAdam),
whose states DeepSpeed saves in its own layout:

- zero -> DeepSpeed: zero saves after SAVED steps and continues; its
  checkpoint, written in DeepSpeed's layout (python -m zero.to_deepspeed),
  continues on DeepSpeed with the same losses and grad norms, and DeepSpeed's
  get_fp32_state_dict_from_zero_checkpoint (and the zero_to_fp32.py beside it)
  gives exactly zero's own to_fp32 output;
- DeepSpeed -> zero: DeepSpeed saves and continues; zero resumes its
  checkpoint on the same ranks with DeepSpeed's losses, and on 1 and 3
  ranks (resharded) with the losses of plain PyTorch continuing from the same
  state (its own SAVED steps, DeepSpeed's WarmupLR on torch's AdamW);
- zero -> zero: zero's checkpoint in DeepSpeed's layout resumes on zero as if
  never saved. No DeepSpeed engine takes part, so this runs in every dtype on
  any CPU: where DeepSpeed refuses fp16, it is what tests zero's fp16 side of
  the layout (the loss scale included).
Each step reports the mean loss over every micro-batch of every rank and the
global grad norm. Each (world size, dtype) saved has its own module fixtures:
DeepSpeed's (`runs`) is skipped where its CPU accelerator refuses the dtype
(deepspeed_cpu.refusal), and skips only that dtype's cases. The optimizers of
SWEPT are looped over inside each spawn (the torch one elsewhere), and each
test checks every optimizer its kind ran."""
from __future__ import annotations

import functools
import importlib.util
import json
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
from deepspeed_cpu import DTYPES, build_failure, refusal, skip_unless_accepted
from harness import run_ranks
from test_zero_checkpoint_safety import TIMEOUT_S, Payload, expect_refusal, flip
from test_zero_dropin import load_script

import zero_reference  # noqa: F401  (puts the repo root on sys.path)
from zero.checkpoint import deepspeed_optim
from zero.checkpoint.parts import CheckpointOptions

STAGES, SAVED, MORE = (1, 2, 3), 3, 3
# fp32: both engines sum the same gradients in other orders: 1e-5 relative. bf16: their gradients
# differ by bf16 ulps (tests/test_zero_dropin.py's tolerances, measured there): 2e-3 and 1e-3 relative.
# fp16 (more mantissa than bf16) gets bf16's bounds; its dynamic loss scale must move with the checkpoint.
RTOL = {"fp32": {"loss": 1e-5, "grad_norm": 1e-5}, "bf16": {"loss": 2e-3, "grad_norm": 1e-3},
        "fp16": {"loss": 2e-3, "grad_norm": 1e-3, "loss_scale": 0}}
# (world size, dtype) of each pair of runs saved; the half types on 2 ranks only
SAVED_ON = [(2, "fp32"), (3, "fp32"), (2, "bf16"), (2, "fp16")]
FP32_SAVED_ON = [(size, dtype) for size, dtype in SAVED_ON if dtype == "fp32"]
SIZES = {2: (1, 3), 3: (2,)}  # the world sizes saved on, and those each is resharded to
# the optimizer DeepSpeed builds for the script's AdamW: with torch_adam (the script's), DeepSpeed's
# default, with offload_optimizer on cpu; and the kinds that run all three (the others run TORCH)
TORCH, FUSED, CPU_ADAM = "torch.optim.AdamW", "FusedAdam", "DeepSpeedCPUAdam"
OPTIMIZERS = (TORCH, FUSED, CPU_ADAM)
SWEPT = {(2, "fp32")}
OPS = {FUSED: "FusedAdamBuilder", CPU_ADAM: "CPUAdamBuilder"}  # DeepSpeed's JIT-built CPU op of each
ENV = {"DS_ACCELERATOR": "cpu"}
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed not installed (test extra)"),
              # the first test of each (world size, dtype) runs its fixtures: w2-fp32's, with DeepSpeed's two
              # CPU ops built cold, took 800 s in a CI run with -n 4 on 2 cores
              pytest.mark.timeout(1500)]


def saved_on(kinds: list[tuple[int, str]]):
    """Parametrizes a test by the (world size, dtype) saved: module-scoped, so
    each kind's fixtures run once, and pytest groups the tests by kind."""
    return pytest.mark.parametrize("saved", kinds, ids=[f"w{size}-{dtype}" for size, dtype in kinds], scope="module")


by_stage = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{stage}" for stage in STAGES])


def optimizers(saved: tuple[int, str]) -> tuple[str, ...]:
    return OPTIMIZERS if saved in SWEPT else (TORCH,)


def skip_unless_built(names: tuple[str, ...]) -> None:
    """DeepSpeed's optimizers other than torch's need their CPU op: built here, once, before the ranks start."""
    reason = build_failure(tuple(OPS[name] for name in names if name in OPS))
    if reason is not None:
        pytest.skip(reason)


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


def new_engine(script, stage: int, dtype: str = "fp32", offload: bool = False, scale_power: int = 8,
               optimizer: str = TORCH):
    """The script's engine; `optimizer`: the one DeepSpeed builds from its config (zero runs torch's AdamW)."""
    torch.manual_seed(0)
    model = script.GPT()
    config = script.config(stage, "fp32" if dtype == "fp16" else dtype)
    if dtype == "fp16":  # dynamic loss scaling (no overflow in these runs)
        config["fp16"] = {"enabled": True, "initial_scale_power": scale_power}
    if optimizer != TORCH:
        del config["optimizer"]["params"]["torch_adam"]
    if offload or optimizer == CPU_ADAM:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = script.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def path(root: str, stage: int, optimizer: str = TORCH) -> str:
    return os.path.join(root, optimizer, f"s{stage}")


def start(rank: int, world_size: int, engine: str):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    warnings.simplefilter("ignore")
    script = load_script(engine)
    if engine == "deepspeed":  # each DeepSpeedCPUAdam asks py-cpuinfo (1.3 s of subprocesses): once per rank
        import cpuinfo

        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    script.deepspeed.init_distributed(dist_backend="gloo")
    return script


def save_worker(rank: int, world_size: int, engine_name: str, root: str, dtype: str, names: tuple[str, ...]) -> dict:
    """Per optimizer and stage: SAVED steps, save (root/NAME/OPTIMIZER/sS), MORE
    steps: the continued run's losses, by (optimizer, stage)."""
    script, out = start(rank, world_size, engine_name), {}
    for optimizer, stage in [(optimizer, stage) for optimizer in names for stage in STAGES]:
        engine = new_engine(script, stage, dtype, optimizer=optimizer)
        train(script, engine, rank, world_size, range(SAVED))
        engine.save_checkpoint(path(os.path.join(root, engine_name), stage, optimizer))
        out[optimizer, stage] = train(script, engine, rank, world_size, range(SAVED, SAVED + MORE))
        out[optimizer, stage]["optimizer"] = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
        if hasattr(engine, "destroy"):
            engine.destroy()
    return out


def resume_worker(rank: int, world_size: int, engine_name: str, directory: str, dtype: str, names: tuple[str, ...],
                  offload: bool = False) -> dict:
    """Resumes each optimizer's and stage's checkpoint in `directory` on
    `engine_name`, configured for that optimizer, and trains MORE steps; with
    `offload` also stage 3 with the optimizer offloaded (torch's AdamW)."""
    script, out = start(rank, world_size, engine_name), {}
    cases = [(optimizer, stage, False) for optimizer in names for stage in STAGES] + ([(TORCH, 3, True)] * offload)
    for optimizer, stage, offloaded in cases:
        engine = new_engine(script, stage, dtype, offloaded, scale_power=12,  # the saved scale (2**8) must win
                            optimizer=optimizer)
        engine.load_checkpoint(path(directory, stage, optimizer))
        assert engine.global_steps == SAVED, (engine_name, optimizer, stage, engine.global_steps)
        out[(optimizer, stage, "offload") if offloaded else (optimizer, stage)] = train(
            script, engine, rank, world_size, range(SAVED, SAVED + MORE))
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


def rewrite_optimizer(tag: str, config, group, state) -> None:
    """DeepSpeed's checkpoint in `tag` rewritten by `config` (its ds_config, in place), `group`
    (each param group) and `state` (each flat group's optimizer state)."""
    for name in os.listdir(tag):
        file = os.path.join(tag, name)
        saved = torch.load(file, weights_only=False)
        if name.endswith("_model_states.pt"):
            config(saved["ds_config"])
        else:
            osd = saved["optimizer_state_dict"]
            base = osd["optimizer_state_dict" if "fp32_flat_groups" in osd else "base_optimizer_state"]
            base["param_groups"] = [group(dict(g)) for g in base["param_groups"]]
            base["state"] = {k: state(dict(v)) for k, v in base["state"].items()}
        torch.save(saved, file)


def as_cpu_adagrad(tag: str) -> None:
    """DeepSpeedCPUAdagrad's checkpoint (its layout: deepspeed/ops/adagrad/cpu_adagrad.py), which zero does not map."""
    def config(c: dict) -> None:
        c["optimizer"] = {"type": "Adagrad", "params": {"lr": 1e-3}}
        c["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    rewrite_optimizer(tag, config, lambda g: {"lr": g["lr"], "eps": g["eps"], "weight_decay": g["weight_decay"],
                                              "amsgrad": False, "params": g["params"]},
                      lambda s: {"step": s["step"], "exp_avg_sq": s["exp_avg_sq"]})


# case -> (damage to a copy of DeepSpeed's FusedAdam checkpoint, words the error must hold)
OPTIMIZER_DAMAGE = {
    "cpu_adagrad": (as_cpu_adagrad, ["optimizer states of DeepSpeedCPUAdagrad", "zero maps those of torch.optim's"]),
    "bias_correction_off": (lambda d: rewrite_optimizer(d, lambda c: None, lambda g: g | {"bias_correction": False},
                                                        lambda s: s), ["FusedAdam with {'bias_correction': False}"]),
    "torch_states": (lambda d: rewrite_optimizer(d, lambda c: None, lambda g: g | {"foreach": None}, lambda s: s),
                     ["FusedAdam's param group 0 holds", "not FusedAdam's states"]),
}


def damage_worker(rank: int, world_size: int, root: str) -> None:
    """zero on 2 ranks refuses each damaged copy of DeepSpeed's checkpoint
    alike on every rank, its state unchanged, then loads the good one."""
    script = start(rank, world_size, "zero")
    cases = [(TORCH, *case) for case in DAMAGE.items()] + [(FUSED, *case) for case in OPTIMIZER_DAMAGE.items()]
    for stage in (2, 3):
        good = path(os.path.join(root, "deepspeed"), stage)
        engine = new_engine(script, stage)
        engine.checkpoint_options = CheckpointOptions(timeout_s=TIMEOUT_S)
        train(script, engine, rank, world_size, range(1))
        for optimizer, case, (damage, words) in cases:
            damaged, marker = os.path.join(root, f"damaged-{stage}-{case}"), os.path.join(root, f"ran-{stage}-{case}")
            if rank == 0:
                shutil.copytree(path(os.path.join(root, "deepspeed"), stage, optimizer), damaged)
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


@pytest.fixture(scope="module")
def root():
    with tempfile.TemporaryDirectory(prefix="zero-interop-") as directory:
        yield directory


@pytest.fixture(scope="module")
def zero_runs(saved: tuple[int, str], root: str) -> dict:
    """zero's side of one (world size, dtype), with no DeepSpeed engine: zero saves
    after SAVED steps and continues (ROOT/zero), and its checkpoints are written in
    DeepSpeed's layout (ROOT/zero2ds)."""
    from zero.checkpoint import to_deepspeed

    world_size, dtype = saved
    base, names = os.path.join(root, f"w{world_size}-{dtype}"), optimizers(saved)
    out = {"root": base,
           "zero": run_ranks(save_worker, world_size, "zero", base, dtype, names, timeout=300, env=ENV)[0]}
    for optimizer in names:  # in the layout of the optimizer DeepSpeed builds from the config zero ran with
        for stage in STAGES:
            to_deepspeed.convert(path(os.path.join(base, "zero"), stage, optimizer),
                                 path(os.path.join(base, "zero2ds"), stage, optimizer))
    return out


@pytest.fixture(scope="module")
def runs(request, saved: tuple[int, str]) -> dict:
    """Both engines on one (world size, dtype), skipped where DeepSpeed refuses the
    dtype on this CPU: zero's side, DeepSpeed saving and continuing (ROOT/deepspeed),
    DeepSpeed resuming zero's converted checkpoints, and zero resuming DeepSpeed's
    on the same ranks (also stage 3 offloaded, in fp32) and, in fp32, on those of SIZES."""
    world_size, dtype = saved
    skip_unless_accepted(dtype)
    names = optimizers(saved)
    skip_unless_built(names)
    out = dict(request.getfixturevalue("zero_runs"))
    base = out["root"]
    out["deepspeed"] = run_ranks(save_worker, world_size, "deepspeed", base, dtype, names, timeout=300, env=ENV)[0]
    out["zero2ds"] = run_ranks(resume_worker, world_size, "deepspeed", os.path.join(base, "zero2ds"), dtype, names,
                               timeout=300, env=ENV)[0]
    # resharded (torch's AdamW): fp32 only, which test_zero_reshards_deepspeed_checkpoint checks
    for size in (world_size, *(SIZES[world_size] if dtype == "fp32" else ())):
        offload = size == world_size and dtype == "fp32"
        out[f"ds2zero{size}"] = run_ranks(resume_worker, size, "zero", os.path.join(base, "deepspeed"), dtype,
                                          names if size == world_size else (TORCH,), offload,
                                          timeout=300, env=ENV)[0]
    return out


@pytest.fixture(scope="module")
def zero_resumes_converted(saved: tuple[int, str], zero_runs: dict) -> dict:
    """zero resuming its own checkpoints written in DeepSpeed's layout, on the ranks that saved them."""
    world_size, dtype = saved
    return run_ranks(resume_worker, world_size, "zero", os.path.join(zero_runs["root"], "zero2ds"), dtype,
                     optimizers(saved), timeout=300, env=ENV)[0]


@pytest.fixture(scope="module")
def consolidated(zero_runs: dict) -> dict:
    return fp32_outputs(zero_runs["root"])


def fp32_outputs(root: str) -> dict:
    """Per stage: zero's to_fp32 of its checkpoint, DeepSpeed's consolidation of
    the converted one, and (stage 3) DeepSpeed's zero_to_fp32.py script's."""
    from deepspeed_cpu import import_deepspeed

    from zero.checkpoint import to_fp32

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = {}
    for stage in STAGES:  # torch's AdamW (the weights do not depend on the optimizer's layout)
        ours = to_fp32.convert(path(os.path.join(root, "zero"), stage), os.path.join(root, f"fp32_{stage}.pt"))
        converted = path(os.path.join(root, "zero2ds"), stage)
        out[stage] = (torch.load(ours), get_fp32_state_dict_from_zero_checkpoint(converted))
    # the script itself, as a pipeline loads it from beside the checkpoint (its command line also wants
    # huggingface_hub, which DeepSpeed does not install)
    converted = path(os.path.join(root, "zero2ds"), 3)
    spec = importlib.util.spec_from_file_location("zero_to_fp32_beside", os.path.join(converted, "zero_to_fp32.py"))
    beside = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(beside)
    out["script"] = beside.get_fp32_state_dict_from_zero_checkpoint(converted)
    return out


@pytest.mark.slow
@saved_on(SAVED_ON)
@by_stage
def test_zero_checkpoint_continues_on_deepspeed(runs, saved: tuple[int, str], stage: int) -> None:
    """DeepSpeed, configured for each optimizer, resumes zero's checkpoint converted with the config zero ran with."""
    world_size, dtype = saved
    for optimizer in optimizers(saved):
        assert_close(runs["zero2ds"][optimizer, stage], runs["zero"][optimizer, stage],
                     f"{world_size} ranks, stage {stage} {dtype}, {optimizer}: DeepSpeed resuming zero's", dtype)


@pytest.mark.slow
@saved_on(sorted(SWEPT))
@by_stage
def test_zero_writes_deepspeed_optimizer_layouts(runs, saved: tuple[int, str], stage: int) -> None:
    """zero's conversion holds each optimizer's states as DeepSpeed's own save of it does: the
    same param-group keys in the same order, the same kinds of values, the same state keys.
    torch's AdamW only by keys: its load_state_dict takes them in any order, and zero's run
    chose torch's fused kernel (`fused`), which DeepSpeed's then runs too."""
    def layout(directory: str, exact: bool) -> list:
        osd = torch.load(os.path.join(directory, f"global_step{SAVED}", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                         weights_only=False)["optimizer_state_dict"]
        base = osd["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
        groups = [[(k, type(v).__name__) for k, v in g.items()] for g in base["param_groups"]]
        states = [[(k, type(v).__name__, getattr(v, "dtype", None)) for k, v in state.items()]
                  for state in base["state"].values()]
        return groups + states if exact else [sorted(k for k, *_ in keys) for keys in groups + states]

    from zero.checkpoint import to_deepspeed

    root, script = runs["root"], load_script("zero")
    for optimizer in optimizers(saved):
        ours = layout(path(os.path.join(root, "zero2ds"), stage, optimizer), optimizer != TORCH)
        theirs = layout(path(os.path.join(root, "deepspeed"), stage, optimizer), optimizer != TORCH)
        assert ours == theirs, f"stage {stage}, {optimizer}: zero writes {ours}, DeepSpeed saves {theirs}"
    # zero's run with torch_adam, converted for the config DeepSpeed resumes with (--ds-config), or its optimizer
    ran_torch = path(os.path.join(root, "zero"), stage)
    config = script.config(stage, "fp32")
    del config["optimizer"]["params"]["torch_adam"]
    config_file = os.path.join(root, f"ds_config_{stage}.json")
    with open(config_file, "w") as f:
        json.dump(config, f)
    to_deepspeed.main([ran_torch, os.path.join(root, f"for_config_{stage}"), "--ds-config", config_file])
    to_deepspeed.convert(ran_torch, os.path.join(root, f"for_cpu_adam_{stage}"), optimizer=CPU_ADAM)
    for optimizer, converted in ((FUSED, f"for_config_{stage}"), (CPU_ADAM, f"for_cpu_adam_{stage}")):
        ours = layout(os.path.join(root, converted), True)
        theirs = layout(path(os.path.join(root, "deepspeed"), stage, optimizer), True)
        assert ours == theirs, f"stage {stage}, torch_adam run for {optimizer}: zero writes {ours}, DeepSpeed {theirs}"


@pytest.mark.slow
@saved_on([(2, dtype) for dtype in DTYPES])
@by_stage
def test_zero_resumes_its_checkpoint_in_deepspeed_layout(zero_runs, zero_resumes_converted, saved: tuple[int, str],
                                                         stage: int) -> None:
    """Exactly the run that did not stop: the same engine, ranks and batches, every
    state (fp32 masters, Adam's moments, the loss scale, which must beat the
    resumed config's 2**12) carried through DeepSpeed's layout bit for bit."""
    world_size, dtype = saved
    for optimizer in optimizers(saved):
        got, want = zero_resumes_converted[optimizer, stage], zero_runs["zero"][optimizer, stage]
        case = f"{world_size} ranks, stage {stage} {dtype}, {optimizer}: zero resuming its own in DeepSpeed's layout"
        for key in ("loss", "grad_norm", "loss_scale"):
            assert got[key] == want[key], f"{case}: {key} {got[key]} != {want[key]} (not stopped)"


@pytest.mark.slow
@saved_on(FP32_SAVED_ON)
@by_stage
def test_deepspeed_consolidates_zero_checkpoint(consolidated, saved: tuple[int, str], stage: int) -> None:
    """The same names (DeepSpeed lists the tied name last, zero beside its first) and the same values."""
    world_size = saved[0]
    ours, theirs = consolidated[stage]
    case = f"{world_size} ranks, stage {stage}"
    assert sorted(ours) == sorted(theirs), f"{case}: keys {sorted(ours)} != {sorted(theirs)}"
    for key, value in ours.items():
        assert torch.equal(value, theirs[key].to(value.dtype)), f"{case}: {key} differs"
    if stage == 3:
        script = consolidated["script"]
        assert all(torch.equal(value, script[key]) for key, value in ours.items()), f"{case}: zero_to_fp32.py's output"


@pytest.mark.slow
@saved_on(SAVED_ON)
@by_stage
def test_zero_resumes_deepspeed_checkpoint(runs, saved: tuple[int, str], stage: int) -> None:
    """zero resumes DeepSpeed's checkpoint, saved by each optimizer, with DeepSpeed's own continued run's losses."""
    world_size, dtype = saved
    for optimizer in optimizers(saved):
        built = runs["deepspeed"][optimizer, stage]["optimizer"]
        assert built == optimizer.rsplit(".", 1)[-1], f"stage {stage}: DeepSpeed built {built}, not {optimizer}"
        assert_close(runs[f"ds2zero{world_size}"][optimizer, stage], runs["deepspeed"][optimizer, stage],
                     f"{world_size} ranks, stage {stage} {dtype}, {optimizer}: zero resuming DeepSpeed's", dtype)


@pytest.mark.slow
@saved_on([(2, "fp32")])
def test_zero_resumes_deepspeed_checkpoint_offloaded(runs) -> None:
    """Stage 3 with the optimizer states offloaded to the host (zero's offload path)."""
    assert_close(runs["ds2zero2"][TORCH, 3, "offload"], runs["deepspeed"][TORCH, 3],
                 "stage 3, offloaded: zero resuming DeepSpeed's")


@pytest.mark.slow
@saved_on([(2, "fp32")])
def test_damaged_deepspeed_checkpoints_change_nothing(runs) -> None:
    """zero refuses every damaged copy of DeepSpeed's checkpoint alike on each rank (damage_worker)."""
    run_ranks(damage_worker, 2, runs["root"], timeout=300, env=ENV)


@pytest.mark.slow
@saved_on(FP32_SAVED_ON)
def test_zero_reshards_deepspeed_checkpoint(runs, saved: tuple[int, str]) -> None:
    """DeepSpeed's checkpoint resumed on zero with other world sizes (SIZES)."""
    saved_size = saved[0]
    assert_close(plain_torch(saved_size, saved_size), runs["deepspeed"][TORCH, 1],
                 f"{saved_size} ranks: plain torch (the reference) against DeepSpeed")
    for world_size in SIZES[saved_size]:
        want = plain_torch(saved_size, world_size)
        for stage in STAGES:
            assert_close(runs[f"ds2zero{world_size}"][TORCH, stage], want,
                         f"stage {stage}: zero on {world_size} rank(s) resuming DeepSpeed's from {saved_size}")


def test_deepspeed_refusals_are_asked_of_deepspeed() -> None:
    """The one answer the module's skips rest on: fp32 is never refused, a half type is refused
    exactly where DeepSpeed's CPU accelerator says it is unsupported, and the reason names it."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    assert refusal("fp32") is None
    for dtype, supported in (("fp16", bool(accelerator.is_fp16_supported())), ("bf16", bool(accelerator.is_bf16_supported()))):
        reason = refusal(dtype)
        assert (reason is None) == supported, f"{dtype}: supported={supported}, refusal={reason!r}"
        assert reason is None or f"refuses {dtype}" in reason, reason
    with pytest.raises(ValueError, match="'fp8'"):
        refusal("fp8")


def test_unmapped_optimizer_layouts_are_named() -> None:
    """Optimizer states zero does not map, read or to be written, are a ValueError naming
    their optimizer (zero/checkpoint/deepspeed_optim.py), never a KeyError later."""
    where, exp_avg = "ckpt", torch.zeros(4)
    adagrad = {"lr": 1e-3, "eps": 1e-10, "weight_decay": 0.0, "amsgrad": False, "params": [0]}  # DeepSpeedCPUAdagrad's
    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    read = [  # (config, param groups, flat-group states, words)
        ({"optimizer": {"type": "Adagrad"}, **offload}, [adagrad], [{"step": 3, "exp_avg_sq": exp_avg}],
         ["optimizer states of DeepSpeedCPUAdagrad"]),
        ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, [{"lr": 1e-4, "betas": (0.9, 0.99),
                                                                    "weight_decay": 0.0, "params": [0]}],
         [{"exp_avg": exp_avg}], ["optimizer states of FusedLion"]),
        (None, [{"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0, "params": [0]}], [{"exp_avg": exp_avg}],
         ["param-group keys ['betas', 'lr', 'weight_decay']", "no 'optimizer'"]),
        ({"optimizer": {"type": "AdamW"}}, [{"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999),
                                             "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 10.0, "params": [0]}],
         [{}], ["FusedAdam's param group 0 holds"]),
    ]
    for config, groups, states, words in read:
        with pytest.raises(ValueError) as caught:
            deepspeed_optim.saved_optimizer(config, groups, states, where)
        assert all(w in str(caught.value) for w in words), f"{config}: {words} not all in {caught.value}"
    fused = {"lr": 1e-3, "bias_correction": False, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "step": 0}
    with pytest.raises(ValueError, match="FusedAdam with {'bias_correction': False}"):
        deepspeed_optim.read_group("FusedAdam", fused, where)
    # torch's Adagrad (DeepSpeed's Adagrad without offload) is torch's layout, which zero's AdamW cannot take
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    adagrad_torch = torch.optim.Adagrad([param])
    adagrad_torch.step()
    saved = adagrad_torch.state_dict()
    name = deepspeed_optim.saved_optimizer({"optimizer": {"type": "Adagrad"}}, saved["param_groups"],
                                           list(saved["state"].values()), where)
    with pytest.raises(ValueError, match=r"optimizer states of torch.optim.Adagrad \(\['step', 'sum'\]\); this "
                                         r"engine's AdamW keeps other states"):
        deepspeed_optim.check_resumes(torch.optim.AdamW([param]), name, set(saved["state"][0]), where)
    # written: zero's SGD, or AdamW with amsgrad, in DeepSpeed's Adam layouts; an optimizer zero does not write
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9).state_dict()["param_groups"][0]
    with pytest.raises(ValueError, match="has no FusedAdam layout"):
        deepspeed_optim.write_group("FusedAdam", sgd, where)
    amsgrad = torch.optim.AdamW([param], amsgrad=True)
    amsgrad.step()
    with pytest.raises(ValueError, match="have no DeepSpeedCPUAdam layout"):
        deepspeed_optim.write_state("DeepSpeedCPUAdam", amsgrad.state_dict()["state"][0], where)
    with pytest.raises(ValueError, match="'FusedLion'"):
        deepspeed_optim.check_target("FusedLion")
