"""Stage 3 shards tied and small parameters unless stage3_param_persistence_threshold
keeps them whole (numel <= threshold, as DeepSpeed): a tied weight is one
sharded storage gathered by both modules, and the model states per rank are the
ZeRO paper's 16 psi / N with the persistent parameters reported apart."""
from __future__ import annotations

import warnings

import pytest
import torch

from harness import run_ranks
from test_zero_reshard import train
from zero_reference import engine_config, make_model

import zero

THRESHOLD = 20  # engine_config's: LayerNorm weights and 16-element biases stay whole


def persist_worker(rank: int, world_size: int) -> None:
    model = make_model("tied")
    psi = sum(p.numel() for p in model.parameters())  # the tied weight once
    persistent_numel = sum(p.numel() for p in model.parameters() if p.numel() <= THRESHOLD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=engine_config(3, "bf16", 1, world_size))
    assert model.head.weight is model.embed.weight, f"rank {rank}: the tie is broken"
    seen = []

    def during_head(module, args) -> None:
        seen.append((model.head.weight.data_ptr() == model.embed.weight.data_ptr(), model.head.weight.shape))
    handle = model.head.register_forward_pre_hook(during_head)  # registered after the gatherer's: runs after it
    train(engine, rank, world_size, range(2))
    handle.remove()
    assert seen and all(same and shape == (32, 16) for same, shape in seen), f"rank {rank}: head saw {seen}"
    assert model.embed.weight.numel() == 0, f"rank {rank}: the tied weight is not sharded between uses"
    report = engine.memory_report()
    # bf16 + Adam: 2 (parameters) + 2 (gradients) + 12 (fp32 master, exp_avg, exp_avg_sq) bytes per element,
    # every bucket split evenly (all numels here are even: no padding at 2 ranks)
    states = report.params_nbytes + report.grads_nbytes + report.optimizer_nbytes
    assert states == 16 * psi // world_size, f"rank {rank}: {report} vs 16 psi / N = {16 * psi // world_size}"
    expected = 2 * persistent_numel * (world_size - 1) // world_size
    assert report.persistent_params_nbytes == expected, f"rank {rank}: {report} vs persistent {expected}"
    threshold_case(rank, world_size)


def test_stage3_shards_tied_and_small_parameters() -> None:
    run_ranks(persist_worker, 2, timeout=120)


def threshold_case(rank: int, world_size: int) -> None:
    """A threshold above every parameter keeps the whole model on each rank, as DeepSpeed does."""
    model = make_model("tied")
    config = engine_config(3, "bf16", 1, world_size, stage3_param_persistence_threshold=10 ** 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=config)
    train(engine, rank, world_size, range(1))
    whole = [p.numel() for p in model.parameters()]
    assert whole == [p.numel() for p in make_model("tied").parameters()], f"rank {rank}: {whole}"
    report = engine.memory_report()
    psi = sum(whole)
    assert report.persistent_params_nbytes == 2 * psi * (world_size - 1) // world_size, f"rank {rank}: {report}"
    assert torch.equal(model.head.weight, model.embed.weight)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def forward_memory_worker(rank: int, world_size: int) -> float:
    """Resident memory a stage-3 forward adds: the weights autograd saves for
    backward must not keep the gathered buckets alive ([Note: saved weights])."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: freed large blocks leave the resident set
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB of fp32 weights
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=config)
    x = torch.randn(2, 1024, requires_grad=True)
    reference = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    reference.load_state_dict({k: v for k, v in zip(reference.state_dict(), engine.full_params_fp32())})
    before = rss_mib()
    out = engine(x)
    added = rss_mib() - before
    out.square().sum().backward()  # the weights come back for backward: the input's gradient is exact
    expected = torch.autograd.grad(reference(x).square().sum(), x)[0]
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)
    engine.parts.group.scheduler.finish()
    return added


@pytest.mark.slow
def test_forward_does_not_keep_gathered_weights() -> None:
    added = run_ranks(forward_memory_worker, 2)
    assert max(added) < 12, f"a stage-3 forward kept {added} MiB resident (gathered weights: 32 MiB)"
