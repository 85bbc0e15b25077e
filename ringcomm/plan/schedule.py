"""Pure plans of the ring: which chunk each rank sends and receives at each
step, chunk bounds, and the split of a chunk into segments. Standard library only.

Vocabulary (used across ringcomm and zero):

| word    | meaning                                                           |
| ------- | ----------------------------------------------------------------- |
| buffer  | one contiguous 1-D tensor holding many parameters or gradients    |
| bucket  | the part of a buffer communicated together; the unit of overlap   |
| chunk   | 1/world_size of a bucket; chunk i is owned by rank i              |
| segment | the slice of a chunk moved in one transfer; unit of pipelining    |
| shard   | this rank's chunk of a flat buffer, as ZeRO sees it               |
| step    | one ring round; world_size - 1 per phase                          |
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """Elements [begin, begin + numel) of a 1-D tensor."""

    begin: int
    numel: int

    @property
    def end(self) -> int:
        return self.begin + self.numel


@dataclass(frozen=True, slots=True)
class RingStep:
    """At `step`, send chunk `send_chunk` to the right neighbour and receive
    chunk `recv_chunk` from the left one."""

    step: int
    send_chunk: int
    recv_chunk: int


# [Note: ring volume] The one home of each collective's traffic. Over a ring
# of n ranks, a reduce_scatter or an all_gather of S bytes (the whole tensor)
# makes every rank send S (n-1)/n; an all_reduce is both phases, 2 S (n-1)/n;
# a pipelined broadcast forwards all S. nccl-tests' busbw is algbw times the
# same factor, so a bus bandwidth compares with the link's.
RING_PHASES = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw of `op` on `world_size` ranks (nccl-tests): the bytes one
    rank sends per byte of the op's size S ([Note: ring volume])."""
    if op == "broadcast":
        return 1.0
    if op not in RING_PHASES:
        raise ValueError(f"bus_factor: unknown collective {op!r}; expected broadcast or one of {list(RING_PHASES)}")
    return RING_PHASES[op] * (world_size - 1) / world_size


def sent_numel(op: str, numel: int, world_size: int) -> int:
    """Elements one rank sends in a ring `op` over `numel` elements (the whole
    tensor); none on one rank ([Note: ring volume])."""
    if world_size <= 1:
        return 0
    if op == "broadcast":
        return numel
    bus_factor(op, world_size)  # names an unknown op
    return RING_PHASES[op] * (numel * (world_size - 1) // world_size)


def left(rank: int, world_size: int) -> int:
    return (rank - 1) % world_size


def right(rank: int, world_size: int) -> int:
    return (rank + 1) % world_size


def chunk_bounds(numel: int, world_size: int) -> tuple[Span, ...]:
    """Split `numel` elements into `world_size` chunks as evenly as possible:
    the first numel % world_size chunks hold one element more. Chunks may be empty."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"chunk_bounds: {numel=} must be >= 0 and {world_size=} >= 1")
    base, extra = divmod(numel, world_size)
    return tuple(Span(i * base + min(i, extra), base + (1 if i < extra else 0)) for i in range(world_size))


def equal_chunks(chunk_numel: int, world_size: int) -> tuple[Span, ...]:
    """`world_size` chunks of `chunk_numel` elements each (reduce_scatter / all_gather layout)."""
    if chunk_numel < 0 or world_size < 1:
        raise ValueError(f"equal_chunks: {chunk_numel=} must be >= 0 and {world_size=} >= 1")
    return tuple(Span(i * chunk_numel, chunk_numel) for i in range(world_size))


def segments(chunk: Span, segment_numel: int) -> tuple[Span, ...]:
    """Cut a chunk into consecutive segments of at most `segment_numel` elements
    (an empty chunk has no segments). Sender and receiver cut a chunk the same way."""
    if segment_numel < 1:
        raise ValueError(f"segments: {segment_numel=} must be >= 1")
    return tuple(
        Span(begin, min(segment_numel, chunk.end - begin)) for begin in range(chunk.begin, chunk.end, segment_numel)
    )


def reduce_scatter_steps(rank: int, world_size: int) -> tuple[RingStep, ...]:
    """Ring reduce-scatter: at step s rank r sends its partial sum of chunk
    (r - s - 1) and receives chunk (r - s - 2), which it reduces with its own
    data. After world_size - 1 steps, rank r holds the full reduction of chunk r."""
    _check_rank(rank, world_size)
    return tuple(
        RingStep(s, (rank - s - 1) % world_size, (rank - s - 2) % world_size) for s in range(world_size - 1)
    )


def all_gather_steps(rank: int, world_size: int) -> tuple[RingStep, ...]:
    """Ring all-gather: at step s rank r forwards chunk (r - s), which it owns
    or received at step s - 1, and receives chunk (r - s - 1)."""
    _check_rank(rank, world_size)
    return tuple(RingStep(s, (rank - s) % world_size, (rank - s - 1) % world_size) for s in range(world_size - 1))


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"ring schedule: {rank=} outside {world_size=}")
