"""zero.checkpointing: losses and parameters with activation checkpointing
equal those without (fp32, bitwise: the graph and its op order are unchanged),
at stages 0-3 and world sizes 1/2/4, with dropout; partitioned inputs shrink by
the world size; the users' stage-3 config runs with its section honoured."""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks
from zero_reference import Block, TinyTransformer, activation_peaks

import zero
from zero.activation import checkpointing

SEED_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ds_zero3_config.json")
MODES = {  # activation_checkpointing sections; "partition" ones run the same batch on every rank
    "plain": {},
    "cpu": {"cpu_checkpointing": True},
    "partition": {"partition_activations": True},
    "partition+cpu+contiguous": {"partition_activations": True, "cpu_checkpointing": True,
                                 "contiguous_memory_optimization": True, "number_checkpoints": 3},
}


class DropoutBlock(Block):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__(d, heads)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(super().forward(x))


def make_model(layers: int = 3, d: int = 16, heads: int = 2) -> nn.Module:
    torch.manual_seed(7)
    model = TinyTransformer(d=d, heads=heads, layers=layers)
    model.blocks = nn.Sequential(*(DropoutBlock(d, heads) for _ in range(layers)))
    return model


class WorldMpu:
    """A model-parallel group of every rank: each holds the same activations."""

    def get_model_parallel_group(self):
        return dist.group.WORLD

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank()


def config(stage: int, section: dict | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 700,
                                 "stage3_param_persistence_threshold": 20}}
    if section is not None:
        cfg["activation_checkpointing"] = section
    return cfg


def train(stage: int, mode: str | None, rank: int, replicated: bool, steps: int = 2):
    """Losses, final fp32 parameters, the peak checkpointed-input bytes and the
    number of inputs gathered one checkpoint ahead."""
    checkpointing.reset()
    model = make_model()
    section = None if mode is None else MODES[mode]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=config(stage, section))
    if mode is not None:
        partitioned = section.get("partition_activations", False)
        checkpointing.configure(WorldMpu() if partitioned else None, deepspeed_config=config(stage, section))
        checkpointing.checkpoint_modules(model, DropoutBlock)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(50 * step + (0 if replicated else rank))
        tokens, target = torch.randint(0, 32, (3, 8), generator=g), torch.randint(0, 32, (3, 8), generator=g)
        torch.manual_seed(1000 * step + (0 if replicated else rank))  # replicated: same dropout masks too
        checkpointing.stats().reset()
        loss = nn.functional.cross_entropy(engine(tokens).reshape(-1, 32), target.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return losses, engine.full_params_fp32(), engine.memory_report().checkpoint_nbytes, \
        checkpointing.stats().num_prefetched


def parity_worker(rank: int, world_size: int) -> dict:
    held = {}
    for stage in range(4):
        references = {replicated: train(stage, None, rank, replicated) for replicated in (False, True)}
        for mode in MODES:
            replicated = mode.startswith("partition")
            case = f"rank {rank}/{world_size} stage {stage} {mode}"
            ref_losses, ref_params, *_ = references[replicated]
            losses, params, held[stage, mode], prefetched = train(stage, mode, rank, replicated)
            expected = 2 * 2 if replicated and world_size > 1 else 0  # per step, every block input but the last
            assert prefetched == expected, f"{case}: {prefetched} inputs gathered ahead, expected {expected}"
            for step, (a, b) in enumerate(zip(ref_losses, losses)):
                assert torch.equal(a, b), f"{case} step {step}: loss {b.item()!r} != {a.item()!r}"
            for i, (a, b) in enumerate(zip(ref_params, params)):
                assert torch.equal(a, b), f"{case}: parameter {i} differs by {(a - b).abs().max().item()}"
            assert held[stage, mode] > 0, f"{case}: no checkpointed inputs measured"
    if world_size > 1:  # each rank its own batch: nothing to partition, and an error says so
        with pytest.raises(ValueError, match=f"rank {rank}'s checkpointed input differs"):
            train(0, "partition", rank, replicated=False, steps=1)
    return held


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_parity_stages_and_partitioned_bytes(world_size: int) -> None:
    results = run_ranks(parity_worker, world_size, timeout=300)
    numel = 3 * 8 * 16  # one block input (micro batch, sequence, hidden), fp32
    chunk = -(-numel // world_size)  # the padded chunk each rank keeps
    for rank, held in enumerate(results):
        for stage in range(4):
            plain, part = held[stage, "plain"], held[stage, "partition"]
            assert plain == 3 * numel * 4, f"rank {rank} stage {stage}: {plain} B held for 3 blocks"
            # falls by the world size, within 10% plus the padding
            assert part <= plain / world_size * 1.1 + 3 * (chunk * world_size - numel) * 4, \
                f"rank {rank}/{world_size} stage {stage}: partitioned {part} B vs whole {plain} B"
            assert part == 3 * chunk * 4, f"rank {rank}/{world_size} stage {stage}: {part} B"


def seed_config_worker(rank: int, world_size: int) -> None:
    losses = {}
    for checkpointed in (False, True):
        checkpointing.reset()
        model = make_model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, *_ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                         config=SEED_CONFIG, args={"per_device_train_batch_size": 2, "fp16": True})
        assert checkpointing.is_configured(), f"rank {rank}: the config's section configures checkpointing"
        assert checkpointing.current() is engine.parts.activation, "the engine's checkpointing is not the current one"
        options = engine.parts.activation.options.store
        assert options.partition and options.cpu and options.contiguous and options.num_slots == 4, options
        if checkpointed:
            checkpointing.checkpoint_modules(model, DropoutBlock)
        losses[checkpointed] = []
        for step in range(3):
            g = torch.Generator().manual_seed(step + 10 * rank)
            torch.manual_seed(step)
            tokens, target = torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)
            loss = nn.functional.cross_entropy(engine(tokens).float().reshape(-1, 32), target.reshape(-1))
            engine.backward(loss)
            engine.step()
            losses[checkpointed].append(loss.item())
        if checkpointed:
            slots = engine.parts.activation.stores[torch.device("cpu")].slots
            assert slots.nbytes == 4 * 2 * 8 * 16 * 2, f"rank {rank}: 4 fp16 slots of one block input: {slots.nbytes}"
            assert engine.memory_report().checkpoint_nbytes == 3 * 2 * 8 * 16 * 2
    assert losses[True] == losses[False], f"rank {rank}: {losses}"


