"""The CUDA kernels of csrc/cuda/reduce.cu, in three tiers:
1. nvcc compiles them (sm_90, and PTX for nvcc's default arch), the host launchers link and
   reject bad arguments (needs nvcc only);
2. their device code, compiled by g++ and run thread by emulated thread through
   ringcomm.kernels.cuda, matches the C++ kernel bit for bit (needs a C++ compiler only);
3. on a GPU with CuPy: the real launches against plain torch and the C++ kernel."""
from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ringcomm.kernels import cuda as cuda_kernels
from ringcomm.kernels.cpu import reduce_into as cpu_reduce_into
from ringcomm.kernels.cpu import reference_reduce
from ringcomm.core.ops import ReduceOp

CUDA_DIR = Path(__file__).resolve().parent.parent / "csrc" / "cuda"
SOURCE = CUDA_DIR / "reduce.cu"
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
SIZES = [0, 1, 7, 31, 4099, 20011]
NUM_SRCS = [1, 2, 3, 8, 9, 17]  # 9 and 17 take more than one launch
C_TYPES = {"unsigned long long": (np.uint64, ctypes.c_ulonglong), "int": (np.int32, ctypes.c_int),
           "long long": (np.int64, ctypes.c_longlong)}
GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def kernel_params(name: str) -> list[str]:
    """C types of the parameters of the extern "C" kernel `name`, read from the source."""
    match = re.search(r'extern "C" __global__ void ' + name + r"\(([^)]*)\)", SOURCE.read_text())
    assert match, f"kernel {name} not found in {SOURCE}"
    return [" ".join(param.split()[:-1]) for param in match.group(1).split(",")]


def source_constant(name: str) -> int:
    return int(re.search(rf"const int {name} = (\d+);", SOURCE.read_text()).group(1))


