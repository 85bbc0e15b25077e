"""One argument order, torch's (output, input), in every layer: the public API,
the transports (keyword-only), the ring executor (keyword-only), ShmComm and
the C++ lean calls. Each layer gets distinct output and input tensors; a layer
that swapped them would overwrite the input or leave the output untouched."""
from __future__ import annotations

import pytest
import torch

import ringcomm
from ringcomm import _C
from ringcomm.algorithms import ring
from ringcomm.plan import schedule
from ringcomm.core.ops import DTYPE_CODES, ReduceOp
from harness import run_ranks

CHUNK = 5


def fresh(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input of world_size chunks, a NaN reduce-scatter output, a NaN all-gather output)."""
    input = torch.arange(world_size * CHUNK, dtype=torch.float32) + 100 * rank
    return input, torch.full((CHUNK,), float("nan")), torch.full((world_size * CHUNK,), float("nan"))


def expected(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed forms: rank r's reduce-scatter chunk, and the gather of every rank's chunk 0."""
    base = torch.arange(world_size * CHUNK, dtype=torch.float32)
    scattered = world_size * base[rank * CHUNK:(rank + 1) * CHUNK] + 100 * sum(range(world_size))
    gathered = torch.cat([base[:CHUNK] + 100 * r for r in range(world_size)])
    return scattered, gathered


def layers(group: ringcomm.Group):
    """{layer: (reduce_scatter(output, input), all_gather(output, input))} for this group's transport."""
    transport = group.transport
    found = {
        "public": (lambda o, i: ringcomm.reduce_scatter(o, i, group=group),
                   lambda o, i: ringcomm.all_gather(o, i, group=group)),
        "transport": (lambda o, i: transport.reduce_scatter(output=o, input=i, op=ReduceOp.SUM),
                      lambda o, i: transport.all_gather(output=o, input=i)),
    }
    code = DTYPE_CODES[torch.float32]
    if transport.kind == "shm":
        comm, handle, t = transport._comm, transport.handle, transport.timeout_s
        found["ShmComm"] = (
            lambda o, i: comm.reduce_scatter(o.data_ptr(), i.data_ptr(), o.numel(), code, int(ReduceOp.SUM), t),
            lambda o, i: comm.all_gather(o.data_ptr(), i.data_ptr(), i.numel(), code, t))
        found["_C.*_lean"] = (
            lambda o, i: _C.reduce_scatter_lean(handle, o.data_ptr(), i.data_ptr(), o.numel(), code,
                                                int(ReduceOp.SUM), t),
            lambda o, i: _C.all_gather_lean(handle, o.data_ptr(), i.data_ptr(), i.numel(), code, t))
        found["_C.*_tensors"] = (lambda o, i: _C.reduce_scatter_tensors(handle, o, i, ReduceOp.SUM, t),
                                 lambda o, i: _C.all_gather_tensors(handle, o, i, t))
    else:
        link = transport._link
        chunks = schedule.equal_chunks(CHUNK, group.world_size)
        found["ring executor"] = (
            lambda o, i: ring.reduce_scatter(link, output=o, input=i, chunks=chunks, op=ReduceOp.SUM,
                                             segment_numel=2),
            None)  # the ring's all_gather is in place: one tensor, no order to get wrong
    return found


def every_layer(rank, world_size, transport):
    group = ringcomm.new_group(transport=transport, timeout=30)
    want_scattered, want_gathered = expected(rank, world_size)
    for layer, (reduce_scatter, all_gather) in layers(group).items():
        input, scattered, gathered = fresh(rank, world_size)
        original = input.clone()
        reduce_scatter(scattered, input)
        assert torch.equal(input, original), f"rank {rank} {layer}: reduce_scatter wrote its input"
        assert torch.equal(scattered, want_scattered), f"rank {rank} {layer}: reduce_scatter gave {scattered}"
        if all_gather is None:
            continue
        chunk = input[:CHUNK].clone()
        all_gather(gathered, chunk)
        assert torch.equal(chunk, original[:CHUNK]), f"rank {rank} {layer}: all_gather wrote its input"
        assert torch.equal(gathered, want_gathered), f"rank {rank} {layer}: all_gather gave {gathered}"
    # Below the public API the pairs are keyword-only: a positional pair is refused.
    input, scattered, _ = fresh(rank, world_size)
    with pytest.raises(TypeError):
        group.transport.reduce_scatter(scattered, input, ReduceOp.SUM)
    group.close()


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_every_layer_takes_output_then_input(transport):
    run_ranks(every_layer, 2, transport)
