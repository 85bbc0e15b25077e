"""Quantized collectives (ZeRO++): an all-gather that moves blockwise int8
(qwZ) and a reduce-scatter that moves blockwise int4 through all-to-alls
(qgZ), over any ringcomm group; the kernels are ringcomm.kernels.quant's.

[Note: quantized rows]
A rank quantizes each chunk it sends on its own (blocks restart at every
chunk) into a row of bytes: the packed values, padded to 4 bytes, then one
float32 scale per block. Rows travel as int32 (the transports move typed
elements, and a copy of int32 is exact), and every receiver dequantizes, the
sender too, so all ranks see the same values: an all-gather's output is
dequantize(quantize(chunk)) for every chunk, the sender's own included.

[Note: quantized reduce-scatter]
A quantized block cannot be summed as it travels, so a ring (which adds at
every hop) will not do: each rank's chunk is reduced where it lands, after an
all-to-all. On a group of one level (one host, or a flat ring across hosts):
quantize every chunk, all-to-all, dequantize-and-sum. On a hierarchical group
(H hosts x L ranks) the bytes crossing hosts shrink by L, as in
hierarchical.py's reduce-scatter:

    1. quantize the N chunks; local all-to-all: local rank l gets, from every
       peer on its host, the H chunks of the ranks with local rank l;
    2. dequantize-and-sum over the L peers (float32): H host partials;
    3. quantize them again; cross-host all-to-all among the ranks of local
       rank l: host h gets its partial;
    4. dequantize-and-sum over the H hosts: the chunk, rounded once to the
       output dtype (AVG divides by N before that).

Values are quantized twice on the way (steps 1 and 3), once on one level.

[Note: quantized agreement]
The rows say nothing of the call that made them: 5 elements and 8 (or 1001
and 1008 at 4 bits) pad to rows of one length, 8 bits in blocks of 8 and 4
in blocks of 4 give rows of 12 bytes for 8 elements, and the dtype and op do
not show at all. So each call passes the transport a CallKey (numel, dtype,
op, bits, block, as the caller passed them) that the ranks compare in the
agreement step of the call's first exchange ([Note: call agreement] in
transport/agreement.py): a mismatch is the same ValueError on every rank, in
the caller's units. A rank with no elements still takes part in it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.ops import ReduceOp, to_reduce_op
from ..kernels import quant
from ..transport.agreement import CallKey
from ..transport.base import Levels, Transport
from .group import Group
from .registry import resolve_group
from .work import Work


@dataclass(frozen=True, slots=True)
class Rows:
    """The byte layout of one quantized chunk of `numel` elements ([Note: quantized rows])."""

    numel: int
    bits: int
    block: int

    @property
    def data_nbytes(self) -> int:
        return quant.packed_nbytes(self.numel, self.bits)

    @property
    def scales_at(self) -> int:
        return -(-self.data_nbytes // 4) * 4

    @property
    def nbytes(self) -> int:
        return self.scales_at + 4 * quant.num_blocks(self.numel, self.block)

    def empty(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, self.nbytes, dtype=torch.uint8)  # zeros: the padding is sent too

    def pack(self, values: torch.Tensor, *, out: torch.Tensor) -> None:
        """out (a row) = values quantized."""
        packed = quant.Quantized(out[:self.data_nbytes], out[self.scales_at:].view(torch.float32))
        quant.quantize_into(values, out=packed, bits=self.bits, block=self.block)

    def unpack(self, row: torch.Tensor, *, out: torch.Tensor) -> None:
        quant.dequantize(row[:self.data_nbytes], row[self.scales_at:].view(torch.float32), out=out, bits=self.bits,
                         block=self.block)

    def unpack_sum(self, rows: torch.Tensor, *, out: torch.Tensor) -> None:
        """out = the float32 sum of the rows' values ([k, nbytes]), rounded once."""
        data = rows[:, :self.data_nbytes].contiguous()
        scales = rows[:, self.scales_at:].contiguous().view(torch.float32)
        quant.dequantize_sum(data, scales, out=out, bits=self.bits, block=self.block)


def _words(rows: torch.Tensor) -> torch.Tensor:
    return rows.view(-1).view(torch.int32)


def _check(op: str, output: torch.Tensor, input: torch.Tensor, group: Group, bits: int, block: int) -> None:
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in quant.FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} dtype {t.dtype} cannot be quantized; expected one of "
                            f"{list(quant.FLOAT_DTYPES)}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous on rank {group.rank}")
        if not t.is_cpu:
            raise ValueError(f"{op}: {name} is on {t.device}; ringcomm's transports move host memory")
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output dtype {output.dtype} != input dtype {input.dtype} on rank {group.rank}")
    quant.check_format(op, bits=bits, block=block)


