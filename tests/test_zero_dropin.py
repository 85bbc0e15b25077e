"""The DeepSpeed drop-in: tests/dropin_script.py runs on DeepSpeed and, with only
its import changed to `import zero as deepspeed`, on zero (2 CPU ranks); the
learning rates, losses, gradient norms and every surface call's return value
must agree. Each dtype's runs are a module fixture of their own, skipped where
DeepSpeed refuses the dtype on this CPU. Also: the global gradient norm is exact
where an fp32 sum is not."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import types

import pytest
import torch
from deepspeed_cpu import skip_unless_accepted
from harness import run_ranks

import zero_reference  # noqa: F401  (puts the repo root on sys.path)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dropin_script.py")
NUM_STEPS = 20
STAGES, DTYPES = (1, 2, 3), ("fp32", "bf16")
RESUME_STAGES = (1, 2, 3)  # resumed in fp32
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed not installed (test extra)")


def load_script(engine: str) -> types.ModuleType:
    """The user's script, its first import line swapped for zero's (the only change)."""
    source = open(SCRIPT).read()
    if engine == "zero":
        assert source.count("\nimport deepspeed\n") == 1, "the script must import deepspeed once"
        source = source.replace("\nimport deepspeed\n", "\nimport zero as deepspeed\n")
    else:
        from deepspeed_cpu import import_deepspeed

        import_deepspeed()
    module = types.ModuleType(f"dropin_script_{engine}")
    exec(compile(source, SCRIPT, "exec"), module.__dict__)
    return module


def script_worker(rank: int, world_size: int, engine: str, dtype: str) -> dict:
    """The script's calls in `dtype`: training per stage and the engine's surfaces;
    in fp32 also the calls outside an engine and the resumes."""
    import warnings

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))  # what a launcher sets
    warnings.simplefilter("ignore")  # zero's notes on keys it does not act on, DeepSpeed's deprecations
    script = load_script(engine)
    script.deepspeed.init_distributed(dist_backend="gloo")
    out = {"engines": script.engine_surfaces(dtype)}
    if dtype == "fp32":
        out["surface"] = script.surface()
    for stage in STAGES:
        out[stage] = script.train(stage, dtype, NUM_STEPS)
    if dtype == "fp32":
        for stage in RESUME_STAGES:
            out["resume", stage] = script.resume(stage, "fp32", 5, 3)
    return out


@pytest.fixture(scope="module")
def runs(dtype: str) -> dict[str, list[dict]]:
    """Both engines' runs in one dtype (the test's module-scoped parameter)."""
    skip_unless_accepted(dtype)
    env = {"DS_ACCELERATOR": "cpu"}
    return {engine: run_ranks(script_worker, 2, engine, dtype, timeout=400, env=env)
            for engine in ("deepspeed", "zero")}


def by_dtype(dtypes: tuple[str, ...]):
    """Module-scoped, so each dtype's fixture runs once, and pytest groups the tests by dtype."""
    return pytest.mark.parametrize("dtype", dtypes, scope="module")


# fp32: the two engines sum the same gradients in other orders (~1 ulp); the
# losses agree to ~5e-7 (measured) against the 1e-4. A parameter
# element whose gradient is within rounding of zero can still move by up to lr
# per Adam step either way, so the per-tensor sums get lr_max (3e-3).
# bf16: both keep fp32 masters and round the parameters to bf16 after each step;
# the gradients are bf16 (DeepSpeed accumulates and reduces them in bf16, zero
# in bf16 too but in another order), so they differ by bf16 ulps (2^-8
# relative) and the step's parameters by up to one bf16 ulp. Measured: losses
# 7e-4 apart at most over 20 steps (no growth), grad norms 3.5e-4 relative,
# tensor sums 0.17; the bounds below are ~3x those.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-3}
PARAM_TOLERANCE = {"fp32": 3e-3, "bf16": 5e-1}
NORM_TOLERANCE = {"fp32": 1e-6, "bf16": 1e-3}


@needs_deepspeed
@pytest.mark.timeout(480)
@by_dtype(DTYPES)
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_training_matches_deepspeed(runs, stage: int, dtype: str) -> None:
    for rank in range(2):
        want, got = runs["deepspeed"][rank][stage], runs["zero"][rank][stage]
        case = f"rank {rank} stage {stage} {dtype}"
        assert got["lr"] == want["lr"], f"{case}: lr {got['lr']} != DeepSpeed's {want['lr']}"
        loss_gap = max(abs(g - w) for g, w in zip(got["loss"], want["loss"]))
        assert loss_gap <= LOSS_TOLERANCE[dtype], f"{case}: losses {got['loss']} vs DeepSpeed's {want['loss']}"
        norm_gap = max(abs(g - w) / w for g, w in zip(got["grad_norm"], want["grad_norm"]))
        assert norm_gap <= NORM_TOLERANCE[dtype], f"{case}: grad norms {got['grad_norm']} vs {want['grad_norm']}"
        param_gap = max(abs(g - w) for g, w in zip(got["params"], want["params"]))
        assert param_gap <= PARAM_TOLERANCE[dtype], f"{case}: parameter sums differ by {param_gap}"


