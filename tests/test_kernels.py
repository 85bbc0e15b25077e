"""Single-process tier: the C++ reduction kernel against plain torch."""
from __future__ import annotations

import pytest
import torch

from ringcomm.kernels.cpu import reduce_into
from ringcomm.core.ops import ReduceOp

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


# ---- 16-bit floats with +-inf and nan: float32 arithmetic in source order, one rounding ----
SPECIAL = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
FINITE = (0.0, -0.0, 1.5, -2.0, 3.0, 0.25)
LARGEST = {torch.bfloat16: torch.finfo(torch.bfloat16).max, torch.float16: torch.finfo(torch.float16).max}
HALF_ULP_OF_LARGEST = {torch.bfloat16: 2.0 ** 119, torch.float16: 16.0}  # 2**(emax - mantissa bits - 1)


def float32_reference(srcs: list[torch.Tensor], op: ReduceOp, divisor: int) -> torch.Tensor:
    """What the kernels claim for 16-bit floats: widen, combine in source order in
    float32 (min/max propagate nan, as torch.minimum), divide for avg, round once."""
    combine = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
               ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}[op]
    acc = srcs[0].float()
    for src in srcs[1:]:
        acc = combine(acc, src.float())
    if op == ReduceOp.AVG:
        acc = acc / divisor
    return acc.to(srcs[0].dtype)


def with_specials(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Finite values whose float32 sums and products are exact, with about one
    element in three +inf, -inf or nan, anywhere (vector body and scalar tail)."""
    values = torch.tensor(FINITE + tuple(SPECIAL.values()))
    picks = torch.randint(0, len(values), (numel,), generator=gen)
    picks = torch.where(torch.rand(numel, generator=gen) < 0.6, picks % len(FINITE), picks)
    return values[picks].to(dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # exact: the inputs make every float32 result exact, so only the one rounding is left
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
def test_low_precision_inf_and_nan(dtype, op):
    gen = torch.Generator().manual_seed(99 + int(op))
    for num_srcs in (1, 2, 3, 4):  # 1: the cast paths alone (widen, narrow)
        for numel in (1, 7, 8, 9, 31, 1031):  # F16C converts 8 at a time, then a scalar tail; 1031 > one block
            srcs = [with_specials(numel, dtype, gen) for _ in range(num_srcs)]
            want = float32_reference(srcs, op, divisor=num_srcs)
            got = torch.full((numel,), 7.0, dtype=dtype)
            reduce_into(got, srcs, op, divisor=num_srcs)
            assert_same(got, want, f"{dtype} {op.name} num_srcs={num_srcs} numel={numel}")
    # each special against each special and a finite value, element by element
    names = list(SPECIAL) + ["1.5", "-0.0"]
    pairs = [(a, b) for a in names for b in names]
    left = torch.tensor([float(a) for a, _ in pairs]).to(dtype)
    right = torch.tensor([float(b) for _, b in pairs]).to(dtype)
    got = torch.empty_like(left)
    reduce_into(got, [left, right], op, divisor=2)
    want = float32_reference([left, right], op, divisor=2)
    for index, (a, b) in enumerate(pairs):
        assert_same(got[index], want[index], f"{dtype} {op.name}: {a} with {b}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_overflow_rounds_to_inf(dtype):
    """Finite 16-bit inputs whose float32 result lies past the largest finite
    16-bit value: rounding to nearest even gives +-inf, one half ulp below stays finite."""
    largest = LARGEST[dtype]
    half_ulp = HALF_ULP_OF_LARGEST[dtype]
    cases = [  # (a, b, expected a + b) in the dtype
        (largest, largest, float("inf")),
        (-largest, -largest, float("-inf")),
        (largest, half_ulp, float("inf")),  # a tie: largest has an odd last bit, so it rounds up
        (largest, half_ulp / 2, largest),
        (-largest, -half_ulp, float("-inf")),
    ]
    for a, b, expected in cases:
        srcs = [torch.full((9,), a).to(dtype), torch.full((9,), b).to(dtype)]
        assert srcs[1][0].item() == b, f"{dtype}: {b} must be exact in the dtype"
        for op, want in ((ReduceOp.SUM, expected), (ReduceOp.AVG, None)):
            got = torch.empty(9, dtype=dtype)
            reduce_into(got, srcs, op, divisor=2)
            reference = float32_reference(srcs, op, divisor=2)
            assert_same(got, reference, f"{dtype} {op.name} {a} + {b}")
            if want is not None:
                assert got[0].item() == want, f"{dtype}: {a} + {b} = {got[0].item()}, expected {want}"
    product = torch.empty(9, dtype=dtype)
    reduce_into(product, [torch.full((9,), largest).to(dtype), torch.full((9,), -2.0).to(dtype)], ReduceOp.PRODUCT)
    assert torch.all(product == float("-inf")), f"{dtype}: largest * -2 = {product}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_to_16_bit_copy_keeps_inf_and_nan(dtype):
    """The other cast path: adam_step's 16-bit copy of an fp32 master (store_float).
    With lr=0 and a zero gradient the master is unchanged and the copy is a pure
    cast, which must equal torch's fp32 -> 16-bit rounding, nan payloads included."""
    from ringcomm import _C
    from ringcomm.core.ops import dtype_code

    largest, half_ulp = LARGEST[dtype], HALF_ULP_OF_LARGEST[dtype]
    nan_payloads = torch.tensor([0x7FFFFFFF, 0x7F800001, 0xFFC00000 - 2 ** 32, 0x7FC0FFFF], dtype=torch.int32)
    master = torch.cat([torch.tensor([float("inf"), float("-inf"), float("nan"), 1.5, -0.0, largest,
                                      largest + half_ulp, -(largest + half_ulp), largest + half_ulp / 2,
                                      3.0e38, -7.0e4]), nan_payloads.view(torch.float32)])
    master = master.repeat(3)  # 45 elements: the vectorized loop and its tail
    numel = master.numel()
    grad, exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    before, want = master.clone(), master.to(dtype)
    out = torch.full((numel,), 7.0, dtype=dtype)
    _C.adam_step(master.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), out.data_ptr(),
                 dtype_code(dtype, where="test"), numel, 0.0, 0.9, 0.999, 1e-8, 0.0, 1, 1.0, True, 1)
    # AdamW with lr=0 leaves every master as it was, inf included (torch's AdamW adds no
    # weight-decay term to the gradient, so 0 * inf never makes a nan)
    assert_same(master, before, f"{dtype} adam_step master")
    assert_same(out, want, f"{dtype} adam_step copy-out")


def test_bfloat16_subnormals_survive_the_rounding():
    """bfloat16 subnormals (k * 2^-133) summed in float32 round back to the same subnormal sums
    as torch's conversion, in vectors of 16 holding only subnormals and in vectors where one
    lane is normal (a hardware conversion that flushes subnormals to zero gives 0 for these)."""
    gen = torch.Generator().manual_seed(3)
    for normal_lane in (False, True):
        srcs = []
        for _ in range(3):
            k = torch.randint(-40, 41, (4099,), generator=gen).to(torch.float32)
            s = (k * 2.0 ** -133).to(torch.bfloat16)
            if normal_lane:
                s[::16] = 1.5
            srcs.append(s)
        assert bool(srcs[0].float().abs()[1:16].gt(0).any()), "the case must hold subnormals"
        expected = (srcs[0].float() + srcs[1].float() + srcs[2].float()).to(torch.bfloat16)
        out = torch.empty(4099, dtype=torch.bfloat16)
        reduce_into(out, srcs, ReduceOp.SUM)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"{normal_lane=}"
