"""Stage 3's gather units ([Note: gather units], zero/sharding/units.py) and
the reuse-distance plan ([Note: reuse distance], ringcomm/plan/gathers.py):
pure tests on module trees and traces, then 2 ranks training a tiny
transformer against single-process torch with one collective per unit and
direction."""
from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks
from zero_reference import LR, MICRO, STEPS, TinyTransformer, engine_config, loss_fn, make_batch, make_model, \
    reference_train

import zero
from ringcomm.plan.gathers import plan_backward_keeps, plan_forward_keeps
from zero.sharding.units import gather_units, parse


def owned(model: nn.Module, units: list[nn.Module], groups: list[list[int]]) -> dict[str, list[str]]:
    """{unit's qualified name: names of the parameters it gathers}."""
    module_name = {id(m): name for name, m in model.named_modules()}
    param_name = [name for name, _ in model.named_parameters()]
    return {module_name[id(u)]: [param_name[i] for i in g] for u, g in zip(units, groups)}


def test_blocks_of_a_sequential_and_the_rest_per_module() -> None:
    model = TinyTransformer()
    params = list(model.parameters())
    units, groups = gather_units(model, params)
    names = owned(model, units, groups)
    blocks = [n for n in names if n.startswith("blocks.")]
    assert blocks == [f"blocks.{i}" for i in range(len(model.blocks))], names
    for name in blocks:  # a block gathers its whole subtree, and no module inside it is a unit
        expected = [n for n, _ in model.named_parameters() if n.startswith(name + ".")]
        assert names[name] == expected, (name, names[name])
    assert sorted(i for g in groups for i in g) == list(range(len(params))), "every parameter in exactly one unit"
    per_module, _ = gather_units(model, params, "module")
    assert len(per_module) > len(units) and not any(u in per_module for u in model.blocks), \
        "stage3_gather_unit 'module': leaf modules, as DeepSpeed"


def test_hugging_face_blocks_leaves_and_mixed_lists() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    params = list(model.parameters())
    names = owned(model, *gather_units(model, params))
    assert [n for n in names if ".h." in n or n.endswith(".h")] == ["transformer.h.0", "transformer.h.1"], names
    assert "lm_head" in names and names["lm_head"] == ["transformer.wte.weight"], "the tied head gathers the embedding"
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=16))
    assert [n for n in owned(llama, *gather_units(llama, list(llama.parameters()))) if "layers" in n] == \
        ["model.layers.0", "model.layers.1"], "LlamaDecoderLayer, named in _no_split_modules"
    mixed = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])  # not repeated: per module
    leaf = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    leaf._z3_leaf = True  # deepspeed.utils.set_z3_leaf_modules
    model = nn.ModuleDict({"mixed": mixed, "leaf": leaf})
    names = owned(model, *gather_units(model, list(model.parameters())))
    assert names == {"mixed.0": ["mixed.0.weight", "mixed.0.bias"], "mixed.1": ["mixed.1.weight", "mixed.1.bias"],
                     "leaf": ["leaf.0.weight", "leaf.0.bias"]}, names


def test_gather_unit_key_is_checked() -> None:
    assert parse({}) == "block" and parse({"stage3_gather_unit": "module"}) == "module"
    with pytest.raises(ValueError, match="stage3_gather_unit must be one of"):
        parse({"stage3_gather_unit": "layer"})


