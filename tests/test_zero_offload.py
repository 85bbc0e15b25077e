"""Offload (cpu, nvme): a run with offload trains like the same run without it,
at stages 1-3, world sizes 1/2/4, accumulation 1/3, clipping on."""
from __future__ import annotations

import os
import resource
import signal
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from test_zero_parity import TOLERANCE
from zero_reference import CLIP, DTYPES, MICRO, STEPS, engine_config, loss_fn, make_batch, make_model

import zero

OFFLOADS = ("cpu", "nvme")


def offload_sections(offload: str, stage: int, nvme_path: str, *, param: str | None = None) -> dict:
    """zero_optimization offload keys: offload_optimizer on `offload`, and
    offload_param on `param` (default: `offload` at stage 3, else none)."""
    param = param if param is not None else offload if stage == 3 else "none"
    if offload == param == "none":
        return {}
    sections: dict = {"sub_group_size": 150}  # several sub-groups per rank
    for key, device in (("offload_optimizer", offload), ("offload_param", param)):
        if device == "none":
            continue
        section = {"device": device, "pin_memory": True}
        if device == "nvme":
            section.update(nvme_path=nvme_path, buffer_count=2, pipeline_read=True, pipeline_write=True)
        if key == "offload_param":
            section.update(max_in_cpu=0, buffer_count=3)  # every non-resident shard swapped
        sections[key] = section
    return sections


