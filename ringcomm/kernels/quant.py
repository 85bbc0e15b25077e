"""Blockwise int8/int4 quantization for ZeRO++ (qwZ weights, qgZ gradients): the format,
its argument checks, and dispatch to the CPU (csrc/cpu/kernels/quant.cpp) and CUDA (csrc/cuda/quant.cu) kernels.

[Note: quantized blocks]
A flat tensor of n elements (float32, bfloat16 or float16) is cut into blocks of `block`
elements: block b covers [b * block, min((b + 1) * block, n)). Each block has one float32
scale; the values are symmetric integers q in [-qmax, qmax], qmax = 2**(bits - 1) - 1
(127 for 8 bits, 7 for 4 bits). All arithmetic is float32 (16-bit inputs convert exactly):
- absmax = max |x| over the block.
- a NaN or +-inf in the block: scale = NaN and every q = 0, so the whole block dequantizes
  to NaN (a loss scaler still sees the overflow); other blocks are unaffected.
- absmax == 0: scale = 0, every q = 0.
- else: inv = qmax / absmax, q = clamp(round_half_to_even(x * inv), -qmax, qmax) with a NaN
  product (0 * inf, only where absmax < qmax / FLT_MAX) taken as 0; scale = absmax / qmax.
  (Such a tiny block, below 4e-37, has inv = inf: its nonzero values all become +-qmax.)
Dequantize: value = float(q) * scale (one float32 multiply), rounded once to the output
dtype. dequantize_sum adds the dequantized values of k rows in row order in float32 (each
product rounded to float32 first: no fused multiply-add) and rounds the sum once.
Storage (`data`, uint8): 8 bits: q's int8 bit pattern, one byte per element. 4 bits: two
elements per byte, element 2i in the low nibble and 2i + 1 in the high nibble, each stored
as q + 8 (1..15); an odd last element leaves the high nibble 0. The block is even for 4
bits, so every block starts on a byte. `scales` is float32, one per block.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _C
from ..core.arguments import INT64_MAX, check_int, check_int_type
from ..core.ops import DTYPE_CODES
from . import cuda_quant

WEIGHT_BITS, WEIGHT_BLOCK = 8, 4096  # qwZ (DeepSpeed's CUDAQuantizer: groups below 8000, "optimal 4k")
GRAD_BITS, GRAD_BLOCK = 4, 1024  # qgZ
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK = 1 << 31  # elements (8 GiB of float32); a block longer than the tensor is one block


class Quantized(NamedTuple):
    """A quantized flat tensor: data (uint8, packed_nbytes) and scales (float32, num_blocks)."""

    data: torch.Tensor
    scales: torch.Tensor


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of quantized data for numel elements: numel for 8 bits, ceil(numel / 2) for 4."""
    check_format("packed_nbytes", bits=bits, block=2)
    check_int("packed_nbytes", "numel", numel, 0, INT64_MAX)
    return numel if bits == 8 else (numel + 1) // 2


def num_blocks(numel: int, block: int) -> int:
    """Scales for numel elements: ceil(numel / block)."""
    check_int("num_blocks", "block", block, 1, MAX_BLOCK)
    check_int("num_blocks", "numel", numel, 0, INT64_MAX)
    return -(-numel // block)


def check_format(where: str, *, bits: int, block: int) -> None:
    """bits is the int 4 or 8; block an int in [1, MAX_BLOCK], even for 4 bits
    (blocks start on a byte). Here, before pybind11 or torch.empty see them."""
    check_int_type(where, "bits", bits)
    if bits not in (4, 8):
        raise ValueError(f"{where}: {bits=}; expected 4 or 8")
    check_int(where, "block", block, 1, MAX_BLOCK)
    if bits == 4 and block % 2:
        raise ValueError(f"{where}: {block=} must be even for 4 bits ({bits=})")


def _check_float(where: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where}: {name} has dtype {tensor.dtype}; expected one of {list(FLOAT_DTYPES)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()})")


def _check_packed(where: str, name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                  device: torch.device) -> None:
    """data or scales: the dtype, a contiguous layout, the shape (1-D: only the numel) and the device."""
    if tensor.dtype != dtype:
        raise TypeError(f"{where}: {name} has dtype {tensor.dtype}; expected {dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()})")
    got = (tensor.numel(),) if len(shape) == 1 else tuple(tensor.shape)
    if got != shape:
        raise ValueError(f"{where}: {name} has {'numel' if len(shape) == 1 else 'shape'} {got}; expected {shape}")
    if tensor.device != device:
        raise ValueError(f"{where}: {name} is on {tensor.device}, the float tensor on {device}")