# ---- tier 1: nvcc ---------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.slow
def test_nvcc_compiles_and_launchers_link(tmp_path):
    jobs = []  # a full build (host code, device code through ptxas) for sm_90, PTX for nvcc's default arch
    for source in sorted(CUDA_DIR.glob("*.cu")):
        for flags, out in ((["-c", "-arch=sm_90", "-Xcompiler", "-fPIC"], tmp_path / f"{source.stem}.o"),
                           (["--ptx"], tmp_path / f"{source.stem}.ptx")):
            cmd = ["nvcc", *flags, str(source), "-o", str(out), "--Werror", "all-warnings"]
            jobs.append((cmd, out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for cmd, _, job in jobs:
        output = job.communicate(timeout=240)[0]
        assert job.returncode == 0, f"{' '.join(cmd)} failed ({job.returncode}):\n{output}"
    library = tmp_path / "libringcomm_cuda.so"
    link = ["nvcc", "-shared", "-o", str(library), *(str(out) for _, out, _ in jobs if out.suffix == ".o")]
    result = subprocess.run(link, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(link)} failed:\n{result.stdout}{result.stderr}"

    # Argument checks return cudaErrorInvalidValue (1) before any CUDA call, so they run without a GPU.
    lib = ctypes.CDLL(str(library))
    reduce_n, cast = lib.ringcomm_cuda_reduce_n, lib.ringcomm_cuda_cast
    reduce_n.argtypes = [ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int, ctypes.c_longlong,
                         ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong]
    cast.argtypes = [ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_longlong,
                     ctypes.c_ulonglong]
    srcs = (ctypes.c_ulonglong * 9)()
    bad_reduce = {"no sources": (0, 4, 0, 0, 1), "9 sources": (9, 4, 0, 0, 1), "numel < 0": (2, -1, 0, 0, 1),
                  "dtype 6": (2, 4, 6, 0, 1), "op 5": (2, 4, 0, 5, 1), "avg divisor 0": (2, 4, 0, 1, 0)}
    for case, (num_srcs, numel, dtype, op, divisor) in bad_reduce.items():
        assert reduce_n(0, srcs, num_srcs, numel, dtype, op, divisor, 0) == 1, case
    assert reduce_n(0, srcs, 2, 0, 0, 0, 1, 0) == 0, "numel 0 is a no-op"
    assert cast(0, 5, 0, 0, 4, 0) == 1, "int64 <- float32 is not a cast it offers"
    assert cast(0, 2, 0, 3, 4, 0) == 1, "bf16 <- fp16 is not a cast it offers"
    assert cast(0, 2, 0, 0, 0, 0) == 0, "numel 0 is a no-op"

    # quant.cu's launchers: (dtype, numel, bits, block[, num_rows]) checked the same way
    quantize, dequantize_sum = lib.ringcomm_cuda_quantize, lib.ringcomm_cuda_dequantize_sum
    quantize.argtypes = [ctypes.c_ulonglong, ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_ulonglong,
                         ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong]
    dequantize_sum.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int,
                               ctypes.c_longlong, ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong]
    for case, (dtype, numel, bits, block) in {"float64": (1, 4, 8, 4), "bits 3": (0, 4, 3, 4), "block 0": (0, 4, 8, 0),
                                              "odd int4 block": (2, 4, 4, 3), "numel < 0": (0, -1, 8, 4)}.items():
        assert quantize(0, dtype, numel, 0, 0, bits, block, 0) == 1, case
        assert dequantize_sum(0, 0, 1, 0, dtype, numel, bits, block, 0) == 1, case
    assert dequantize_sum(0, 0, 0, 0, 0, 4, 8, 4, 0) == 1, "no rows"
    assert quantize(0, 0, 0, 0, 0, 4, 2, 0) == 0 and dequantize_sum(0, 0, 2, 0, 3, 0, 8, 4, 0) == 0, "numel 0"


def test_device_code_needs_no_header():
    # NVRTC (CuPy) compiles the file as it is: any #include must sit in the nvcc-only host part.
    device_part = SOURCE.read_text().split("#if defined(__CUDACC__) && !defined(__CUDACC_RTC__)")[0]
    assert "#include" not in device_part


def test_python_matches_kernel_signatures():
    assert cuda_kernels.MAX_SOURCES == source_constant("kMaxSources")
    assert cuda_kernels.THREADS == source_constant("kThreads")
    assert cuda_kernels.MAX_BLOCKS == source_constant("kMaxBlocks")
    t = torch.zeros(4)
    for name, args in (("ringcomm_reduce", cuda_kernels._reduce_args(t, [t, t], ReduceOp.AVG, 2)),
                       ("ringcomm_cast", cuda_kernels._cast_args(t.half(), t))):
        expected = [C_TYPES[c][0] for c in kernel_params(name)]
        assert [type(a) for a in args] == expected, name


def test_imports_and_reports_availability():
    if not torch.cuda.is_available():
        assert not cuda_kernels.available()
    with pytest.raises(ValueError, match="CUDA tensors"):
        cuda_kernels.reduce_into(torch.zeros(3), [torch.zeros(3)], ReduceOp.SUM)


# ---- tier 2: the device code on the CPU ------------------------------------------------------

HARNESS = """
#include "reduce.cu"
using namespace ringcomm_cuda;
// The kernels' bodies, with the grid's threads run one after another.
extern "C" void emulate_ringcomm_reduce(Ptr dst, Ptr s0, Ptr s1, Ptr s2, Ptr s3, Ptr s4, Ptr s5, Ptr s6, Ptr s7,
                                        int num_srcs, long long numel, int dtype, int op, long long divisor,
                                        long long num_threads) {
  const ReduceArgs args = {dst, {s0, s1, s2, s3, s4, s5, s6, s7}, num_srcs, numel, op == kAvg, divisor};
  for (long long t = 0; t < num_threads; ++t) reduce_dispatch(args, dtype, op, t, num_threads);
}
extern "C" void emulate_ringcomm_cast(Ptr dst, int dst_dtype, Ptr src, int src_dtype, long long numel,
                                      long long num_threads) {
  for (long long t = 0; t < num_threads; ++t) cast_dispatch(dst, dst_dtype, src, src_dtype, numel, t, num_threads);
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    tmp = tmp_path_factory.mktemp("emulator")
    (tmp / "harness.cpp").write_text(HARNESS)
    library = tmp / "libemulator.so"
    cmd = [compiler, "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off",
           "-Wall", "-Wno-unknown-pragmas", "-Werror", f"-I{CUDA_DIR}", str(tmp / "harness.cpp"), "-o", str(library)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr}"
    lib = ctypes.CDLL(str(library))
    for name in ("ringcomm_reduce", "ringcomm_cast"):
        getattr(lib, "emulate_" + name).argtypes = [C_TYPES[c][1] for c in kernel_params(name)] + [ctypes.c_longlong]
    return lib


@pytest.fixture
def emulated(monkeypatch, emulator):
    """cuda_kernels takes CPU tensors, and each launch runs the emulator with the launch's grid."""
    def launch(name, device, num_blocks, args):
        assert device.type == "cpu" and 1 <= num_blocks <= cuda_kernels.MAX_BLOCKS, (name, device, num_blocks)
        assert [type(a) for a in args] == [C_TYPES[c][0] for c in kernel_params(name)], name
        getattr(emulator, "emulate_" + name)(*(int(a) for a in args), num_blocks * cuda_kernels.THREADS)

    monkeypatch.setattr(cuda_kernels, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(cuda_kernels, "_launch", launch)


# ---- checks shared by tiers 2 and 3 ------------------------------------------------------------

def random_sources(num_srcs, numel, dtype, op, device, gen, layout):
    """`layout`: "aligned" (16-byte), "offset" (all one element in: the scalar head path),
    "mixed" (offsets differ: all scalar)."""
    srcs = []
    for i in range(num_srcs):
        offset = {"aligned": 0, "offset": 1, "mixed": i % 3}[layout]
        if dtype.is_floating_point:
            data = torch.randn(numel + offset, generator=gen, dtype=torch.float64).to(dtype)
        else:
            high = 4 if op == ReduceOp.PRODUCT else 1000
            data = torch.randint(-high, high, (numel + offset,), generator=gen, dtype=torch.int64).to(dtype)
        srcs.append(data.to(device)[offset:])
    return srcs


def assert_same_bits(actual, expected, what):
    actual, expected = actual.cpu(), expected.cpu()
    if actual.dtype.is_floating_point:
        nan = torch.isnan(actual)
        assert torch.equal(nan, torch.isnan(expected)), f"{what}: NaN positions differ"
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
        if nan.any():
            actual, expected = actual.masked_fill(nan, 0), expected.masked_fill(nan, 0)
        actual, expected = actual.view(bits), expected.view(bits)
    if not torch.equal(actual, expected):
        mismatch = (actual != expected).nonzero()
        raise AssertionError(f"{what}: {mismatch.numel()} elements differ, first at {mismatch[0].item()}")


def assert_close_to_torch(actual, srcs, op, divisor, what):
    expected = reference_reduce(srcs, op, divisor)
    if not actual.dtype.is_floating_point:
        assert torch.equal(actual, expected), what
        return
    # torch sums in its own order (the kernel goes in source order): a few float32 ulps, then
    # for 16-bit floats at most one ulp of the one rounding.
    tol = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
           torch.bfloat16: (2 ** -7, 1e-3), torch.float16: (2 ** -10, 1e-3)}[actual.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol[0], atol=tol[1], equal_nan=True, msg=what)


def check_reduce(dtype, op, device, *, large=False):
    gen = torch.Generator().manual_seed(100 * DTYPES.index(dtype) + int(op))
    cases = [(n, numel, "aligned") for n in NUM_SRCS for numel in SIZES]
    cases += [(n, numel, layout) for n in (2, 9) for numel in SIZES for layout in ("offset", "mixed")]
    cases += [(2, 3 * 2 ** 22 + 7, "aligned"), (9, 2 ** 20 + 3, "offset")] if large else []
    for num_srcs, numel, layout in cases:
        what = f"{dtype} {op.name} {num_srcs=} {numel=} {layout}"
        srcs = random_sources(num_srcs, numel, dtype, op, device, gen, layout)
        expected = torch.empty(numel, dtype=dtype)
        cpu_reduce_into(expected, [s.cpu() for s in srcs], op, divisor=num_srcs)
        out = torch.full((numel,), 7, dtype=dtype, device=device)
        cuda_kernels.reduce_into(out, srcs, op, divisor=num_srcs)
        assert_same_bits(out, expected, what)
        if device != "cpu":  # on the CPU this only repeats tests/test_kernels.py
            assert_close_to_torch(out, srcs, op, num_srcs, what)
        if numel:
            dst = srcs[-1]  # in place into the last source: read by the last launch when chained
            cuda_kernels.reduce_into(dst, srcs, op, divisor=num_srcs)
            assert_same_bits(dst, expected, what + " in place")


def check_nan_and_wrap(device):
    nan = float("nan")
    a = torch.tensor([nan, 1.0, 2.0, -0.0, nan], device=device)
    b = torch.tensor([0.0, nan, 1.0, 0.0, 3.0], device=device)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for op, torch_fn in ((ReduceOp.MIN, torch.minimum), (ReduceOp.MAX, torch.maximum)):
            out = torch.empty(5, dtype=dtype, device=device)
            cuda_kernels.reduce_into(out, [a.to(dtype), b.to(dtype)], op)
            expected = torch.empty(5, dtype=dtype)
            cpu_reduce_into(expected, [a.to(dtype).cpu(), b.to(dtype).cpu()], op)
            assert_same_bits(out, expected, f"{dtype} {op.name} with NaN")
            torch.testing.assert_close(out, torch_fn(a, b).to(dtype), equal_nan=True)
    for dtype, big in ((torch.int32, 2 ** 31 - 1), (torch.int64, 2 ** 63 - 1)):
        x = torch.tensor([big, -big - 1, -7], dtype=dtype, device=device)
        out = torch.empty_like(x)
        cuda_kernels.reduce_into(out, [x, x], ReduceOp.SUM)
        assert torch.equal(out, x + x), f"{dtype} sum wraps"
        cuda_kernels.reduce_into(out, [x, x, x], ReduceOp.AVG, divisor=2)
        assert torch.equal(out, torch.div(x + x + x, 2, rounding_mode="trunc")), f"{dtype} avg truncates"


def special_floats():
    values = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65536.0, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25,
              2.0 ** -25 * 1.0001, 3 * 2.0 ** -26, 5 * 2.0 ** -26, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8,
              1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 3.3895e38, float("inf"), float("-inf"), float("nan"), 1e-45]
    ties = torch.cat([(torch.arange(4096) + 0.5) * 2.0 ** -24,  # fp16 subnormals, and on into normals
                      1 + (2 * torch.arange(1024) + 1) * 2.0 ** -11,  # fp16 halfway in [1, 2)
                      1 + (2 * torch.arange(128) + 1) * 2.0 ** -8])  # bf16 halfway in [1, 2)
    bits = torch.randint(-2 ** 31, 2 ** 31, (200_003,), generator=torch.Generator().manual_seed(7), dtype=torch.int64)
    return torch.cat([torch.tensor(values), ties, -ties, bits.to(torch.int32).view(torch.float32)])


