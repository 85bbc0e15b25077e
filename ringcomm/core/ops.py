"""The codes ringcomm and its C++ agree on: reduction ops, dtypes and the kinds
of call ranks compare before a collective. Their one home; tests/test_tables.py
checks csrc/cpu/common.h, csrc/cpu/shm.h and csrc/cuda/reduce.cu against them."""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist


class ReduceOp(enum.IntEnum):
    """Reduction ops; the values are the codes csrc/cpu/common.h uses."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4


DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.int32: 4,
    torch.int64: 5,
}

# The same codes keyed by id(dtype): torch dtypes are singletons, and hashing
# one costs ~0.2 us, as much as a whole lean call's other checks (collectives.py).
DTYPE_CODES_BY_ID: dict[int, int] = {id(dtype): code for dtype, code in DTYPE_CODES.items()}

LOW_PRECISION = (torch.bfloat16, torch.float16)

# What a rank says it is calling, compared across ranks (shm.h OpKind; torch_dist's call check).
OP_KINDS: dict[str, int] = {"barrier": 0, "all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4,
                           "all_to_all": 5}

# torch's reduce ops that ringcomm does, most used first; matched by ==, since
# hashing a torch ReduceOp costs ~1.5 us (a whole lean call's budget).
TORCH_OPS = ((dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.AVG, ReduceOp.AVG),
             (dist.ReduceOp.MAX, ReduceOp.MAX), (dist.ReduceOp.MIN, ReduceOp.MIN),
             (dist.ReduceOp.PRODUCT, ReduceOp.PRODUCT))


def to_reduce_op(op: object, *, where: str) -> ReduceOp:
    """Accepts a ringcomm.ReduceOp, a torch.distributed.ReduceOp or a name ("sum", "avg", ...)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            raise ValueError(f"{where}: unknown reduce op {op!r}; expected one of {[o.name.lower() for o in ReduceOp]}") from None
    if isinstance(op, dist.ReduceOp.RedOpType):
        op = dist.ReduceOp(op)
    for torch_op, ours in TORCH_OPS:
        try:
            if op == torch_op:
                return ours
        except TypeError:
            break
    raise ValueError(f"{where}: unsupported reduce op {op!r}; ringcomm supports {[o.name for o in ReduceOp]}")


def dtype_code(dtype: torch.dtype, *, where: str) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"{where}: unsupported dtype {dtype}; ringcomm supports {list(DTYPE_CODES)}") from None
