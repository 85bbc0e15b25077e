"""ZeRO++ (Wang et al., 2023): how stage 3 gathers its parameters and stages
2-3 reduce their gradients when the config asks for the three ZeRO++ keys.

[Note: ZeRO++ in zero]
    zero_quantized_weights (qwZ)  the forward all-gather of a bucket moves
                                  blockwise int8 (ringcomm.quantized_all_gather):
                                  every rank, the owner too, computes with the
                                  dequantized values; the shard and the fp32
                                  master stay exact, so only the gathered copy
                                  is approximate.
    zero_hpz_partition_size (hpZ) a bucket gathered for forward leaves each rank
                                  a secondary chunk of 1/size of it (16-bit, as
                                  gathered) when it is released; backward gathers
                                  from those chunks over a group of `size`
                                  consecutive ranks on one host, so backward's
                                  all-gather never leaves the host. The chunks
                                  are dropped when the values change (the step,
                                  zero.GatheredParameters, a checkpoint load).
                                  Alone it changes only where the values come
                                  from: training is bit for bit plain stage 3.
    zero_quantized_gradients (qgZ) the gradients' reduce-scatter moves blockwise
                                  int4 (ringcomm.quantized_reduce_scatter: a
                                  hierarchical all-to-all, as DeepSpeed's
                                  all_to_all_quant_reduce); stages 2 and 3, both
                                  reduce-scatter from the same scheduler.
qwZ and qgZ need comm_backend "ringcomm" (the quantized collectives are
ringcomm's); hpZ works on either.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import ringcomm.kernels.quant as quant

KEYS = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_hpz_partition_size",
        "zero_quantized_gradients")


@dataclass(frozen=True, slots=True)
class ZeroPPOptions:
    quantized_weights: bool = False
    hpz_partition_size: int = 1
    quantized_gradients: bool = False
    weight_bits: int = quant.WEIGHT_BITS
    weight_block: int = quant.WEIGHT_BLOCK
    grad_bits: int = quant.GRAD_BITS
    grad_block: int = quant.GRAD_BLOCK

    @property
    def quantized(self) -> bool:
        return self.quantized_weights or self.quantized_gradients


def parse(section: dict, stage: int) -> ZeroPPOptions:
    """The ZeRO++ keys of zero_optimization; a key that asks for something its stage cannot do is an error."""
    z = "zero_optimization."
    flags = {}
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        value = section.get(key, False)
        if not isinstance(value, bool):
            raise ValueError(f"zero config: {z}{key} must be true or false, got {value!r}")
        flags[key] = value
    size = section.get("zero_hpz_partition_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"zero config: {z}zero_hpz_partition_size must be an integer >= 1, got {size!r}")
    for key, asked, least in (("zero_quantized_weights", flags["zero_quantized_weights"], 3),
                              ("zero_hpz_partition_size", size > 1, 3),
                              ("zero_quantized_gradients", flags["zero_quantized_gradients"], 2)):
        if asked and stage < least:
            raise ValueError(f"zero config: {z}{key} needs stage {least}{' or 3' if least == 2 else ''} "
                             f"(it shards {'parameters' if least == 3 else 'gradients'}), got stage {stage}")
    return ZeroPPOptions(quantized_weights=flags["zero_quantized_weights"], hpz_partition_size=size,
                         quantized_gradients=flags["zero_quantized_gradients"])


def check_placement(options: ZeroPPOptions, hosts: list[str], backend: str, offload_param: str) -> None:
    """hpZ groups are `size` consecutive ranks, each on one host; quantization needs ringcomm."""
    z, size, world_size = "zero_optimization.", options.hpz_partition_size, len(hosts)
    if options.quantized and backend != "ringcomm":
        raise ValueError(f"zero config: {z}zero_quantized_weights/zero_quantized_gradients need comm_backend "
                         f"'ringcomm' (the quantized collectives are ringcomm's), got {backend!r}")
    if size == 1:
        return
    if offload_param != "none":
        raise ValueError(f"zero config: {z}zero_hpz_partition_size={size} with offload_param is not supported")
    if world_size % size:
        raise ValueError(f"zero config: {z}zero_hpz_partition_size={size} does not divide the world size "
                         f"{world_size}")
    for first in range(0, world_size, size):
        spread = sorted(set(hosts[first:first + size]))
        if len(spread) > 1:
            raise ValueError(f"zero config: {z}zero_hpz_partition_size={size}: ranks {first}..{first + size - 1} "
                             f"span hosts {spread}; a secondary partition must lie on one host (use the ranks "
                             f"per host, or a divisor of it, with host-major ranks)")


class Secondary:
    """hpZ's secondary chunks, by bucket index ([Note: ZeRO++ in zero])."""

    def __init__(self, rank: int, size: int) -> None:
        self.index, self.size = rank % size, size
        self.chunks: dict[int, torch.Tensor] = {}

    def bounds(self, numel: int) -> tuple[int, int]:
        part = numel // self.size  # buckets are padded to a multiple of the world size, so of `size`
        return self.index * part, (self.index + 1) * part

    def keep(self, index: int, full: torch.Tensor) -> None:
        if index not in self.chunks:
            begin, end = self.bounds(full.numel())
            self.chunks[index] = full[begin:end].clone()

    def drop(self) -> None:
        self.chunks.clear()

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks.values())