def test_reuse_distance_closed_forms() -> None:
    numels = [10, 20, 30]
    trace = [[0], [1], [2]]  # forward 0 1 2, then backward 2 1 0: distances 100, 60, 0
    keeps = lambda reuse, live=10**9: [sorted(k) for k in plan_forward_keeps(  # noqa: E731
        trace, numels, max_reuse_numel=reuse, max_live_numel=live)]
    assert keeps(0) == [[], [], []], "0 releases every bucket"
    assert keeps(1) == [[], [], [2]], "the last unit is reused at once by backward"
    assert keeps(60) == [[], [], [2]] and keeps(61) == [[], [1], [2]], "strictly below the distance"
    assert keeps(100) == [[], [1], [2]] and keeps(101) == [[0], [1], [2]]
    assert keeps(10**9, live=50) == [[], [1], [2]], "max_live: nearest to the turn first"
    assert keeps(10**9, live=29) == [[], [1], []], "a bucket over the limit is released, a later one may fit"
    tied = [plan_forward_keeps([[0], [1], [0]], [10, 20], max_reuse_numel=reuse, max_live_numel=10**9)
            for reuse in (20, 21)]  # the head (2) reuses the embedding (0) after the block (1), 20 elements
    assert tied == [(frozenset(), frozenset(), frozenset({0})), (frozenset({0}), frozenset({1}), frozenset({0}))], \
        f"the head reuses the embedding: {tied}"
    back = lambda reuse: plan_backward_keeps(trace, numels, max_reuse_numel=reuse, max_live_numel=10**9)  # noqa: E731
    assert [back(r) for r in (0, 1, 20, 21, 61)] == [set(), {0}, {0}, {0, 1}, {0, 1, 2}], \
        "backward, then the next forward: 0 first, then 1 after 20 elements, 2 after 60"
    assert plan_backward_keeps([[0], [1], [0]], [10, 20], max_reuse_numel=1, max_live_numel=10**9) == {0}, \
        "the embedding, tied to the head, is kept after its last backward use"


def test_reuse_keeps_a_suffix_within_the_limits() -> None:
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.randint(1, 100) for _ in range(rng.randint(1, 12))]
        reuse, live = rng.randint(0, 2 * sum(numels)), rng.randint(0, sum(numels))
        keeps = plan_forward_keeps([[b] for b in range(len(numels))], numels, max_reuse_numel=reuse,
                                   max_live_numel=live)
        for i, kept in enumerate(keeps):
            after = sum(numels[i + 1:])  # between forward i and backward i: every later unit, twice
            assert kept <= {i} and (i in kept) <= (2 * after < reuse), (numels, reuse, i, keeps)
        assert sum(numels[i] for i, k in enumerate(keeps) if k) <= live, (numels, live, keeps)