@needs_deepspeed
@pytest.mark.timeout(480)
@by_dtype(("fp32",))
@pytest.mark.slow
@pytest.mark.parametrize("stage", RESUME_STAGES)
def test_resume_with_another_accumulation_matches_deepspeed(runs, stage: int) -> None:
    """Saved at optimizer step 5 with accumulation 2, resumed with 4 (10
    micro-steps are not a multiple of 4): every resumed step accumulates 4
    micro-batches in both engines, as DeepSpeed restores no micro-step count."""
    for rank in range(2):
        want, got = runs["deepspeed"][rank]["resume", stage], runs["zero"][rank]["resume", stage]
        case = f"rank {rank} stage {stage} resumed with accumulation 4"
        assert got["global_steps"] == want["global_steps"] == 5, f"{case}: {got['global_steps']=} {want['global_steps']=}"
        assert got["lr"] == want["lr"], f"{case}: lr {got['lr']} != DeepSpeed's {want['lr']}"
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), f"{case}: losses {got['loss']} vs {want['loss']}"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), \
            f"{case}: grad norms {got['grad_norm']} vs DeepSpeed's {want['grad_norm']}"


@needs_deepspeed
@pytest.mark.timeout(480)
@by_dtype(DTYPES)
@pytest.mark.slow
def test_engine_surface_matches_deepspeed(runs, dtype: str) -> None:
    """At each stage the script runs in `dtype` (its ENGINE_DTYPES)."""
    for rank in range(2):
        want, got = runs["deepspeed"][rank]["engines"], runs["zero"][rank]["engines"]
        assert want and sorted(got) == sorted(want), f"rank {rank} {dtype}: stages {sorted(got)} != {sorted(want)}"
        for stage in want:
            g, w = dict(got[stage]), dict(want[stage])
            g_params, w_params = g.pop("params"), w.pop("params")
            assert g == w, f"rank {rank} stage {stage}: zero {g} != DeepSpeed {w}"
            tolerance = PARAM_TOLERANCE["bf16" if g["bf16"] else "fp32"]
            assert g_params == pytest.approx(w_params, abs=tolerance), f"rank {rank} stage {stage}: after no_sync"


@needs_deepspeed
@pytest.mark.timeout(480)
@by_dtype(("fp32",))
@pytest.mark.slow
def test_surface_matches_deepspeed(runs) -> None:
    for rank in range(2):
        want, got = runs["deepspeed"][rank]["surface"], runs["zero"][rank]["surface"]
        for key in ("comm", "arguments"):
            assert got[key] == want[key], f"rank {rank} {key}: zero {got[key]} != DeepSpeed {want[key]}"
        g, w = got["init"], want["init"]
        assert g["shapes"] == w["shapes"] and g["ds_shapes"] == w["ds_shapes"], f"rank {rank}: {g} != {w}"
        assert g["built"] == pytest.approx(w["built"], abs=1e-5) and g["modified"] == w["modified"]
        assert g["losses"] == pytest.approx(w["losses"], abs=1e-4), f"rank {rank}: trained after Init"
        assert g["trained"] == pytest.approx(w["trained"], abs=1e-3), f"rank {rank}: parameters after Init"


class Linear(torch.nn.Module):
    """loss = sum_i <p_i, c_i>: the gradient is c, known exactly."""

    def __init__(self, num_params: int, numel: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weights = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(num_params)]
        for i, weight in enumerate(self.weights):  # the root's own: stage 3 gathers them around its forward
            self.register_parameter(f"w{i}", weight)
        # a non-zero mean makes an fp32 running sum drift (~1e-5 relative over millions of terms)
        self.register_buffer("coef", torch.randn(num_params, numel, generator=gen) * 1e-3 + 2e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((w * c).sum() for w, c in zip(self.weights, self.coef)) * x.sum()


def grad_norm_worker(rank: int, world_size: int) -> dict:
    import zero

    out = {}
    for stage in (0, 1, 3):
        model = Linear(40, 65536)  # 2.6 M elements in one bucket
        plain = [torch.nn.Parameter(torch.zeros(65536)) for _ in range(40)]
        for p, c in zip(plain, model.coef):
            p.grad = c.clone()
        exact = model.coef.double().norm().item()
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                        "reduce_bucket_size": 10**8}}
        engine, *_ = zero.initialize(model=model, config=config)
        engine.backward(engine(torch.ones(1)))
        engine.step()
        fp32_shard = torch.linalg.vector_norm(model.coef.reshape(-1).chunk(world_size)[rank]).item()
        out[stage] = (engine.get_global_grad_norm(), torch.nn.utils.clip_grad_norm_(plain, 1e9).item(), exact,
                      fp32_shard, model.coef.reshape(-1).chunk(world_size)[rank].double().norm().item())
    return out