def _device_kind(where: str, device: torch.device) -> str:
    """"cpu" or "cuda" (with the CUDA kernels loadable), else a clear error."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        if not cuda_quant.available():
            raise RuntimeError(f"{where}: CUDA tensors need the CUDA kernels: {cuda_quant.unavailable_reason()}")
        return "cuda"
    raise ValueError(f"{where}: tensors on {device} are not supported (cpu or cuda)")


def quantize_into(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, *, bits: int, block: int) -> None:
    """Quantizes the flat x into data (uint8, packed_nbytes) and scales (float32, num_blocks), as
    [Note: quantized blocks]. data and scales may be views into a larger buffer."""
    where = f"quantize_into ({bits} bits, {block=})"
    check_format(where, bits=bits, block=block)
    _check_float(where, "x", x)
    numel = x.numel()
    _check_packed(where, "data", data, torch.uint8, (packed_nbytes(numel, bits),), x.device)
    _check_packed(where, "scales", scales, torch.float32, (num_blocks(numel, block),), x.device)
    if numel == 0:
        return
    if _device_kind(where, x.device) == "cuda":
        cuda_quant.quantize_into(x, data, scales, bits=bits, block=block)
    else:
        _C.quantize(x.data_ptr(), DTYPE_CODES[x.dtype], numel, data.data_ptr(), scales.data_ptr(), bits, block,
                    torch.get_num_threads())


def quantize(x: torch.Tensor, *, bits: int, block: int) -> Quantized:
    """(data, scales) of x, newly allocated on x's device; see quantize_into."""
    check_format(f"quantize ({bits} bits, {block=})", bits=bits, block=block)
    data = torch.empty(packed_nbytes(x.numel(), bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_blocks(x.numel(), block), dtype=torch.float32, device=x.device)
    quantize_into(x, data, scales, bits=bits, block=block)
    return Quantized(data, scales)


def dequantize(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bits: int, block: int) -> torch.Tensor:
    """Writes the dequantized values of (data, scales) into out (its numel is the element count)
    and returns out."""
    where = f"dequantize ({bits} bits, {block=})"
    check_format(where, bits=bits, block=block)
    _check_float(where, "out", out)
    numel = out.numel()
    _check_packed(where, "data", data, torch.uint8, (packed_nbytes(numel, bits),), out.device)
    _check_packed(where, "scales", scales, torch.float32, (num_blocks(numel, block),), out.device)
    return _dequantize_sum(where, data, scales, out, num_rows=1, bits=bits, block=block)


def dequantize_sum(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bits: int,
                   block: int) -> torch.Tensor:
    """out = the sum over rows j = 0..k-1, in order, of dequantize(data[j], scales[j]), in float32,
    rounded once to out's dtype; one pass over out. data: uint8 [k, packed_nbytes(n)], scales:
    float32 [k, num_blocks(n)], out: n elements. Returns out."""
    where = f"dequantize_sum ({bits} bits, {block=})"
    check_format(where, bits=bits, block=block)
    _check_float(where, "out", out)
    if data.dim() != 2 or data.shape[0] < 1:
        raise ValueError(f"{where}: data must be 2-D [k >= 1, packed_nbytes]; got shape {tuple(data.shape)}")
    num_rows, numel = data.shape[0], out.numel()
    _check_packed(where, "data", data, torch.uint8, (num_rows, packed_nbytes(numel, bits)), out.device)
    _check_packed(where, "scales", scales, torch.float32, (num_rows, num_blocks(numel, block)), out.device)
    return _dequantize_sum(where, data, scales, out, num_rows=num_rows, bits=bits, block=block)


def _dequantize_sum(where: str, data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, num_rows: int,
                    bits: int, block: int) -> torch.Tensor:
    if out.numel() == 0:
        return out
    if _device_kind(where, out.device) == "cuda":
        cuda_quant.dequantize_sum(data, scales, out, num_rows=num_rows, bits=bits, block=block)
    else:
        _C.dequantize_sum(data.data_ptr(), scales.data_ptr(), num_rows, out.data_ptr(), DTYPE_CODES[out.dtype],
                          out.numel(), bits, block, torch.get_num_threads())
    return out
