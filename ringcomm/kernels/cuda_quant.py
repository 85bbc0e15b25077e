"""Blockwise quantization on the GPU: the kernels of csrc/cuda/quant.cu ([Note: quantized blocks]
in ringcomm/kernels/quant.py), compiled with CuPy and launched on torch's current stream. ringcomm.kernels.quant
checks the arguments and calls these."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.ops import DTYPE_CODES
from . import cuda as cuda_kernels

SOURCE = cuda_kernels.source_path("quant.cu")
KERNELS = ("ringcomm_quantize", "ringcomm_dequantize_sum")
MAX_GRID = 65535  # kMaxGrid in quant.cu: thread blocks per launch; each walks quantization blocks


def _load() -> tuple[dict[str, Any], str | None]:
    return cuda_kernels.compile_kernels(SOURCE, KERNELS)


def available() -> bool:
    """True when CuPy and a GPU are present and quant.cu compiled."""
    return bool(_load()[0])


def unavailable_reason() -> str:
    return _load()[1] or ""


def _launch(name: str, device: torch.device, grid: int, args: tuple) -> None:
    cuda_kernels.launch(*_load(), name, device, grid, args)


def _grid(numel: int, block: int) -> int:
    """One thread block per quantization block, up to MAX_GRID."""
    return max(1, min(MAX_GRID, -(-numel // block)))


def quantize_args(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, *, bits: int, block: int) -> tuple:
    """Arguments of ringcomm_quantize, typed as its parameters."""
    return (np.uint64(x.data_ptr()), np.int32(DTYPE_CODES[x.dtype]), np.int64(x.numel()), np.uint64(data.data_ptr()),
            np.uint64(scales.data_ptr()), np.int32(bits), np.int64(block))


def dequantize_sum_args(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, num_rows: int, bits: int,
                        block: int) -> tuple:
    """Arguments of ringcomm_dequantize_sum, typed as its parameters."""
    return (np.uint64(data.data_ptr()), np.uint64(scales.data_ptr()), np.int32(num_rows), np.uint64(out.data_ptr()),
            np.int32(DTYPE_CODES[out.dtype]), np.int64(out.numel()), np.int32(bits), np.int64(block))


def quantize_into(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, *, bits: int, block: int) -> None:
    """ringcomm.kernels.quant.quantize_into on checked CUDA tensors (numel > 0)."""
    _launch("ringcomm_quantize", x.device, _grid(x.numel(), block),
            quantize_args(x, data, scales, bits=bits, block=block))


def dequantize_sum(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, num_rows: int, bits: int,
                   block: int) -> None:
    """ringcomm.kernels.quant.dequantize_sum on checked CUDA tensors (numel > 0)."""
    _launch("ringcomm_dequantize_sum", out.device, _grid(out.numel(), block),
            dequantize_sum_args(data, scales, out, num_rows=num_rows, bits=bits, block=block))
