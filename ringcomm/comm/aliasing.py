"""Inputs that share memory with outputs. The exact in-place forms run as they
are; any other overlap reads a copy of the input, so the result is the one the
caller would get with separate tensors (torch's gloo behaves the same way).

Exact in-place forms (the transports are written for them):
  all_reduce:      output is the input (same first byte, same nbytes)
  reduce_scatter:  output is chunk `rank` of the input
  all_gather:      input is chunk `rank` of the output
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import torch


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte of a contiguous tensor."""
    start = tensor.data_ptr()
    return start, start + tensor.nbytes


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a_start, a_end), (b_start, b_end) = byte_span(a), byte_span(b)
    return a_start < b_end and b_start < a_end


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return byte_span(a) == byte_span(b)


def chunk(tensor: torch.Tensor, index: int, numel: int) -> torch.Tensor:
    return tensor.reshape(-1)[index * numel:(index + 1) * numel]


def all_reduce_input(input: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    return input.clone() if overlaps(input, output) and not same_memory(input, output) else input


def reduce_scatter_input(output: torch.Tensor, input: torch.Tensor, rank: int) -> torch.Tensor:
    if not overlaps(input, output):  # the common case, tested first: no chunk view made
        return input
    return input if same_memory(output, chunk(input, rank, output.numel())) else input.clone()


def all_gather_input(output: torch.Tensor, input: torch.Tensor, rank: int) -> torch.Tensor:
    if not overlaps(input, output):
        return input
    return input if same_memory(input, chunk(output, rank, input.numel())) else input.clone()


def coalesced_inputs(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], rank: int, *,
                     gather: bool) -> list[torch.Tensor]:
    """Inputs of pairs that run one after another: input i is copied when it
    overlaps its own output other than in place, or any other pair's output.
    The outputs are sorted once, so a long coalesced list costs n log n."""
    separate = all_gather_input if gather else reduce_scatter_input
    result = [separate(output, input, rank) for output, input in zip(outputs, inputs)]
    if len(outputs) < 2:
        return result
    spans = sorted((*byte_span(output), i) for i, output in enumerate(outputs))
    starts = [start for start, _, _ in spans]
    reach = list(itertools.accumulate((end for _, end, _ in spans), max))  # furthest end among spans[:k + 1]
    for i, input in enumerate(result):
        begin, end = byte_span(input)
        below = bisect.bisect_left(starts, end)  # outputs starting before this input ends
        if below == 0 or reach[below - 1] <= begin:
            continue  # no output reaches into it: the common case
        if any(j != i and start < end and begin < stop for start, stop, j in spans[:below]):
            result[i] = input.clone()
    return result