def check_cast(device):
    every16 = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    floats = special_floats()
    for dtype in (torch.bfloat16, torch.float16):
        for offset in (0, 1):  # 1: pointers off the vector alignment
            low = every16.view(dtype)[offset:].to(device)
            wide = torch.empty(low.numel(), device=device)
            cuda_kernels.cast_into(wide, low)
            assert_same_bits(wide, low.cpu().float(), f"{dtype} -> float32, every value, {offset=}")
            narrow = torch.empty(floats.numel() - offset, dtype=dtype, device=device)
            cuda_kernels.cast_into(narrow, floats[offset:].to(device))
            assert_same_bits(narrow, floats[offset:].to(dtype), f"float32 -> {dtype}, {offset=}")
            back = torch.empty(narrow.numel(), device=device)
            cuda_kernels.cast_into(back, narrow)
            assert_same_bits(back, narrow.cpu().float(), f"float32 -> {dtype} -> float32, {offset=}")
        for numel in (0, 1, 5):
            src = torch.randn(numel, device=device)
            out = torch.empty(numel, dtype=dtype, device=device)
            cuda_kernels.cast_into(out, src)
            assert_same_bits(out, src.cpu().to(dtype), f"float32 -> {dtype} {numel=}")


def check_errors(device):
    x = torch.zeros(4, device=device)
    with pytest.raises(TypeError, match="uint8"):
        cuda_kernels.reduce_into(x.to(torch.uint8), [x.to(torch.uint8)], ReduceOp.SUM)
    with pytest.raises(TypeError, match="float64"):
        cuda_kernels.reduce_into(x, [x.double()], ReduceOp.SUM)
    with pytest.raises(ValueError, match="numel"):
        cuda_kernels.reduce_into(x, [torch.zeros(5, device=device)], ReduceOp.MAX)
    with pytest.raises(ValueError, match="contiguous"):
        cuda_kernels.reduce_into(x, [torch.zeros(8, device=device)[::2]], ReduceOp.SUM)
    with pytest.raises(ValueError, match="divisor"):
        cuda_kernels.reduce_into(x, [x], ReduceOp.AVG, divisor=0)
    with pytest.raises(ValueError, match="at least one source"):
        cuda_kernels.reduce_into(x, [], ReduceOp.SUM)
    with pytest.raises(TypeError, match="cannot cast"):
        cuda_kernels.cast_into(x.bfloat16(), x.half())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
