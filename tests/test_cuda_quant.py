"""csrc/cuda/quant.cu through ringcomm.kernels.cuda_quant: the Python arguments match the kernels'
parameters (no GPU needed), and on a GPU with CuPy the kernels match the CPU kernels bit for bit.
(tests/test_cuda.py compiles quant.cu with nvcc and checks its launchers' argument checks.)"""
from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest
import torch

from ringcomm.kernels import cuda_quant, quant

C_TYPES = {"unsigned long long": np.uint64, "int": np.int32, "long long": np.int64}
GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns, NaNs as one value."""
    return t.masked_fill(t.isnan(), 0).view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def kernel_params(name: str) -> list[str]:
    match = re.search(r'extern "C" __global__ void ' + name + r"\(([^)]*)\)", cuda_quant.SOURCE.read_text())
    assert match, f"kernel {name} not found in {cuda_quant.SOURCE}"
    return [" ".join(param.split()[:-1]) for param in match.group(1).split(",")]


def test_python_matches_kernel_signatures():
    text = cuda_quant.SOURCE.read_text()
    assert cuda_quant.MAX_GRID == int(re.search(r"const int kMaxGrid = (\d+);", text).group(1))
    x, data, scales = torch.zeros(8), torch.zeros(8, dtype=torch.uint8), torch.zeros(2)
    for name, args in (("ringcomm_quantize", cuda_quant.quantize_args(x, data, scales, bits=8, block=4)),
                       ("ringcomm_dequantize_sum",
                        cuda_quant.dequantize_sum_args(data, scales, x, num_rows=1, bits=8, block=4))):
        assert [type(a) for a in args] == [C_TYPES[c] for c in kernel_params(name)], name
    assert set(cuda_quant.KERNELS) == set(re.findall(r'extern "C" __global__ void (\w+)', text))


def test_cuda_tensor_without_kernels_is_a_clear_error():
    if GPU:
        pytest.skip("the kernels are there (a CUDA device and cupy)")
    reason = cuda_quant.unavailable_reason()
    assert not cuda_quant.available() and reason, reason
    if not torch.cuda.is_available():
        assert "CUDA" in reason, reason
        return
    # A CUDA device without cupy: the reason names it, and a CUDA tensor is refused with it.
    assert "cupy" in reason, reason
    with pytest.raises(RuntimeError, match="CUDA tensors need the CUDA kernels: cupy is not importable"):
        quant.quantize(torch.ones(8, device="cuda"), bits=8, block=4)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and cupy")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits,block", [(8, 4096), (8, 7), (4, 1024), (4, 6)])
def test_gpu_matches_cpu_kernels(dtype, bits, block):
    assert cuda_quant.available(), cuda_quant.unavailable_reason()
    gen = torch.Generator().manual_seed(bits + block)
    for numel in (1, 3, 1025, 100_003, 3 * 2 ** 20 + 1):
        x = (torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-3, 3, (numel,), generator=gen)).to(dtype)
        x[numel // 2] = float("nan") if numel > 4 else x[numel // 2]
        data, scales = quant.quantize(x, bits=bits, block=block)
        gdata, gscales = quant.quantize(x.cuda(), bits=bits, block=block)
        assert torch.equal(gdata.cpu(), data), f"{dtype} {bits=} {block=} {numel=}: data"
        assert torch.equal(gscales.cpu().nan_to_num(7.0), scales.nan_to_num(7.0)), f"{numel=}: scales"
        rows, grows = torch.stack([data, data.flip(0)]), torch.stack([gdata, gdata.flip(0)])
        srows = torch.stack([scales, scales])
        out = quant.dequantize_sum(rows, srows, torch.empty(numel, dtype=dtype), bits=bits, block=block)
        gout = quant.dequantize_sum(grows, srows.cuda(), torch.empty(numel, dtype=dtype, device="cuda"), bits=bits,
                                    block=block)
        assert torch.equal(as_bits(gout.cpu()), as_bits(out)), f"{dtype} {bits=} {block=} {numel=}: sum"