@pytest.mark.timeout(120)
def test_grad_norm_matches_plain_pytorch() -> None:
    for rank, per_stage in enumerate(run_ranks(grad_norm_worker, 2, timeout=100)):
        for stage, (ours, torch_norm, exact, fp32_shard, exact_shard) in per_stage.items():
            case = f"rank {rank} stage {stage}"
            assert abs(fp32_shard / exact_shard - 1) > 2e-6, f"{case}: the case does not show an fp32 sum's drift"
            assert abs(ours / exact - 1) < 1e-7, f"{case}: {ours} != float64 norm {exact}"
            assert abs(ours / torch_norm - 1) < 3e-7, f"{case}: {ours} != clip_grad_norm_'s {torch_norm}"


def gathered_run(script, rank: int, stage: int, init: bool, modify: str) -> list[float]:
    """Losses of 3 steps; ln_f.bias is set to 0.5 on rank 0 through
    GatheredParameters before the engine is built, after it, or not at all.
    After it, a change without a modifier rank must be dropped."""
    deepspeed = script.deepspeed
    torch.manual_seed(0)
    with deepspeed.zero.Init(enabled=init):
        model = script.GPT()
    if modify == "before":
        with deepspeed.zero.GatheredParameters(model.ln_f.bias, modifier_rank=0):
            if rank == 0:
                model.ln_f.bias.data.fill_(0.5)
    engine, *_ = deepspeed.initialize(model=model, config=script.config(stage, "fp32"))
    if modify == "after":
        bias = engine.module.ln_f.bias
        with deepspeed.zero.GatheredParameters(bias, modifier_rank=0):
            if rank == 0:
                bias.data.fill_(0.5)
        for dropped in (7.0, None):
            with deepspeed.zero.GatheredParameters(bias):
                assert torch.equal(bias, torch.full((script.EMBD,), 0.5)), f"rank {rank}"
                if dropped is not None:
                    bias.data.fill_(dropped)  # no modifier rank: dropped
    losses = []
    for step in range(3):
        for micro in range(script.ACCUMULATION):
            loss = engine(*script.batch(step, micro, rank))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def no_sync_run(script, rank: int, stage: int, use_no_sync: bool) -> tuple[list[float], int]:
    """Micro-batches 0 and 1 of step 0 at a boundary, the first inside no_sync
    when asked: the parameters' sums after the step, and the bytes the first sent."""
    deepspeed = script.deepspeed
    torch.manual_seed(0)
    model = script.GPT()
    engine, *_ = deepspeed.initialize(model=model, config={**script.config(stage, "fp32"),
                                                           "gradient_accumulation_steps": 1})
    comm = engine.parts.comm
    with engine.no_sync() if use_no_sync else contextlib.nullcontext():
        sent = comm.sent_nbytes
        engine.backward(engine(*script.batch(0, 0, rank)))
        sent = comm.sent_nbytes - sent
    engine.backward(engine(*script.batch(0, 1, rank)))
    engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().sum().item() for p in engine.module.parameters()], sent


def gathered_after_engine_worker(rank: int, world_size: int) -> None:
    """zero's GatheredParameters on an engine's stage-3 parameters: a change made
    on the modifier rank reaches every rank and the fp32 master (training goes on
    exactly as if it had been made before the engine was built). Init also feeds
    a stage-1 engine. no_sync: a boundary backward inside sends nothing, and the
    step is the same as with both gradients reduced."""
    import warnings

    warnings.simplefilter("ignore")
    script = load_script("zero")
    assert gathered_run(script, rank, 3, True, "after") == gathered_run(script, rank, 3, True, "before"), \
        f"rank {rank}: modified after the engine"
    assert gathered_run(script, rank, 1, True, "none") == gathered_run(script, rank, 1, False, "none"), \
        f"rank {rank}: Init feeding a stage-1 engine"
    for stage in (0, 1):
        quiet, sent_quiet = no_sync_run(script, rank, stage, True)
        loud, sent_loud = no_sync_run(script, rank, stage, False)
        assert sent_quiet == 0 < sent_loud, f"rank {rank} stage {stage}: no_sync sent {sent_quiet} bytes"
        assert quiet == pytest.approx(loud, abs=1e-5), f"rank {rank} stage {stage}: no_sync changed the step"


