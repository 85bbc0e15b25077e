"""How bytes combine on the GPU: the CUDA reduce and cast kernels of csrc/cuda/reduce.cu,
compiled with CuPy (NVRTC) when CuPy and a GPU are present, launched on torch's current stream."""
from __future__ import annotations

import functools
import importlib.resources
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.ops import LOW_PRECISION, ReduceOp, dtype_code, to_reduce_op


def source_path(name: str = "reduce.cu") -> Path:
    """A kernel source: package data in an installed ringcomm (setup.py copies csrc/cuda
    there), else csrc/cuda of the source tree (an editable install)."""
    installed = importlib.resources.files("ringcomm") / "cuda" / name
    if installed.is_file():
        return Path(str(installed))
    return Path(str(importlib.resources.files("ringcomm"))).parent / "csrc" / "cuda" / name


SOURCE = source_path("reduce.cu")
MAX_SOURCES = 8  # kMaxSources in reduce.cu: source pointers per launch
THREADS = 256  # kThreads
MAX_BLOCKS = 4096  # kMaxBlocks
DEVICE_TYPE = "cuda"  # the tests set "cpu" to run the kernels' code, compiled by g++, on CPU tensors
CAST_DTYPES = {(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
               (torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


@functools.cache
def compile_kernels(source: Path, names: tuple[str, ...]) -> tuple[dict[str, Any], str | None]:
    """({kernel name: cupy.RawKernel}, None) when the kernels of `source` can run here, else ({}, why not)."""
    if not torch.cuda.is_available():
        return {}, "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy
    except Exception as exc:  # not installed, or built for another CUDA
        return {}, f"cupy is not importable ({exc!r}); install the extra: pip install 'ringcomm[cuda]'"
    if not source.is_file():
        return {}, f"kernel source {source} is missing"
    try:
        module = cupy.RawModule(code=source.read_text(), options=("--std=c++17",))
        with cupy.cuda.Device(torch.cuda.current_device()):  # compiles now, so a failure shows here
            return {name: module.get_function(name) for name in names}, None
    except Exception as exc:
        return {}, f"compiling {source.name} with cupy failed: {exc}"


def _load() -> tuple[dict[str, Any], str | None]:
    return compile_kernels(SOURCE, ("ringcomm_reduce", "ringcomm_cast"))


def available() -> bool:
    """True when CuPy and a GPU are present and the kernels compiled."""
    return bool(_load()[0])


def launch(kernels: dict[str, Any], why: str | None, name: str, device: torch.device, grid: int, args: tuple) -> None:
    """Queues kernel `name` of `kernels` (grid blocks of THREADS threads) on torch's current stream."""
    if not kernels:
        raise RuntimeError(f"ringcomm.kernels.cuda: cannot launch {name}: CUDA kernels unavailable: {why}")
    import cupy

    stream = torch.cuda.current_stream(device).cuda_stream
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream):
        kernels[name]((grid,), (THREADS,), args)


def _launch(name: str, device: torch.device, num_blocks: int, args: tuple) -> None:
    launch(*_load(), name, device, num_blocks, args)


def _num_blocks(numel: int, elements_per_thread: int) -> int:
    return max(1, min(MAX_BLOCKS, math.ceil(numel / (THREADS * elements_per_thread))))


def _reduce_args(dst: torch.Tensor, srcs: Sequence[torch.Tensor], op: ReduceOp, divisor: int) -> tuple:
    """Arguments of the ringcomm_reduce kernel, typed as its parameters (at most MAX_SOURCES sources)."""
    assert 1 <= len(srcs) <= MAX_SOURCES
    ptrs = [s.data_ptr() for s in srcs] + [0] * (MAX_SOURCES - len(srcs))
    return (np.uint64(dst.data_ptr()), *(np.uint64(p) for p in ptrs), np.int32(len(srcs)), np.int64(dst.numel()),
            np.int32(dtype_code(dst.dtype, where="reduce_into")), np.int32(int(op)), np.int64(divisor))


def _cast_args(dst: torch.Tensor, src: torch.Tensor) -> tuple:
    """Arguments of the ringcomm_cast kernel, typed as its parameters."""
    return (np.uint64(dst.data_ptr()), np.int32(dtype_code(dst.dtype, where="cast_into")), np.uint64(src.data_ptr()),
            np.int32(dtype_code(src.dtype, where="cast_into")), np.int64(src.numel()))


def _check_cuda(where: str, name: str, tensor: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != DEVICE_TYPE:
        raise ValueError(f"{where}: {name} is on {tensor.device}; these kernels take CUDA tensors")
    if not tensor.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()})")
    if like is not None and (tensor.numel() != like.numel() or tensor.device != like.device):
        raise ValueError(f"{where}: {name} has {tensor.numel()=} on {tensor.device}, "
                         f"the destination {like.numel()=} on {like.device}")


def reduce_into(dst: torch.Tensor, srcs: Sequence[torch.Tensor], op: ReduceOp, divisor: int = 1) -> None:
    """dst = srcs[0] op srcs[1] op ... element-wise in source order, on torch's current stream;
    AVG divides the sum by `divisor` (integers truncate). 16-bit floats accumulate in float32
    and round once. dst may be one of the sources. Same semantics as ringcomm.kernels.cpu.reduce_into."""
    op = to_reduce_op(op, where="cuda reduce_into")
    _check_cuda("cuda reduce_into", "dst", dst)
    dtype_code(dst.dtype, where=f"cuda reduce_into ({op.name})")
    if len(srcs) == 0:
        raise ValueError(f"cuda reduce_into ({op.name}): needs at least one source, got {len(srcs)=}")
    for i, src in enumerate(srcs):
        _check_cuda(f"cuda reduce_into ({op.name})", f"srcs[{i}]", src, like=dst)
        if src.dtype != dst.dtype:
            raise TypeError(f"cuda reduce_into ({op.name}): srcs[{i}] is {src.dtype}, dst is {dst.dtype}")
    if op == ReduceOp.AVG and (not isinstance(divisor, int) or divisor < 1):
        raise ValueError(f"cuda reduce_into (AVG): divisor must be an int >= 1, got {divisor!r}")
    if dst.numel() == 0:
        return
    if len(srcs) <= MAX_SOURCES:
        _launch("ringcomm_reduce", dst.device, _num_blocks(dst.numel(), 16 // dst.element_size()),
                _reduce_args(dst, srcs, op, divisor))
    elif dst.dtype in LOW_PRECISION:
        _reduce_widened(dst, srcs, op, divisor)
    else:
        _reduce_chained(dst, srcs, op, divisor)


def _reduce_chained(dst: torch.Tensor, srcs: Sequence[torch.Tensor], op: ReduceOp, divisor: int) -> None:
    """More sources than one launch takes, for 32/64-bit dtypes: fold them MAX_SOURCES - 1 at a
    time into the running result. The accumulator is the storage type, so this is bitwise the
    single pass; AVG sums until the last launch, which divides."""
    later = {s.data_ptr() for s in srcs[MAX_SOURCES:]}
    out = torch.empty_like(dst) if dst.data_ptr() in later else dst  # dst must not be overwritten while still read
    partial_op = ReduceOp.SUM if op == ReduceOp.AVG else op
    start = MAX_SOURCES
    reduce_into(out, srcs[:start], partial_op)
    while start < len(srcs):
        group = srcs[start:start + MAX_SOURCES - 1]
        start += len(group)
        reduce_into(out, [out, *group], op if start == len(srcs) else partial_op, divisor)
    if out is not dst:
        dst.copy_(out)


def _reduce_widened(dst: torch.Tensor, srcs: Sequence[torch.Tensor], op: ReduceOp, divisor: int) -> None:
    """More sources than one launch takes, for 16-bit dtypes: cast every source to float32 (exact),
    reduce those (chained, exact), then round once into dst. Costs 4 bytes per element per source."""
    wide = []
    for src in srcs:
        wide.append(torch.empty(src.numel(), dtype=torch.float32, device=src.device))
        cast_into(wide[-1], src)
    acc = torch.empty(dst.numel(), dtype=torch.float32, device=dst.device)
    reduce_into(acc, wide, op, divisor)
    cast_into(dst, acc)


def cast_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src converted, on torch's current stream: float32 -> bfloat16/float16 rounds to
    nearest even; bfloat16/float16 -> float32 is exact. Used to accumulate in float32 around NCCL."""
    _check_cuda("cuda cast_into", "dst", dst)
    _check_cuda("cuda cast_into", "src", src, like=dst)
    if (dst.dtype, src.dtype) not in CAST_DTYPES:
        raise TypeError(f"cuda cast_into: cannot cast {src.dtype} to {dst.dtype}; "
                        "supported: float32 <-> bfloat16, float32 <-> float16")
    if dst.numel() == 0:
        return
    _launch("ringcomm_cast", dst.device, _num_blocks(dst.numel(), 4), _cast_args(dst, src))
