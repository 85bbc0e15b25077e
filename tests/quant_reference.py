"""Plain-torch blockwise quantization with the exact float32 ops of [Note: quantized blocks]
(ringcomm/kernels/quant.py), written independently of the kernels: blocks as rows of a padded matrix."""
from __future__ import annotations

import torch


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """[num_blocks, block], the last row padded with zeros (they change no absmax)."""
    num_blocks = -(-flat.numel() // block)
    padded = torch.zeros(num_blocks * block, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    return padded.view(num_blocks, block)


def quantize(x: torch.Tensor, *, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8, scales float32) of the flat x."""
    qmax = torch.tensor(2.0 ** (bits - 1) - 1, dtype=torch.float32)
    flat = x.reshape(-1).float()
    rows = _blocks(flat, block)
    finite = torch.isfinite(rows).all(dim=1, keepdim=True)
    absmax = rows.abs().amax(dim=1, keepdim=True).where(finite, torch.zeros(()))
    zero = absmax == 0
    inv = (qmax / absmax).where(~zero, torch.zeros(()))
    q = torch.round(rows * inv).clamp(-qmax, qmax).nan_to_num(nan=0.0)
    q = q.where(finite & ~zero, torch.zeros(()))
    scales = (absmax / qmax).where(~zero, torch.zeros(())).where(finite, torch.full((), float("nan")))
    q = q.reshape(-1)[: flat.numel()].to(torch.int8)
    return _pack(q, bits), scales.reshape(-1)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return q.view(torch.uint8).clone()
    nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, torch.zeros(1, dtype=torch.uint8)])  # padding: high nibble 0
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack(data: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """q as float32."""
    if bits == 8:
        return data.view(torch.int8).float()
    low = (data & 15).to(torch.int16) - 8
    high = (data >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel].float()


def dequantize_float(data: torch.Tensor, scales: torch.Tensor, numel: int, *, bits: int, block: int) -> torch.Tensor:
    """float(q) * scale in float32, before the one rounding to an output dtype."""
    q = _unpack(data, numel, bits)
    return q * scales.repeat_interleave(block)[:numel]


def dequantize(data: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype, *, bits: int,
               block: int) -> torch.Tensor:
    return dequantize_float(data, scales, numel, bits=bits, block=block).to(dtype)


def dequantize_sum(data: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype, *, bits: int,
                   block: int) -> torch.Tensor:
    """Rows added in order in float32, rounded once."""
    acc = dequantize_float(data[0], scales[0], numel, bits=bits, block=block)
    for j in range(1, data.shape[0]):
        acc = acc + dequantize_float(data[j], scales[j], numel, bits=bits, block=block)
    return acc.to(dtype)
