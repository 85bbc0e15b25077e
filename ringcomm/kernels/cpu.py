"""How bytes combine: tensor-level wrappers over the C++ reduction kernels, and
which build of those kernels runs on this CPU."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import _C
from ..core.arguments import INT64_MAX, check_int
from ..core.ops import LOW_PRECISION, ReduceOp, dtype_code
from . import cuda as cuda_kernels


@dataclass(frozen=True, slots=True)
class CpuCapabilities:
    """The builds of the C++ kernels ([Note: CPU capabilities] in csrc/cpu/cpu_capability.h):
    `active` runs; `built` are in this library, narrowest first; `supported` are those this
    CPU runs; `march` is the baseline's -march ("" for the compiler's default)."""
    active: str
    built: tuple[str, ...]
    supported: tuple[str, ...]
    march: str


# Chosen once, here at import: an unknown RINGCOMM_CPU_CAPABILITY fails now, not inside a collective.
_ACTIVE = _C.cpu_capability()


def cpu_capability() -> str:
    """The build of the C++ kernels in use: "default" (x86-64-v2, or the compiler's
    default off x86), "avx2", "avx512" or "avx512_bf16": the best this CPU runs, or
    a lower one forced by RINGCOMM_CPU_CAPABILITY (as ATEN_CPU_CAPABILITY)."""
    return _ACTIVE


def cpu_capabilities() -> CpuCapabilities:
    found = _C.cpu_capabilities()
    return CpuCapabilities(_ACTIVE, tuple(found["built"]), tuple(found["supported"]), found["march"])


def reduce_into(dst: torch.Tensor, srcs: Sequence[torch.Tensor], op: ReduceOp, divisor: int = 1) -> None:
    """dst = srcs[0] op srcs[1] op ... element-wise, in source order; AVG divides
    the sum by `divisor`. 16-bit floats accumulate in float32 and round once.
    dst may be one of the sources."""
    code = dtype_code(dst.dtype, where="reduce_into")
    check_int("reduce_into", "divisor", divisor, 1, INT64_MAX)
    for src in srcs:
        if src.dtype != dst.dtype or src.numel() != dst.numel() or src.device != dst.device:
            raise ValueError(
                f"reduce_into: source {src.dtype}/{src.numel()}/{src.device} does not match "
                f"destination {dst.dtype}/{dst.numel()}/{dst.device}"
            )
        if not src.is_contiguous():
            raise ValueError("reduce_into: sources must be contiguous")
    if not dst.is_contiguous():
        raise ValueError("reduce_into: destination must be contiguous")
    if dst.device.type == "cpu":
        _C.reduce_n(dst.data_ptr(), [s.data_ptr() for s in srcs], dst.numel(), code, int(op), divisor)
    elif dst.device.type == "cuda" and cuda_kernels.available():
        cuda_kernels.reduce_into(dst, srcs, op, divisor)
    else:
        dst.copy_(reference_reduce(srcs, op, divisor))


def reference_reduce(srcs: Sequence[torch.Tensor], op: ReduceOp, divisor: int = 1) -> torch.Tensor:
    """Plain-torch reduction with the kernels' semantics (on devices without ringcomm kernels)."""
    dtype = srcs[0].dtype
    acc_dtype = torch.float32 if dtype in LOW_PRECISION else dtype
    stacked = torch.stack([s.to(acc_dtype) for s in srcs])
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        out = stacked.sum(0, dtype=acc_dtype)
        if op == ReduceOp.AVG:
            out = torch.div(out, divisor, rounding_mode="trunc") if not out.is_floating_point() else out / divisor
    elif op == ReduceOp.PRODUCT:
        out = stacked.prod(0, dtype=acc_dtype)
    elif op == ReduceOp.MIN:
        out = stacked.amin(0)
    else:
        out = stacked.amax(0)
    return out.to(dtype)
