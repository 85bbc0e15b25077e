"""One argument order, torch's (output, input), in every layer: the public API,
the transports (keyword-only), the ring executor (keyword-only), ShmComm and
the C++ lean calls; the helpers below the collectives take the output first or
keyword-only (out=, output=). Each layer gets distinct output and input tensors; a layer
that swapped them would overwrite the input or leave the output untouched."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import ringcomm
from ringcomm import _C
from ringcomm.algorithms import ring
from ringcomm.plan import schedule
from ringcomm.core.ops import DTYPE_CODES, ReduceOp
from harness import run_ranks

CHUNK = 5
ROOT = Path(__file__).resolve().parents[1]


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


# ---- Below the collectives: the output first, or keyword-only (out=, output=) ----
# Each helper's outputs and inputs, by parameter name. With the output after an
# input, a call that reads naturally as torch's (output, input) would write the input.
def _roles() -> dict:
    from ringcomm.algorithms.hierarchical import HierarchicalTransport
    from ringcomm.comm import aliasing, quantized
    from ringcomm.kernels import cpu, cuda_quant, quant
    return {
        aliasing.all_reduce_input: (("output",), ("input",)),
        aliasing.reduce_scatter_input: (("output",), ("input",)),
        aliasing.all_gather_input: (("output",), ("input",)),
        quant.quantize_into: (("out",), ("x",)),
        quant.dequantize: (("out",), ("data", "scales")),
        quant.dequantize_sum: (("out",), ("data", "scales")),
        cuda_quant.quantize_into: (("out",), ("x",)),
        cuda_quant.dequantize_sum: (("out",), ("data", "scales")),
        quantized.Rows.pack: (("out",), ("values",)),
        quantized.Rows.unpack: (("out",), ("row",)),
        quantized.Rows.unpack_sum: (("out",), ("rows",)),
        HierarchicalTransport._all_reduce_body: (("output",), ("input",)),
        HierarchicalTransport._all_reduce_whole: (("output",), ("input",)),
        HierarchicalTransport._finish_reduction: (("output",), ("reduced",)),
        cpu.reduce_into: (("dst",), ("srcs",)),
    }


def output_first(names: list[str], keyword_only: list[str], outputs: tuple[str, ...], inputs: tuple[str, ...]) -> bool:
    """Every output is keyword-only or comes, positionally, before every input."""
    return all(out in keyword_only or all(i in keyword_only or names.index(out) < names.index(i) for i in inputs)
               for out in outputs)


def _parameters(fn) -> tuple[list[str], list[str]]:
    params = inspect.signature(fn).parameters.values()
    return ([p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)],
            [p.name for p in params if p.kind is p.KEYWORD_ONLY])


def test_helpers_take_the_output_first() -> None:
    for fn, (outputs, inputs) in _roles().items():
        names, keyword_only = _parameters(fn)
        assert set(outputs + inputs) <= set(names + keyword_only), f"{fn.__qualname__}: roles name no parameter"
        assert output_first(names, keyword_only, outputs, inputs), \
            f"{fn.__qualname__}{inspect.signature(fn)}: an output after an input"


# Tensors a function writes and reads (not `inputs`/`outputs`: describing a call, the recorder names both).
OUTPUT_NAMES, INPUT_NAMES = {"output", "out", "dst"}, {"input", "x", "src", "srcs"}


def test_no_function_of_ringcomm_takes_an_input_before_its_output() -> None:
    """Every function in ringcomm/ (of any name) with a parameter called like an
    output and one called like an input takes the output first or keyword-only."""
    wrong = []
    for path in sorted((ROOT / "ringcomm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            keyword_only = [a.arg for a in node.args.kwonlyargs]
            outputs = tuple(n for n in names + keyword_only if n in OUTPUT_NAMES)
            inputs = tuple(n for n in names + keyword_only if n in INPUT_NAMES)
            if outputs and inputs and not output_first(names, keyword_only, outputs, inputs):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(names)})")
    assert not wrong, "input before output:\n" + "\n".join(wrong)


def test_the_order_check_catches_a_swapped_helper() -> None:
    def swapped(input, output, rank):
        ...

    def keyword(input, *, out):
        ...
    assert not output_first(*_parameters(swapped), ("output",), ("input",))
    assert output_first(*_parameters(keyword), ("out",), ("input",))
