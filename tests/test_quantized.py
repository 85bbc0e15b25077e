"""Quantized collectives (ringcomm.quantized) at world sizes 2-4 on every
transport (shm, torch_dist, hierarchical as simulated hosts), against
dequantize(quantize(x)) reduced in float32 from every rank's data gathered
through gloo; the kernels themselves are tested in test_quant.py."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ringcomm
from harness import run_ranks
from ringcomm import ReduceOp, quant
from test_collectives import SMALL_CMA, SMALL_TORCH_DIST

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNKS = (0, 1, 7, 300)  # per-rank chunk numels: one block, several, partial blocks, odd for int4
BITS_BLOCKS = ((8, 64), (4, 32), (4, 6))


def _group(kind: str, rank: int) -> ringcomm.Group:
    if kind.startswith("hierarchical"):
        hosts = ("a", "a", "b", "b") if kind == "hierarchical" else ("a", "b", "a", "b")
        os.environ["RINGCOMM_HOST"] = hosts[rank]
        kind = "hierarchical"
    return ringcomm.new_group(transport=kind, timeout=30.0, shm=SMALL_CMA, torch_dist=SMALL_TORCH_DIST)


def _data(numel: int, dtype: torch.dtype, rank: int, case: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * case + rank)
    data = torch.randn(numel, generator=gen, dtype=torch.float64) * torch.rand(1, generator=gen).item() * 10
    if numel > 3:
        data[numel // 3] = 1e3  # a block with one large value
        data[: min(numel, 5)] = 0.0  # and the start of one all zero
    return data.to(dtype)


def _everyone(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor.float()) for _ in range(world_size)]
    dist.all_gather(out, tensor.float())
    return [t.to(tensor.dtype) for t in out]


def _roundtrip(values: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    data, scales = quant.quantize(values.contiguous(), bits=bits, block=block)
    return quant.dequantize(data, scales, torch.empty(values.numel(), dtype=torch.float32), bits=bits, block=block)


def _expected_reduce_scatter(inputs: list[torch.Tensor], rank: int, chunk: int, bits: int, block: int,
                             ranks_on: tuple[tuple[int, ...], ...] | None) -> torch.Tensor:
    """Float32 sums of round trips in the collective's order: over ranks (one
    level), or over each host's ranks, then over the hosts' partials (two)."""
    piece = [x[rank * chunk:(rank + 1) * chunk] for x in inputs]
    total = torch.zeros(chunk, dtype=torch.float32)
    if ranks_on is None:
        for p in piece:
            total += _roundtrip(p, bits, block)
        return total
    for ranks in ranks_on:
        partial = torch.zeros(chunk, dtype=torch.float32)
        for r in ranks:
            partial += _roundtrip(piece[r], bits, block)
        total += _roundtrip(partial, bits, block)
    return total


def _sweep(rank: int, world_size: int, kind: str) -> int:
    group, checked, case = _group(kind, rank), 0, 0
    levels = getattr(group.transport, "levels", None)
    ranks_on = levels()[2] if levels is not None else None
    for dtype in DTYPES:
        for bits, block in BITS_BLOCKS:
            for chunk in CHUNKS:
                case += 1
                what = f"{kind} rank {rank} {dtype} bits={bits} block={block} chunk={chunk}"
                x = _data(chunk, dtype, rank, case)
                out = torch.full((world_size * chunk,), 7.0, dtype=dtype)
                work = ringcomm.quantized_all_gather(out, x, group, bits=bits, block=block, async_op=case % 2 == 0)
                if work is not None:
                    work.wait()
                expected = torch.cat([_roundtrip(t, bits, block) for t in _everyone(x, world_size)]).to(dtype)
                torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=what)

                y = _data(world_size * chunk, dtype, rank, case + 1000)
                op = (ReduceOp.SUM, ReduceOp.AVG)[case % 2]
                got = torch.full((chunk,), 7.0, dtype=dtype)
                ringcomm.quantized_reduce_scatter(got, y, op, group, bits=bits, block=block)
                want = _expected_reduce_scatter(_everyone(y, world_size), rank, chunk, bits, block, ranks_on)
                if op == ReduceOp.AVG:
                    want /= world_size
                torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=1e-6, atol=1e-6, msg=what)
                checked += 2
    return checked


@pytest.mark.parametrize("kind,world_size", [("shm", 2), ("shm", 3), ("torch_dist", 2),
                                             pytest.param("torch_dist", 4, marks=pytest.mark.slow),
                                             ("hierarchical", 4), ("hierarchical-interleaved", 4)])
def test_quantized_collectives_match_round_trips(kind, world_size):
    counts = run_ranks(_sweep, world_size, kind, timeout=240)
    assert counts == [2 * len(DTYPES) * len(BITS_BLOCKS) * len(CHUNKS)] * world_size


def _errors(rank: int, world_size: int) -> list[str]:
    group = ringcomm.new_group(transport="shm", timeout=30.0)
    x, out = torch.ones(8), torch.empty(8 * world_size)
    cases = [
        (TypeError, lambda: ringcomm.quantized_all_gather(out.long(), x.long(), group)),
        (TypeError, lambda: ringcomm.quantized_all_gather(out.double(), x.double(), group)),
        (TypeError, lambda: ringcomm.quantized_all_gather(out.half(), x, group)),
        (ValueError, lambda: ringcomm.quantized_all_gather(out[:-1], x, group)),
        (ValueError, lambda: ringcomm.quantized_all_gather(out, torch.ones(16)[::2], group)),
        (ValueError, lambda: ringcomm.quantized_all_gather(out, x, group, bits=2)),
        (ValueError, lambda: ringcomm.quantized_all_gather(out, x, group, bits=4, block=5)),
        (ValueError, lambda: ringcomm.quantized_reduce_scatter(x, out, ReduceOp.MAX, group)),
        (ValueError, lambda: ringcomm.quantized_reduce_scatter(x[:-1], out, ReduceOp.SUM, group)),
    ]
    messages = []
    for error, call in cases:
        with pytest.raises(error) as info:
            call()
        messages.append(str(info.value))
    ringcomm.quantized_all_gather(out, x, group)  # the group still works after refused calls
    torch.testing.assert_close(out, torch.ones(8 * world_size), rtol=1e-6, atol=0)
    return messages


def test_quantized_bad_input_is_refused_before_any_transfer():
    messages = run_ranks(_errors, 2, timeout=120)
    assert any("cannot be quantized" in m for m in messages[0])
    assert any("is not SUM or AVG" in m for m in messages[0])