def quantized_all_gather(output: torch.Tensor, input: torch.Tensor, group: Group | None = None, *,
                         bits: int = quant.WEIGHT_BITS, block: int = quant.WEIGHT_BLOCK,
                         async_op: bool = False) -> Work | None:
    """all_gather of `input` quantized to `bits` in blocks of `block` elements:
    output chunk r becomes dequantize(quantize(rank r's input)) on every rank."""
    group = resolve_group(group, "quantized_all_gather")
    _check("quantized_all_gather", output, input, group, bits, block)
    if output.numel() != group.world_size * input.numel():
        raise ValueError(f"quantized_all_gather: output.numel()={output.numel()} != world_size "
                         f"({group.world_size}) * input.numel()={input.numel()} on rank {group.rank}")
    rows = Rows(input.numel(), bits, block)
    key = CallKey.of("quantized_all_gather", input.numel(), input.dtype, bits=bits, block=block)

    def body() -> None:
        mine, gathered = rows.empty(), rows.empty(group.world_size)
        if rows.numel:
            rows.pack(input.view(-1), out=mine)
        group.transport.all_gather(output=_words(gathered), input=_words(mine), key=key)
        if rows.numel == 0:
            return
        flat = output.view(-1)
        for rank in range(group.world_size):
            rows.unpack(gathered[rank], out=flat[rank * rows.numel:(rank + 1) * rows.numel])

    return group.run("quantized_all_gather", body, async_op, inputs=(input,), outputs=(output,))


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM,
                             group: Group | None = None, *, bits: int = quant.GRAD_BITS,
                             block: int = quant.GRAD_BLOCK, async_op: bool = False) -> Work | None:
    """reduce_scatter (SUM or AVG) whose chunks travel quantized ([Note:
    quantized reduce-scatter]): rank r's output becomes the float32 sum over
    ranks of the dequantized chunk r, rounded once."""
    group = resolve_group(group, "quantized_reduce_scatter")
    redop = to_reduce_op(op, where=f"quantized_reduce_scatter on rank {group.rank}")
    if redop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"quantized_reduce_scatter: op {redop.name} is not SUM or AVG (quantized values are summed)")
    _check("quantized_reduce_scatter", output, input, group, bits, block)
    if input.numel() != group.world_size * output.numel():
        raise ValueError(f"quantized_reduce_scatter: input.numel()={input.numel()} != world_size "
                         f"({group.world_size}) * output.numel()={output.numel()} on rank {group.rank}")
    rows = Rows(output.numel(), bits, block)
    key = CallKey.of("quantized_reduce_scatter", output.numel(), output.dtype, redop=redop, bits=bits, block=block)

    def body() -> None:
        chunks = input.view(group.world_size, rows.numel)
        result = output.view(-1) if redop == ReduceOp.SUM else torch.empty(rows.numel, dtype=torch.float32)
        if group.transport.levels is None:
            _one_level(group.transport, chunks, rows, result, key)
        else:
            levels = group.transport.levels()
            levels.agree(key)
            if rows.numel:
                _two_levels(levels, chunks, rows, result)
        if redop == ReduceOp.AVG and rows.numel:
            output.view(-1).copy_(result.div_(group.world_size))

    return group.run("quantized_reduce_scatter", body, async_op, inputs=(input,), outputs=(output,), redop=redop)


def _one_level(transport: Transport, chunks: torch.Tensor, rows: Rows, result: torch.Tensor, key: CallKey) -> None:
    world_size = chunks.shape[0]
    send, recv = rows.empty(world_size), rows.empty(world_size)
    for rank in range(world_size if rows.numel else 0):
        rows.pack(chunks[rank], out=send[rank])
    transport.all_to_all(output=_words(recv), input=_words(send), key=key)
    if rows.numel:
        rows.unpack_sum(recv, out=result)


def _two_levels(levels: Levels, chunks: torch.Tensor, rows: Rows, result: torch.Tensor) -> None:
    """Steps 1-4 of [Note: quantized reduce-scatter]."""
    local_all_to_all, cross_all_to_all, ranks_on = levels.local_all_to_all, levels.cross_all_to_all, levels.ranks_on
    num_hosts, local_size = len(ranks_on), len(ranks_on[0])
    send, recv = rows.empty(local_size, num_hosts), rows.empty(local_size, num_hosts)
    for local_rank in range(local_size):
        for host in range(num_hosts):
            rows.pack(chunks[ranks_on[host][local_rank]], out=send[local_rank, host])
    local_all_to_all(output=_words(recv), input=_words(send))
    partials = torch.empty(num_hosts, rows.numel, dtype=torch.float32)
    cross_send, cross_recv = rows.empty(num_hosts), rows.empty(num_hosts)
    for host in range(num_hosts):
        rows.unpack_sum(recv[:, host], out=partials[host])
        rows.pack(partials[host], out=cross_send[host])
    cross_all_to_all(output=_words(cross_recv), input=_words(cross_send))
    rows.unpack_sum(cross_recv, out=result)
