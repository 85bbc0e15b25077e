"""What the ranks of one collective compare before it moves data, in the
caller's units, and the error when they differ.

[Note: call agreement]
Every collective starts with an agreement step: each rank shows every other
what it is about to do, and when two calls differ every rank raises the same
ValueError, naming each rank's call, instead of pairing unequal messages. The
step rides on what the transport exchanges anyway: shm writes an OpDesc into
its slot with the call's first round (csrc/cpu/shm_trust.cpp); torch_dist
all-gathers a record of a few int64s before the call (TorchDistOptions.check_calls);
the hierarchical transport gathers every rank's record over both levels, local
then cross-host, before any data moves, so that a mismatch on one host or one
cross-host ring is seen by all ranks alike.

A record is the transport's own view of the call (kind, dtype, op, root,
numel: what it moves) followed by a CallKey, the call as its caller made it
(all 0: none). A caller that moves something else under the transport's
elements (ringcomm.comm.quantized sends rows of int32 words) passes its CallKey,
so that calls which move as many bytes with another meaning (sizes in one
padding bucket, other bits or block, another dtype or op) still differ, and
the error names the caller's values, not the words.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..core.ops import DTYPE_CODES, DTYPE_CODES_BY_ID, OP_KINDS, ReduceOp

KEY_LEN = 7  # ints in CallKey.values(); csrc/cpu/shm.h kCallKeyLen

# The ops a CallKey names; 0 means "no key" (a plain transport call).
CALL_OPS: dict[str, int] = {"barrier": 1, "all_reduce": 2, "reduce_scatter": 3, "all_gather": 4, "broadcast": 5,
                            "all_to_all": 6, "quantized_all_gather": 7, "quantized_reduce_scatter": 8}
_OP_NAMES = {code: name for name, code in CALL_OPS.items()}
_KIND_NAMES = {code: name for name, code in OP_KINDS.items()}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPE_CODES.items()}
_REDOP_NAMES = {op.value: op.name for op in ReduceOp}
# What the numel of each op counts (the tensor torch's API sizes the call by).
_NUMEL_NAMES = {"all_gather": "input numel", "quantized_all_gather": "input numel",
                "reduce_scatter": "output numel", "quantized_reduce_scatter": "output numel",
                "all_to_all": "chunk numel"}


class CallKey(NamedTuple):
    """One rank's collective as its caller made it: what every rank must pass
    alike, in the caller's units. -1: does not apply. (A NamedTuple: made on
    every quantized call, where a frozen dataclass costs microseconds.)"""

    op: str
    numel: int
    dtype: int = -1  # ringcomm.core.ops.DTYPE_CODES
    redop: int = -1  # ReduceOp
    root: int = -1
    bits: int = -1
    block: int = -1

    @classmethod
    def of(cls, op: str, numel: int, dtype: torch.dtype, *, redop: ReduceOp | None = None, bits: int = -1,
           block: int = -1) -> CallKey:
        return cls(op, numel, DTYPE_CODES_BY_ID[id(dtype)], -1 if redop is None else int(redop), -1, bits, block)

    def values(self) -> list[int]:
        return [CALL_OPS[self.op], self.numel, self.dtype, self.redop, self.root, self.bits, self.block]

    def describe(self) -> str:
        """'input numel 5, dtype float32, bits 8, block 256': the fields that apply."""
        parts = [] if self.op == "barrier" else [f"{_NUMEL_NAMES.get(self.op, 'numel')} {self.numel}"]
        if self.dtype != -1:
            parts.append(f"dtype {_name(_DTYPE_NAMES, self.dtype)}")
        if self.redop != -1:
            parts.append(f"op {_name(_REDOP_NAMES, self.redop)}")
        parts += [f"{name} {value}" for name, value in (("root", self.root), ("bits", self.bits),
                                                        ("block", self.block)) if value != -1]
        return ", ".join(parts)


NO_KEY = [0] * KEY_LEN


def record(op: str, tensor: torch.Tensor | None, numel: int, *, redop: int = -1, root: int = -1,
           key: CallKey | None = None) -> list[int]:
    """This rank's record of a transport call `op` (an OP_KINDS name) on `tensor`."""
    dtype = DTYPE_CODES[tensor.dtype] if tensor is not None else -1
    return [OP_KINDS[op], dtype, redop, root, numel, *(NO_KEY if key is None else key.values())]


def disagreement(op: str, records: Sequence[Sequence[int]]) -> ValueError:
    """The error every rank raises when the ranks' records (by rank) differ:
    each rank's call in its caller's units where it has a key, ranks with one
    call named together."""
    calls = [_call_of(r) for r in records]
    if all(c == calls[0] for c in calls):  # same keys, different transport calls: name those
        calls = [_call_of([*r[:5], *NO_KEY]) for r in records]
    one_op = all(c.op == calls[0].op for c in calls)
    ranks_of: dict[CallKey, list[int]] = {}
    for rank, call in enumerate(calls):
        ranks_of.setdefault(call, []).append(rank)
    said = "; ".join(f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {_said(call, one_op)}"
                     for call, ranks in ranks_of.items())
    return ValueError(f"{op}: ranks disagree on the call: {said}; every rank must make the same call with the same "
                      f"sizes, dtype and options")


def _said(call: CallKey, one_op: bool) -> str:
    """The call's fields, led by its op when the ranks' ops differ."""
    fields = call.describe()
    return fields if one_op else f"{call.op} of {fields}" if fields else call.op


def _call_of(values: Sequence[int]) -> CallKey:
    """The call a record describes: its key, or the transport's call when it has none."""
    kind, dtype, redop, root, numel, *key = (int(v) for v in values)
    if key[0] == 0:
        return CallKey(_name(_KIND_NAMES, kind), numel, dtype, redop, root)
    return CallKey(_name(_OP_NAMES, key[0]), *key[1:])


def _name(names: dict[int, str], code: int) -> str:
    return names.get(code, f"code {code}")


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-2, 5'."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"