@pytest.mark.timeout(120)
def test_gathered_parameters_after_engine_and_no_sync() -> None:
    run_ranks(gathered_after_engine_worker, 2, timeout=100)


def ringcomm_init_worker(rank: int, world_size: int, init_method: str) -> None:
    """zero.init_distributed(dist_backend="ringcomm") makes ringcomm's the default
    group, and zero.comm's calls then run on it, with gloo's results."""
    import torch.distributed as dist
    from test_backend_models import count_transport_calls

    script = load_script("zero")
    want = script.comm_calls()  # on the harness's gloo group
    dist.barrier()
    dist.destroy_process_group()
    assert not script.deepspeed.comm.is_initialized()
    script.deepspeed.init_distributed(dist_backend="ringcomm", init_method=init_method, rank=rank,
                                      world_size=world_size)
    script.deepspeed.init_distributed(dist_backend="gloo")  # a no-op once a group exists, as DeepSpeed's
    assert dist.get_backend() == "ringcomm", f"rank {rank}: default group on {dist.get_backend()}"
    calls = count_transport_calls()
    got = script.comm_calls()
    assert got == want, f"rank {rank}: on ringcomm {got} != on gloo {want}"
    assert sum(calls.values()) >= 4, f"rank {rank}: only {dict(calls)} calls reached ringcomm"


@pytest.mark.timeout(120)
def test_init_distributed_on_ringcomm(tmp_path) -> None:
    run_ranks(ringcomm_init_worker, 2, f"file://{tmp_path}/rendezvous", timeout=100)


def _status_mib(field: str) -> float:
    line = next(line for line in open("/proc/self/status") if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


class Wide(torch.nn.Module):
    """One module (one stage-3 bucket) of NUM_WIDE parameters of WIDE_NUMEL elements."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = [torch.nn.Parameter(torch.randn(WIDE_NUMEL)) for _ in range(NUM_WIDE)]
        for i, weight in enumerate(self.weights):
            self.register_parameter(f"w{i}", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(w.sum() for w in self.weights) * x.sum()


NUM_WIDE, WIDE_NUMEL = 6, 2 << 20  # 8 MiB per parameter, a 48 MiB bucket, 24 MiB per rank


def init_memory_worker(rank: int, world_size: int) -> tuple[float, float]:
    """Peak resident memory added while the engine fills its buckets from
    zero.Init's shards (the process's high-water mark is reset just before)."""
    import ctypes

    import zero
    from zero.runtime import build

    # A fixed mmap threshold: glibc then returns every freed block of 1 MiB or more
    # at once (its adaptive threshold would keep freed blocks resident and hide
    # what the set-up frees).
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    fill = build.build_buckets
    peak = {}

    def measured(*args, **kwargs):
        open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current resident size
        start = _status_mib("VmRSS")
        buckets = fill(*args, **kwargs)
        peak["added"] = _status_mib("VmHWM") - start
        return buckets

    build.build_buckets = measured
    with zero.Init():
        model = Wide()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero.initialize(model=model, config=config)
    engine.backward(engine(torch.ones(1)))
    engine.step()
    with zero.GatheredParameters(list(model.parameters())):
        assert all(p.shape == (WIDE_NUMEL,) for p in model.parameters()), f"rank {rank}"
    return peak["added"]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
def test_engine_from_init_shards_bounded_memory() -> None:
    """Building from Init's shards holds this rank's new chunk of the bucket and
    one gathered parameter at a time: 24 + 8 MiB here (measured 36 MiB on
    ringcomm with 16 MiB parameters scaled down, 40 on gloo, whose all-gather
    stages a copy). Gathering the whole bucket at once would add its 48 MiB and
    the 24 MiB chunk."""
    mib = 4 * WIDE_NUMEL / 2**20
    bound = NUM_WIDE * mib / 2 + 2 * mib + 4  # the chunk, the largest parameter twice, 4 MiB of slack
    for rank, added in enumerate(run_ranks(init_memory_worker, 2, timeout=100)):
        assert added <= bound, f"rank {rank}: filling the buckets added {added:.0f} MiB > {bound:.0f} MiB"
