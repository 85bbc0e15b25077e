"""Stage 3 shards tied and small parameters unless stage3_param_persistence_threshold
keeps them whole (numel <= threshold, as DeepSpeed): a tied weight is one
sharded storage gathered by both modules, and the model states per rank are the
ZeRO paper's 16 psi / N with the persistent parameters reported apart."""
from __future__ import annotations

import warnings

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