def test_seed_stage3_config_honours_its_section() -> None:
    run_ranks(seed_config_worker, 2, timeout=120)


def two_engines_worker(rank: int, world_size: int) -> None:
    """Two engines, one with cpu_checkpointing and one keeping inputs where they
    are, trained in turns: each holds its own inputs, store and stats, and a
    configure() after the second engine's build reaches that one only."""
    checkpointing.reset()
    engines, models = [], []
    for section in ({"cpu_checkpointing": True}, {}):
        model = make_model()
        checkpointing.checkpoint_modules(model, DropoutBlock)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engines.append(zero.initialize(model=model, config=config(1, section))[0])
        models.append(model)
    first, second = (engine.parts.activation for engine in engines)
    assert first is not second and checkpointing.current() is second
    checkpointing.configure(None, profile=True)
    assert second.options.profile and not first.options.profile and first.options.store.cpu
    tokens, target = torch.randint(0, 32, (3, 8)), torch.randint(0, 32, (3, 8))
    for step in range(2):
        for engine in engines:
            engine.parts.activation.stats.reset()
            loss = nn.functional.cross_entropy(engine(tokens).reshape(-1, 32), target.reshape(-1))
            engine.backward(loss)
            engine.step()
            assert engine.memory_report().checkpoint_nbytes == 3 * 3 * 8 * 16 * 4, f"step {step}"
    assert set(first.stores) == set(second.stores) == {torch.device("cpu")}
    assert first.stores[torch.device("cpu")].options.cpu and not second.stores[torch.device("cpu")].options.cpu
    assert first.stats.held_nbytes == second.stats.held_nbytes == 0, "a frame released into the other's stats"
    for engine in engines:
        engine.destroy()
    checkpointing.reset()


def test_each_engine_owns_its_checkpointing() -> None:
    run_ranks(two_engines_worker, 1, timeout=120)


def test_twelve_layer_peak_with_checkpointing() -> None:
    """Per-block checkpointing keeps at most 30% of the activation peak."""
    model = TinyTransformer(d=64, heads=4, layers=12)
    tokens = torch.randint(0, 32, (4, 32))
    peaks = activation_peaks(model, tokens, lambda out: out.square().mean())
    assert peaks[True] <= 0.3 * peaks[False], f"peak with {peaks[True]} B vs without {peaks[False]} B"


def test_configure_validates() -> None:
    checkpointing.reset()
    with pytest.raises(ValueError, match="number_checkpoints"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="activation_checkpointing.profile"):
        checkpointing.configure(None, profile="yes")
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1)
    model = TinyTransformer(layers=2)
    checkpointing.checkpoint_modules(model, Block)
    with pytest.raises(ValueError, match="number_checkpoints"):
        model(torch.randint(0, 32, (2, 4))).sum().backward()
    checkpointing.reset()
    assert not checkpointing.is_configured()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: pinned host copies, the CUDA RNG state")
def test_cuda_checkpoint_parity_with_host_inputs() -> None:
    """The CUDA paths (never run on the CPU-only development machine): dropout
    masks drawn from the CUDA generator again, inputs pinned on the host."""
    model = make_model().cuda()
    tokens = torch.randint(0, 32, (3, 8), device="cuda")
    grads = {}
    for section in (None, {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True}):
        checkpointing.reset()
        run = copy.deepcopy(model)
        if section is not None:
            checkpointing.configure(None, deepspeed_config={"activation_checkpointing": section})
            checkpointing.checkpoint_modules(run, DropoutBlock)
        torch.cuda.manual_seed(3)
        run(tokens).square().mean().backward()
        grads[section is None] = [p.grad for p in run.parameters()]
    for i, (a, b) in enumerate(zip(grads[True], grads[False])):
        assert torch.equal(a, b), f"parameter {i}: {(a - b).abs().max().item()}"
    checkpointing.reset()
