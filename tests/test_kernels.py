"""Single-process tier: the C++ reduction kernel against plain torch."""
from __future__ import annotations

import pytest
import torch

from ringcomm.kernels import reduce_into
from ringcomm.ops import ReduceOp

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
SIZES = [0, 1, 3, 17, 1023, 1025, 4099]


def random_tensor(numel: int, dtype: torch.dtype, op: ReduceOp, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    high = 4 if op == ReduceOp.PRODUCT else 1000
    return torch.randint(-high, high, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def reference(srcs: list[torch.Tensor], op: ReduceOp, divisor: int) -> torch.Tensor:
    """float64 (or int64) arithmetic, one rounding into the dtype at the end."""
    dtype = srcs[0].dtype
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stacked = torch.stack([s.to(wide) for s in srcs])
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        out = stacked.sum(0)
        if op == ReduceOp.AVG:
            out = out / divisor if dtype.is_floating_point else torch.div(out, divisor, rounding_mode="trunc")
    elif op == ReduceOp.PRODUCT:
        out = stacked.prod(0)
    elif op == ReduceOp.MIN:
        out = stacked.amin(0)
    else:
        out = stacked.amax(0)
    return out.to(dtype)


def assert_close(actual, expected, dtype, what):
    if not dtype.is_floating_point:
        assert torch.equal(actual, expected), what
    elif dtype in (torch.bfloat16, torch.float16):
        # float32 accumulation then one rounding: at most one 16-bit ulp from the float64 result.
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10,
                                   atol=1e-3, msg=what)
    else:
        # float32 accumulation in a different order than float64: a few float32 ulps.
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
def test_reduce_matches_torch(dtype, op):
    gen = torch.Generator().manual_seed(1234 + int(op))
    for num_srcs in (1, 2, 3, 4):
        for numel in SIZES:
            srcs = [random_tensor(numel, dtype, op, gen) for _ in range(num_srcs)]
            expected = reference(srcs, op, divisor=num_srcs)
            out = torch.empty(numel, dtype=dtype)
            reduce_into(out, srcs, op, divisor=num_srcs)
            what = f"{dtype} {op.name} num_srcs={num_srcs} numel={numel}"
            assert_close(out, expected, dtype, what)
            reduce_into(srcs[0], srcs, op, divisor=num_srcs)  # in place: dst is the first source
            assert_close(srcs[0], expected, dtype, what + " in place")


def test_low_precision_rounds_once():
    # 1 + 3 * 2^-9: each bf16 partial sum 1 + 2^-9 rounds back to 1 (ties to even),
    # while the float32 sum rounds once to 1 + 2^-7.
    for dtype, tiny in ((torch.bfloat16, 2 ** -9), (torch.float16, 2 ** -12)):
        srcs = [torch.ones(5, dtype=dtype)] + [torch.full((5,), tiny, dtype=dtype) for _ in range(3)]
        running = srcs[0].clone()
        for s in srcs[1:]:
            running = running + s
        expected = (1 + 3 * torch.tensor(tiny, dtype=torch.float32)).to(dtype)
        assert not torch.equal(running, expected.expand(5)), "the case must separate the two roundings"
        out = torch.empty(5, dtype=dtype)
        reduce_into(out, srcs, ReduceOp.SUM)
        assert torch.equal(out, expected.expand(5)), (dtype, out)


def test_integer_sum_wraps_like_torch():
    big = torch.tensor([2 ** 31 - 1, -(2 ** 31)], dtype=torch.int32)
    out = torch.empty(2, dtype=torch.int32)
    reduce_into(out, [big, big], ReduceOp.SUM)
    assert torch.equal(out, big + big)


def test_min_max_propagate_nan():
    a = torch.tensor([float("nan"), 1.0, 2.0])
    b = torch.tensor([0.0, float("nan"), 1.0])
    for op, torch_fn in ((ReduceOp.MIN, torch.minimum), (ReduceOp.MAX, torch.maximum)):
        out = torch.empty(3)
        reduce_into(out, [a, b], op)
        torch.testing.assert_close(out, torch_fn(a, b), equal_nan=True)


def test_bad_arguments():
    with pytest.raises(ValueError):
        reduce_into(torch.empty(3), [torch.empty(4)], ReduceOp.SUM)
    with pytest.raises(ValueError):
        reduce_into(torch.empty(3), [torch.empty(3, dtype=torch.float64)], ReduceOp.SUM)
    with pytest.raises(TypeError):
        reduce_into(torch.empty(3, dtype=torch.uint8), [torch.empty(3, dtype=torch.uint8)], ReduceOp.SUM)
    with pytest.raises(ValueError):
        reduce_into(torch.empty(6)[::2], [torch.empty(3)], ReduceOp.SUM)