def test_emulated_reduce_matches_cpu_kernel(emulated, dtype, op):
    check_reduce(dtype, op, "cpu")


def test_emulated_nan_wrap_cast_errors(emulated):
    check_nan_and_wrap("cpu")
    check_cast("cpu")
    check_errors("cpu")


# ---- tier 3: on a GPU --------------------------------------------------------------------------

gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and cupy")


@gpu
def test_gpu_kernels_available():
    assert cuda_kernels.available(), cuda_kernels._load()[1]


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
def test_gpu_reduce(dtype, op):
    check_reduce(dtype, op, "cuda", large=True)


@gpu
def test_gpu_nan_wrap_cast_errors():
    check_nan_and_wrap("cuda")
    check_cast("cuda")
    check_errors("cuda")


@gpu
def test_gpu_runs_on_current_stream():
    side = torch.cuda.Stream()
    srcs = [torch.full((1 << 20,), float(i + 1), device="cuda") for i in range(3)]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = torch.empty(1 << 20, device="cuda")
        cuda_kernels.reduce_into(out, srcs, ReduceOp.SUM)
        low = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
        cuda_kernels.cast_into(low, out)
    side.synchronize()
    assert torch.equal(out, torch.full_like(out, 6.0)) and torch.equal(low.float(), out)