def train(rank: int, world_size: int, kind: str, stage: int, dtype_name: str, accumulation: int, offload: str,
          nvme_path: str) -> tuple[list[float], list[torch.Tensor], object]:
    config = engine_config(stage, dtype_name, accumulation, world_size, **offload_sections(offload, stage, nvme_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=make_model(kind), config=config)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = make_batch(kind, MICRO * accumulation * world_size, step)
        for k in range(accumulation):
            lo = (k * world_size + rank) * MICRO
            loss = loss_fn(kind, engine(x[lo:lo + MICRO]), y[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    assert max(norms) > CLIP, f"rank {rank}: clipping never acted {norms}"
    return losses, engine.full_params_fp32(), engine


def compare(case: str, kind: str, dtype_name: str, got: tuple, expected: tuple) -> None:
    # fp32: the offloaded step folds the clip coefficient into the fused kernel
    # (g / (1/coef) instead of g * coef): one rounding apart per step, so 1e-6.
    # 16-bit: the parity tests' tolerances (a 1-ulp difference of a 16-bit value grows over steps).
    loss_rtol = 1e-6 if dtype_name == "fp32" else TOLERANCE[dtype_name][0]
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(expected[0]), rtol=loss_rtol, atol=1e-7,
                               msg=lambda m: f"{case}: losses: {m}")
    for i, (p, q) in enumerate(zip(got[1], expected[1], strict=True)):
        if dtype_name == "fp32":
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"{case}: parameter {i}: {m}")
    if dtype_name != "fp32":
        initial = [p.detach().float() for p in make_model(kind).to(DTYPES[dtype_name]).parameters()]
        for i, (p, q, p0) in enumerate(zip(got[1], expected[1], initial, strict=True)):
            error, update = float((p - q).norm()), float((q - p0).norm())
            assert error <= TOLERANCE[dtype_name][1] * update + 1e-6, f"{case}: parameter {i}: {error=} {update=}"


def parity_worker(rank: int, world_size: int, cases: list[tuple], nvme_root: str,
                  offloads: tuple[str, ...] = OFFLOADS) -> None:
    nvme_path = os.path.join(nvme_root, f"rank{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    for kind, stage, dtype_name, accumulation in cases:
        expected = train(rank, world_size, kind, stage, dtype_name, accumulation, "none", nvme_path)
        for offload in offloads:
            case = f"rank {rank}/{world_size} {kind} stage {stage} {dtype_name} accumulation {accumulation} {offload}"
            got = train(rank, world_size, kind, stage, dtype_name, accumulation, offload, nvme_path)
            compare(case, kind, dtype_name, got[:2], expected[:2])
            report = got[2].memory_report()
            assert report.host_nbytes > 0, f"{case}: {report}"
            assert (report.disk_nbytes > 0) == (offload == "nvme"), f"{case}: {report}"
            del got
            dist.barrier()
            assert os.listdir(nvme_path) == [], f"{case}: swap files left: {os.listdir(nvme_path)}"


CASES = {
    1: [("mlp", 1, "fp32", 1), ("mlp", 2, "fp32", 3), ("transformer", 3, "fp32", 3), ("transformer", 2, "bf16", 1)],
    2: [("mlp", 1, "fp32", 3), ("transformer", 2, "fp32", 1), ("transformer", 3, "fp32", 1),
        ("transformer", 3, "bf16", 3), ("mlp", 2, "fp16", 3), ("transformer", 1, "bf16", 1)],
    4: [("transformer", 2, "fp32", 3), ("transformer", 3, "fp32", 3), ("mlp", 1, "fp16", 1)],
}


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_offload_parity(world_size: int) -> None:
    with tempfile.TemporaryDirectory(prefix="zero-nvme-") as root:
        run_ranks(parity_worker, world_size, CASES[world_size], root, timeout=240)


def checkpoint_worker(rank: int, world_size: int, root: str) -> None:
    """Saved with one offload setting, loaded into another: the resumed run
    continues like the uninterrupted one."""
    nvme_path = os.path.join(root, f"rank{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    for stage, saved_with, loaded_with in ((3, "nvme", "none"), (2, "none", "nvme"), (3, "cpu", "nvme")):
        case = f"rank {rank} stage {stage} saved with {saved_with}, loaded with {loaded_with}"
        save_dir = os.path.join(root, f"ckpt-{stage}-{saved_with}-{loaded_with}")
        engine = new_engine(stage, saved_with, world_size, nvme_path)
        run_steps(engine, rank, world_size, range(2))
        engine.save_checkpoint(save_dir)
        run_steps(engine, rank, world_size, range(2, 4))
        expected = engine.full_params_fp32()
        resumed = new_engine(stage, loaded_with, world_size, nvme_path)
        resumed.load_checkpoint(save_dir)
        run_steps(resumed, rank, world_size, range(2, 4))
        for i, (a, b) in enumerate(zip(resumed.full_params_fp32(), expected, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{case}: parameter {i}: {m}")
        del engine, resumed


def new_engine(stage: int, offload: str, world_size: int, nvme_path: str, *, param: str | None = None,
               init: bool = False, **extra):
    """A bf16 transformer engine with offload_sections(offload, stage, nvme_path, param=param);
    init: the model is built under zero.Init."""
    config = engine_config(stage, "bf16", 1, world_size, **offload_sections(offload, stage, nvme_path, param=param),
                           **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zero.Init(config_dict_or_path=config, enabled=init):
            model = make_model("transformer")
        engine, *_ = zero.initialize(model=model, config=config)
    return engine


def run_steps(engine, rank: int, world_size: int, steps: range) -> list[float]:
    """Trains on the transformer's batches of `steps`; returns this rank's losses."""
    losses = []
    for step in steps:
        x, y = make_batch("transformer", MICRO * world_size, step)
        loss = loss_fn("transformer", engine(x[rank * MICRO:(rank + 1) * MICRO]), y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def test_checkpoints_across_offload_settings() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-nvme-") as root:
        run_ranks(checkpoint_worker, 2, root, timeout=180)


def kill_during_nvme_step(rank: int, world_size: int, root: str) -> None:
    """Rank 1 dies while its NVMe step writes sub-groups back; rank 0 fails with
    an error naming it, and no swap file is left in either nvme_path."""
    nvme_path = os.path.join(root, f"rank{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    engine = new_engine(3, "nvme", world_size, nvme_path)
    run_steps(engine, rank, world_size, range(2))
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    saved = engine.full_params_fp32()
    if rank == 0:
        torch.save(saved, os.path.join(root, "saved.pt"))
    dist.barrier()
    assert os.listdir(nvme_path) == [], f"rank {rank}: swap files have names: {os.listdir(nvme_path)}"
    if rank == 1:
        states = engine.parts.group.states
        states.start_write = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(RuntimeError) as info:
        run_steps(engine, rank, world_size, range(2, 50))
    assert "rank 1" in str(info.value) or "peer" in str(info.value), f"rank {rank}: {info.value}"


def resume_and_bad_paths(rank: int, world_size: int, root: str) -> None:
    """The checkpoint from before the kill loads; unusable nvme_paths fail at start-up."""
    nvme_path = os.path.join(root, f"rank{rank}")
    engine = new_engine(3, "nvme", world_size, nvme_path)
    engine.load_checkpoint(os.path.join(root, "ckpt"))
    for i, (a, b) in enumerate(zip(engine.full_params_fp32(), torch.load(os.path.join(root, "saved.pt")), strict=True)):
        assert torch.equal(a, b), f"rank {rank}: parameter {i} differs from the saved checkpoint"
    run_steps(engine, rank, world_size, range(2, 3))
    with pytest.raises(ValueError, match=r"offload_param\.nvme_path '/sys'.*cannot create"):  # the first file made
        new_engine(3, "nvme", world_size, "/sys")  # not writable (the tests may run as root: chmod would not do)
    with pytest.raises(ValueError, match=r"nvme_path .* is not a directory"):
        new_engine(3, "nvme", world_size, os.path.join(root, "saved.pt"))
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk, as the file-size limit makes it
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        with pytest.raises(ValueError, match=r"nvme_path .* cannot reserve \d+ bytes"):
            new_engine(3, "nvme", world_size, nvme_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert os.listdir(nvme_path) == [], f"rank {rank}: {os.listdir(nvme_path)}"


@pytest.mark.slow
def test_killed_rank_during_nvme_step() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-nvme-") as root:
        run_ranks(kill_during_nvme_step, 2, root, env={"RINGCOMM_TIMEOUT": "5"}, may_die=frozenset({1}), timeout=120)
        for rank in (0, 1):
            assert os.listdir(os.path.join(root, f"rank{rank}")) == [], f"rank {rank}: swap files left behind"
        run_ranks(resume_and_bad_paths, 2, root, timeout=120)
