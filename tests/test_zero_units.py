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
from ringcomm.plan.gathers import plan_forward_keeps
from zero.sharding.units import gather_units


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


def units_worker(rank: int, world_size: int) -> dict:
    results = {}
    for unit, reuse in (("block", 0), ("block", None), ("module", 0)):
        options = {"stage3_gather_unit": unit}
        if reuse is not None:
            options["stage3_max_reuse_distance"] = reuse
        config = engine_config(3, "fp32", 1, world_size, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, *_ = zero.initialize(model=make_model("tied"), config=config)
        buckets = engine.parts.group.buckets
        sharded = sum(1 for b in buckets if not b.span.resident)
        losses, per_step = [], []
        for step in range(STEPS):
            counts = count_collectives(engine.parts.comm)
            x, y = make_batch("tied", MICRO * world_size, step)
            loss = loss_fn("tied", engine(x[rank * MICRO:(rank + 1) * MICRO]), y[rank * MICRO:(rank + 1) * MICRO])
            engine.backward(loss)
            per_step.append(dict(counts))
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world_size)
        results[unit, reuse] = (losses, [p.numpy() for p in engine.full_params_fp32()], (sharded, len(buckets)),
                                per_step[1:],
                                engine.memory_report().kept_gathered_nbytes)
    return results


def test_units_train_like_torch_with_one_collective_per_unit_and_direction() -> None:
    world_size = 2
    ref_losses, ref_params = reference_train("tied", torch.float32, MICRO * world_size)
    initial = list(make_model("tied").parameters())
    for rank, results in enumerate(run_ranks(units_worker, world_size, timeout=240)):
        blocks = len(TinyTransformer().blocks)
        for (unit, reuse), (losses, params, (sharded, total), counts, kept) in results.items():
            case = f"rank {rank} unit {unit} reuse {reuse}"
            if unit == "block":  # the blocks, the embedding (tied to the head) and the head's other weights
                assert sharded <= blocks + 2, f"{case}: {sharded} sharded buckets for {blocks} blocks"
            gathers = sharded + 1 if reuse == 0 else sharded  # the embedding again for the tied head, in forward
            for c in counts:  # after the first step, whose forward records the order
                assert c == {"all_gather": gathers + (sharded if reuse == 0 else 0), "reduce_scatter": total}, \
                    f"{case}: {c} for {sharded} sharded buckets of {total}"  # the resident one reduce-scatters too
            assert (kept > 0) == (reuse is None), f"{case}: {kept} B kept for backward"
            for step, (a, b) in enumerate(zip(ref_losses, losses)):
                assert abs(a - b) <= 1e-5 * abs(a), f"{case} step {step}: loss {b} vs torch {a}"
            for i, (p, ref, init) in enumerate(zip(params, ref_params, initial)):  # test_zero_parity's fp32 rule
                diff, update = (torch.from_numpy(p) - ref).abs(), (ref - init.detach()).abs()
                close = (diff <= 1e-5 + 1e-3 * update).float().mean().item()
                assert diff.max() <= LR * STEPS and close >= 0.99, \
                    f"{case}: parameter {i} off by {diff.max().item()}, {close:.3f} of it close"