def count_collectives(comm) -> dict[str, int]:
    counts = {"all_gather": 0, "reduce_scatter": 0}
    for name in counts:
        method = getattr(comm, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            counts[_name] += 1
            return _method(*args, **kwargs)
        setattr(comm, name, counted)
    return counts


CASES = (("block", 0, 1), ("block", None, 1), ("module", 0, 1), ("block", 0, 2), ("block", None, 2))


def units_worker(rank: int, world_size: int) -> dict:
    """Per case (unit, stage3_max_reuse_distance or None for the default,
    accumulation): losses, final masters, bucket counts, the collectives of
    each micro step after the first step, and the bytes kept gathered."""
    results = {}
    for unit, reuse, accumulation in CASES:
        options = {"stage3_gather_unit": unit}
        if reuse is not None:
            options["stage3_max_reuse_distance"] = reuse
        config = engine_config(3, "fp32", accumulation, world_size, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, *_ = zero.initialize(model=make_model("tied"), config=config)
        buckets = engine.parts.group.buckets
        sharded = sum(1 for b in buckets if not b.span.resident)
        losses, micro_steps = [], []
        for step in range(STEPS):
            x, y = make_batch("tied", MICRO * accumulation * world_size, step)
            total = 0.0
            for k in range(accumulation):
                counts = count_collectives(engine.parts.comm)
                lo = (k * world_size + rank) * MICRO
                loss = loss_fn("tied", engine(x[lo:lo + MICRO]), y[lo:lo + MICRO])
                engine.backward(loss)
                micro_steps.append(dict(counts))
                engine.step()
                total += float(loss.detach())
            mean = torch.tensor([total / accumulation])
            dist.all_reduce(mean)
            losses.append(float(mean) / world_size)
        results[unit, reuse, accumulation] = (
            losses, [p.numpy() for p in engine.full_params_fp32()], (sharded, len(buckets)),
            micro_steps[accumulation:], engine.memory_report().kept_gathered_nbytes)
    return results


def expected_gathers(sharded: int, reuse: int | None, first_micro_step: bool) -> int:
    """All-gathers of one micro step of the tied model: every sharded bucket in
    forward, the embedding again for the head and every bucket again in
    backward when nothing is kept (reuse 0); with the default reuse everything
    is kept from forward to backward, and from one backward to the next
    micro step's forward inside an accumulation."""
    if reuse == 0:
        return 2 * sharded + 1
    return sharded if first_micro_step else 0


def test_units_train_like_torch_with_one_collective_per_unit_and_direction() -> None:
    world_size = 2
    references = {acc: reference_train("tied", torch.float32, MICRO * acc * world_size) for acc in (1, 2)}
    initial = list(make_model("tied").parameters())
    for rank, results in enumerate(run_ranks(units_worker, world_size, timeout=240)):
        blocks = len(TinyTransformer().blocks)
        for (unit, reuse, accumulation), (losses, params, (sharded, total), counts, kept) in results.items():
            case = f"rank {rank} unit {unit} reuse {reuse} accumulation {accumulation}"
            if unit == "block":  # the blocks, the embedding (tied to the head) and the head's other weights
                assert sharded <= blocks + 2, f"{case}: {sharded} sharded buckets for {blocks} blocks"
            for i, c in enumerate(counts):  # after the first step, whose forward records the order
                gathers = expected_gathers(sharded, reuse, i % accumulation == 0)
                assert c == {"all_gather": gathers, "reduce_scatter": total}, \
                    f"{case} micro step {i}: {c} for {sharded} sharded buckets of {total}"  # resident ones too
            assert (kept > 0) == (reuse is None), f"{case}: {kept} B kept for backward"
            ref_losses, ref_params = references[accumulation]
            for step, (a, b) in enumerate(zip(ref_losses, losses)):
                assert abs(a - b) <= 1e-5 * abs(a), f"{case} step {step}: loss {b} vs torch {a}"
            for i, (p, ref, init) in enumerate(zip(params, ref_params, initial)):  # test_zero_parity's fp32 rule
                diff, update = (torch.from_numpy(p) - ref).abs(), (ref - init.detach()).abs()
                close = (diff <= 1e-5 + 1e-3 * update).float().mean().item()
                assert diff.max() <= LR * STEPS and close >= 0.99, \
                    f"{case}: parameter {i} off by {diff.max().item()}, {close:.3f} of it close"


def load_mid_accumulation_worker(rank: int, world_size: int, directory: str) -> None:
    """A checkpoint loaded after a backward that kept units for the next
    forward: that forward runs on the loaded values, not the kept ones."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=make_model("tied"), config=engine_config(3, "fp32", 2, world_size))
    probe = make_batch("tied", MICRO, 99)[0]

    def micro_step(step: int, k: int) -> None:
        x, y = make_batch("tied", MICRO * 2 * world_size, step)
        lo = (k * world_size + rank) * MICRO
        engine.backward(loss_fn("tied", engine(x[lo:lo + MICRO]), y[lo:lo + MICRO]))
        engine.step()

    for step in range(2):
        micro_step(step, 0)
        micro_step(step, 1)
    engine.save_checkpoint(directory, tag="saved")
    with torch.no_grad():
        saved = engine(probe)
    micro_step(2, 0)
    micro_step(2, 1)  # the values move on
    micro_step(3, 0)  # inside an accumulation: units kept for the next forward
    assert engine.parts.group.kept, f"rank {rank}: nothing kept after a backward inside an accumulation"
    engine.load_checkpoint(directory, tag="saved")
    with torch.no_grad():
        loaded = engine(probe)
    assert torch.equal(saved, loaded), f"rank {rank}: forward after load differs by {(saved - loaded).abs().max()}"


def test_load_between_micro_steps_drops_the_kept_units(tmp_path) -> None:
    run_ranks(load_mid_accumulation_worker, 2, str(tmp_path), timeout=120)
