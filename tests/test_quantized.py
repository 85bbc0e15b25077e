"""Quantized collectives (ringcomm.comm.quantized) at world sizes 2-4 on every
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
from ringcomm import ReduceOp
from ringcomm.kernels import quant
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


# Calls whose rows have the same length on every rank but whose arguments differ:
# (what every rank passes, what the odd rank passes instead). Sizes pair inside one
# padding bucket of the int32 words (1008 and 1001 at 4 bits); 8/8 and 4/4 give rows of 12 bytes for 8
# elements, 8 and 4 bits rows of 8 bytes for 4; the dtype and op do not change the rows at all.
MISMATCHES = (
    (dict(op="all_gather", numel=8), dict(numel=5)),
    (dict(op="all_gather", numel=1008), dict(numel=1001)),  # 8 bits: rows differ, the error named int32 words
    (dict(op="all_gather", numel=1008, bits=4), dict(numel=1001)),
    (dict(op="reduce_scatter", numel=8, bits=4, block=4), dict(bits=8, block=8)),
    (dict(op="all_gather", numel=4, bits=4, block=4), dict(bits=8)),
    (dict(op="all_gather", numel=8), dict(numel=0)),
    (dict(op="reduce_scatter", numel=8), dict(numel=0)),
    (dict(op="reduce_scatter", numel=8), dict(numel=5)),
    (dict(op="all_gather", numel=8), dict(dtype=torch.bfloat16)),
    (dict(op="reduce_scatter", numel=8), dict(redop=ReduceOp.AVG)),
)
DEFAULT_CALL = dict(bits=8, block=256, dtype=torch.float32, redop=ReduceOp.SUM)


def _call(group: ringcomm.Group, rank: int, world_size: int, *, op: str, numel: int, bits: int, block: int,
          dtype: torch.dtype, redop: ReduceOp) -> torch.Tensor:
    """One quantized call on (rank + 1)-filled data; returns its output."""
    if op == "all_gather":
        output = torch.empty(world_size * numel, dtype=dtype)
        ringcomm.quantized_all_gather(output, torch.full((numel,), rank + 1.0, dtype=dtype), group, bits=bits,
                                      block=block)
    else:
        output = torch.empty(numel, dtype=dtype)
        ringcomm.quantized_reduce_scatter(output, torch.full((world_size * numel,), rank + 1.0, dtype=dtype), redop,
                                          group, bits=bits, block=block)
    return output


def _check_still_works(group: ringcomm.Group, rank: int, world_size: int, what: str) -> None:
    """A correct call of each collective after a refused one, against round trips of the
    closed-form inputs (rank r holds r + 1) made here, one process."""
    got = _call(group, rank, world_size, op="all_gather", numel=300, bits=8, block=64, dtype=torch.float32,
                redop=ReduceOp.SUM)
    want = torch.cat([_roundtrip(torch.full((300,), r + 1.0), 8, 64) for r in range(world_size)])
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"all_gather after {what}")
    got = _call(group, rank, world_size, op="reduce_scatter", numel=300, bits=4, block=32, dtype=torch.float32,
                redop=ReduceOp.SUM)
    ranks_on = group.transport.levels()[2] if group.transport.kind == "hierarchical" else None
    want = _expected_reduce_scatter([torch.full((world_size * 300,), r + 1.0) for r in range(world_size)], rank, 300,
                                    4, 32, ranks_on)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"reduce_scatter after {what}")


def _disagreements(rank: int, world_size: int, kind: str) -> list[str]:
    """Every case of MISMATCHES, the odd rank going round: each must raise a
    ValueError on every rank, and the group must work after it."""
    if kind == "hierarchical":
        os.environ["RINGCOMM_HOST"] = ("a", "a", "b", "b")[rank]
    group = ringcomm.new_group(transport=kind, timeout=10.0, shm=SMALL_CMA, torch_dist=SMALL_TORCH_DIST)
    messages = []
    for case, (every, odd) in enumerate(MISMATCHES):
        call = {**DEFAULT_CALL, **every, **(odd if rank == case % world_size else {})}
        what = f"{kind} rank {rank} case {case} {call}"
        with pytest.raises(ValueError, match="disagree") as info:
            _call(group, rank, world_size, **call)
        messages.append(str(info.value))
        _check_still_works(group, rank, world_size, what)
    group.close()
    if kind == "hierarchical":
        _check_calls_off(rank, world_size)
    return messages


def _check_calls_off(rank: int, world_size: int) -> None:
    """With TorchDistOptions.check_calls off a hierarchical group exchanges no
    records across hosts, as a torch_dist group compares nothing, and still
    gives the right numbers, empty calls included; its barrier still agrees."""
    options = ringcomm.TorchDistOptions(segment_nbytes=96, check_calls=False)
    group = ringcomm.new_group(transport="hierarchical", timeout=10.0, shm=SMALL_CMA, torch_dist=options)
    shares = []
    share = group.transport.cross.share
    group.transport.cross.share = lambda op, mine: shares.append(op) or share(op, mine)
    _check_still_works(group, rank, world_size, "check_calls=False")
    for op in ("all_gather", "reduce_scatter"):
        assert _call(group, rank, world_size, op=op, numel=0, **DEFAULT_CALL).numel() == 0
    assert shares == [], f"rank {rank}: records crossed hosts with check_calls=False: {shares}"
    ringcomm.barrier(group=group)
    assert shares == ["barrier"], f"rank {rank}: {shares}"
    group.close()


def _named(value: object) -> str:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else \
        value.name if isinstance(value, ReduceOp) else str(value)


@pytest.mark.parametrize("kind,world_size", [("shm", 2), ("hierarchical", 4)])
def test_quantized_disagreements_raise_on_every_rank(kind, world_size):
    messages = run_ranks(_disagreements, world_size, kind, timeout=120)
    for case, (every, odd) in enumerate(MISMATCHES):
        seen = {m[case] for m in messages}
        assert len(seen) == 1, f"case {case}: the ranks' errors differ: {seen}"
        message = seen.pop()
        assert message.startswith(f"quantized_{every['op']}: ranks disagree"), message
        for field, value in odd.items():
            name = "numel" if field == "numel" else field if field != "redop" else "op"
            usual = {**DEFAULT_CALL, **every}[field]
            for shown in (value, usual):
                assert f"{name} {_named(shown)}" in message, f"case {case}: {name} {_named(shown)} not in {message}"
