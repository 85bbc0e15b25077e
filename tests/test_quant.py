"""The blockwise quantization kernels (ringcomm.kernels.quant, csrc/cpu/kernels/quant.cpp) against the plain-torch
reference of tests/quant_reference.py, bit for bit; the round-trip error bound; NaN and inf; the
fused dequantize_sum; and every argument error."""
from __future__ import annotations

import pytest
import quant_reference as ref
import torch

from ringcomm.kernels import quant

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMATS = [(8, 1), (8, 7), (8, 64), (8, 4096), (4, 2), (4, 6), (4, 64), (4, 1024)]
NUMELS = [1, 2, 3, 5, 63, 1023, 1025, 4097, 10007]


def random_input(numel: int, dtype: torch.dtype, block: int, gen: torch.Generator) -> torch.Tensor:
    """Normal values with a magnitude that changes block by block (1e-4 .. 1e3)."""
    x = torch.randn(numel, generator=gen)
    num_blocks = -(-numel // block)
    magnitude = 10.0 ** torch.empty(num_blocks).uniform_(-4, 3, generator=gen)
    return (x * magnitude.repeat_interleave(block)[:numel]).to(dtype)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.dtype.is_floating_point:
        nan = torch.isnan(actual)
        assert torch.equal(nan, torch.isnan(expected)), f"{what}: NaN positions differ"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
        actual, expected = actual.masked_fill(nan, 0).view(bits), expected.masked_fill(nan, 0).view(bits)
    if not torch.equal(actual, expected):
        where = (actual != expected).nonzero()
        raise AssertionError(f"{what}: {where.numel()} differ, first at {where[0].item()}: "
                             f"{actual[where[0]].item()} != {expected[where[0]].item()}")


def check_against_reference(x: torch.Tensor, bits: int, block: int, what: str) -> None:
    data, scales = quant.quantize(x, bits=bits, block=block)
    ref_data, ref_scales = ref.quantize(x, bits=bits, block=block)
    assert_same_bits(data, ref_data, f"{what}: data")
    assert_same_bits(scales, ref_scales, f"{what}: scales")
    out = quant.dequantize(data, scales, torch.empty_like(x), bits=bits, block=block)
    assert_same_bits(out, ref.dequantize(data, scales, x.numel(), x.dtype, bits=bits, block=block).view_as(x),
                     f"{what}: dequantized")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,block", FORMATS)
def test_matches_reference_bit_for_bit(dtype, bits, block):
    gen = torch.Generator().manual_seed(bits * 1000 + block)
    for numel in NUMELS:
        check_against_reference(random_input(numel, dtype, block, gen), bits, block, f"{dtype} {bits=} {block=} {numel=}")


def adversarial_blocks(block: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Blocks of zeros, one huge value among tiny ones, equal values, negatives only, +-absmax
    exactly, ties of x * inv, and (float32, bfloat16) an absmax so small that qmax / absmax is inf."""
    gen = torch.Generator().manual_seed(block)
    small = torch.rand(block, generator=gen) * 1e-3
    blocks = [torch.zeros(block), small.clone().index_fill_(0, torch.tensor([block // 2]), 3e4),
              torch.full((block,), 0.37), -torch.rand(block, generator=gen) - 0.1,
              torch.where(torch.rand(block, generator=gen) > 0.5, 5.0, -5.0),
              (torch.arange(block) % 15 - 7).float() * 0.5 + 0.25, torch.full((block,), -1e-3)]
    if dtype != torch.float16:
        blocks.append(torch.tensor([1e-39, 0.0, -1e-39, 5e-40] * block)[:block])
    return [b.to(dtype) for b in blocks]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,block", [(8, 64), (8, 7), (4, 64), (4, 2)])
def test_round_trip_error_bound(dtype, bits, block):
    gen = torch.Generator().manual_seed(bits + block)
    x = torch.cat([*adversarial_blocks(block, dtype), random_input(50 * block + 1, dtype, block, gen)])
    check_against_reference(x, bits, block, f"{dtype} {bits=} {block=} adversarial")
    data, scales = quant.quantize(x, bits=bits, block=block)
    out = quant.dequantize(data, scales, torch.empty_like(x), bits=bits, block=block).float()
    wide = x.float()
    scale = scales.repeat_interleave(block)[: x.numel()]
    absmax = wide.abs().view(-1)[: x.numel() // block * block].view(-1, block).amax(1).repeat_interleave(block)
    absmax = torch.cat([absmax, wide[absmax.numel():].abs().amax().expand(x.numel() - absmax.numel())])
    # scale / 2 from rounding to an integer; a few float32 ulps of absmax from inv, x * inv and
    # scale; one rounding of the output dtype at the value.
    tol = scale / 2 + absmax * 2 ** -21 + wide.abs() * torch.finfo(dtype).eps
    # absmax < qmax / FLT_MAX (below 4e-37): inv = inf, so every nonzero q is +-qmax
    tol = torch.where(absmax < (2 ** (bits - 1) - 1) / torch.finfo(torch.float32).max, absmax, tol)
    err = (out - wide).abs()
    assert bool((err <= tol).all()), f"{dtype} {bits=} {block=}: max excess {(err - tol).max().item()}"
    assert torch.equal(out[:block], torch.zeros(block)), "an all-zero block comes back zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,block", [(8, 16), (4, 16)])
def test_nan_and_inf_poison_only_their_block(dtype, bits, block):
    x = torch.randn(6 * block + 3).to(dtype)
    x[block + 3], x[3 * block], x[4 * block + 1], x[6 * block + 2] = float("nan"), float("inf"), -float("inf"), float("nan")
    data, scales = quant.quantize(x, bits=bits, block=block)
    out = quant.dequantize(data, scales, torch.empty_like(x), bits=bits, block=block)
    bad = {1, 3, 4, 6}
    for b in range(7):
        piece = out[b * block:(b + 1) * block]
        if b in bad:
            assert bool(torch.isnan(piece).all()) and torch.isnan(scales[b]), f"{dtype} {bits=} block {b}"
        else:
            assert bool(torch.isfinite(piece).all()) and torch.isfinite(scales[b]), f"{dtype} {bits=} block {b}"
    expected_zero = 0 if bits == 8 else 0x88
    per_block = block * bits // 8  # bytes
    assert bool((data[per_block:2 * per_block] == expected_zero).all()), "q = 0 in a NaN block"
    check_against_reference(x, bits, block, f"{dtype} {bits=} with NaN/inf")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,block", [(8, 4096), (8, 5), (4, 1024), (4, 6)])
def test_dequantize_sum(dtype, bits, block):
    gen = torch.Generator().manual_seed(7 * bits + block)
    for numel in (1, 7, 5001):
        for k in (1, 2, 3, 4):
            rows = [quant.quantize(random_input(numel, dtype, block, gen), bits=bits, block=block) for _ in range(k)]
            data, scales = torch.stack([r.data for r in rows]), torch.stack([r.scales for r in rows])
            out = quant.dequantize_sum(data, scales, torch.empty(numel, dtype=dtype), bits=bits, block=block)
            what = f"{dtype} {bits=} {block=} {numel=} {k=}"
            assert_same_bits(out, ref.dequantize_sum(data, scales, numel, dtype, bits=bits, block=block), what)
            wide = [quant.dequantize(d, s, torch.empty(numel), bits=bits, block=block) for d, s in rows]
            total = wide[0]
            for w in wide[1:]:
                total = total + w
            assert_same_bits(out, total.to(dtype), what + ": float32 sum of dequantize, cast once")


def test_views_into_a_byte_buffer_and_shapes():
    x = torch.randn(3, 333, dtype=torch.bfloat16)  # any contiguous shape is read flat
    bits, block = 4, 64
    nbytes, nscales = quant.packed_nbytes(x.numel(), bits), quant.num_blocks(x.numel(), block)
    buf = torch.zeros(7 + nbytes + 1 + 4 * nscales, dtype=torch.uint8)
    data, scales = buf[7:7 + nbytes], buf[8 + nbytes:8 + nbytes + 4 * nscales].view(torch.float32)
    quant.quantize_into(x, data, scales, bits=bits, block=block)
    ref_data, ref_scales = ref.quantize(x, bits=bits, block=block)
    assert_same_bits(data, ref_data, "data in a buffer")
    assert_same_bits(scales, ref_scales, "scales in a buffer")
    assert buf[:7].eq(0).all() and buf[7 + nbytes] == 0, "nothing written outside the views"
    out = quant.dequantize(data, scales, torch.empty_like(x), bits=bits, block=block)
    assert out.shape == x.shape


def test_sizes_and_empty():
    assert [quant.packed_nbytes(n, 4) for n in (0, 1, 2, 3)] == [0, 1, 1, 2]
    assert [quant.packed_nbytes(n, 8) for n in (0, 1, 3)] == [0, 1, 3]
    assert [quant.num_blocks(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert (quant.WEIGHT_BITS, quant.WEIGHT_BLOCK, quant.GRAD_BITS, quant.GRAD_BLOCK) == (8, 4096, 4, 1024)
    data, scales = quant.quantize(torch.empty(0), bits=4, block=2)
    assert data.numel() == 0 and scales.numel() == 0
    quant.dequantize(data, scales, torch.empty(0), bits=4, block=2)
    quant.dequantize_sum(data.view(1, 0), scales.view(1, 0), torch.empty(0), bits=4, block=2)


def test_errors():
    x, out = torch.randn(10), torch.empty(10)
    data, scales = quant.quantize(x, bits=8, block=4)
    with pytest.raises(TypeError, match="float64.*expected"):
        quant.quantize(x.double(), bits=8, block=4)
    with pytest.raises(TypeError, match="int32"):
        quant.dequantize(data, scales, out.int(), bits=8, block=4)
    with pytest.raises(ValueError, match="contiguous"):
        quant.quantize(torch.randn(20)[::2], bits=8, block=4)
    with pytest.raises(ValueError, match="contiguous"):
        quant.dequantize(data, scales, torch.empty(20)[::2], bits=8, block=4)
    with pytest.raises(ValueError, match="bits=2"):
        quant.quantize(x, bits=2, block=4)
    for bits, block in ((8, 0), (4, 3), (4, -2)):
        with pytest.raises(ValueError, match=f"block={block}"):
            quant.quantize(x, bits=bits, block=block)
    with pytest.raises(ValueError, match=r"data has numel \(9,\); expected \(10,\)"):
        quant.quantize_into(x, data[:9], scales, bits=8, block=4)
    with pytest.raises(ValueError, match=r"scales has numel \(3,\); expected \(2,\)"):
        quant.quantize_into(x, data, scales, bits=8, block=5)
    with pytest.raises(TypeError, match="scales has dtype torch.float16; expected torch.float32"):
        quant.dequantize(data, scales.half(), out, bits=8, block=4)
    with pytest.raises(TypeError, match="data has dtype torch.int8; expected torch.uint8"):
        quant.quantize_into(x, data.view(torch.int8), scales, bits=8, block=4)
    with pytest.raises(ValueError, match="contiguous"):
        quant.quantize_into(x, torch.empty(20, dtype=torch.uint8)[::2], scales, bits=8, block=4)
    with pytest.raises(ValueError, match="2-D"):
        quant.dequantize_sum(data, scales, out, bits=8, block=4)
    with pytest.raises(ValueError, match=r"scales has shape \(1, 2\); expected \(1, 3\)"):
        quant.dequantize_sum(data.view(1, -1), torch.zeros(1, 2), out, bits=8, block=4)
    with pytest.raises(ValueError, match=r"data has shape \(2, 5\); expected \(2, 10\)"):
        quant.dequantize_sum(data.view(2, 5), scales.view(1, 3), out, bits=8, block=4)


@pytest.mark.parametrize("bits,block,error,text", [
    (8, 3.0, TypeError, "block=3.0 must be an int, got float"),
    (8.0, 4, TypeError, "bits=8.0 must be an int, got float"),
    (8, True, TypeError, "block=True must be an int, got bool"),  # was taken as block=1
    (True, 4, TypeError, "bits=True must be an int, got bool"),
    (8, 2**63, ValueError, r"block=9223372036854775808 is out of range: expected an int in \[1, 2147483648\]"),
])
def test_bits_and_block_are_checked_before_cpp(bits, block, error, text):
    """Checked in Python, naming the argument, before torch.empty or pybind11 see them."""
    x, out = torch.randn(10), torch.empty(10)
    data, scales = quant.quantize(x, bits=8, block=4)
    calls = {"quantize": lambda: quant.quantize(x, bits=bits, block=block),
             "quantize_into": lambda: quant.quantize_into(x, data, scales, bits=bits, block=block),
             "dequantize": lambda: quant.dequantize(data, scales, out, bits=bits, block=block),
             "dequantize_sum": lambda: quant.dequantize_sum(data.view(1, -1), scales.view(1, -1), out, bits=bits,
                                                            block=block)}
    for name, call in calls.items():
        with pytest.raises(error, match=rf"^{name} \(.*\): {text}"):
            call()
    with pytest.raises(TypeError, match="num_blocks: block=2.5 must be an int"):
        quant.num_blocks(10, 2.5)
    with pytest.raises(TypeError, match="packed_nbytes: numel=10.0 must be an int"):
        quant.packed_nbytes(10.0, 8)


def test_cpp_checks_its_arguments():
    from ringcomm import _C

    with pytest.raises(ValueError, match="bits=3"):
        _C.quantize(0, 0, 4, 0, 0, 3, 4)
    with pytest.raises(ValueError, match="block=3"):
        _C.dequantize_sum(0, 0, 1, 0, 0, 4, 4, 3)
    with pytest.raises(ValueError, match="dtype code 1"):
        _C.quantize(0, 1, 4, 0, 0, 8, 4)
    with pytest.raises(ValueError, match="num_rows=0"):
        _C.dequantize_sum(0, 0, 0, 0, 0, 4, 8, 4)


# ---- the kernels' threads (csrc/cpu/parallel.cpp) ----
def _quantize_round_trip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """data, scales and dequantized values of x (int4, blocks of 1024)."""
    data, scales = quant.quantize(x, bits=4, block=1024)
    return data, scales, quant.dequantize(data, scales, torch.empty_like(x), bits=4, block=1024)


def _child_quantize(x, queue) -> None:
    # Only ringcomm's kernels here: torch's own parallel ops hang in a child forked after the
    # parent ran them (GNU OpenMP is not fork-safe).
    torch.set_num_threads(4)
    queue.put([t.view(torch.uint8).numpy().tobytes() for t in _quantize_round_trip(x)])


def test_kernel_threads_under_concurrent_calls_and_after_fork():
    """Kernels called from several threads at once, each splitting its work over 4 threads, match
    the reference; a child forked after the parent ran them on several threads runs them on its
    own (GNU OpenMP's threads do not survive a fork: a parallel region there waits forever)."""
    import multiprocessing
    import threading

    gen = torch.Generator().manual_seed(11)
    inputs = [random_input(1 << 18, torch.bfloat16, 1024, gen) for _ in range(4)]
    expected = []
    for x in inputs:
        data, scales = ref.quantize(x, bits=4, block=1024)
        expected.append((data, scales, ref.dequantize(data, scales, x.numel(), x.dtype, bits=4, block=1024)))
    results, errors = {}, []

    def run(i: int) -> None:
        try:
            results[i] = [_quantize_round_trip(inputs[i]) for _ in range(20)]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    previous = torch.get_num_threads()
    torch.set_num_threads(4)  # process-wide: set once here, not from the threads
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        torch.set_num_threads(previous)
    assert not errors and all(not t.is_alive() for t in threads), errors
    for i, runs in results.items():
        for out in runs:
            for got, want, name in zip(out, expected[i], ("data", "scales", "dequantized")):
                assert_same_bits(got, want, f"thread {i}: {name}")

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_quantize, args=(inputs[0], queue))
    child.start()
    try:
        out = queue.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    for got, want, name in zip(out, expected[0], ("data", "scales", "dequantized")):
        assert got == want.view(torch.uint8).numpy().tobytes(), f"forked child: {name}"
