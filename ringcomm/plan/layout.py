"""Pure bucket layout of a flat buffer: where each parameter lives, which
bucket it belongs to, and the owner-aligned chunks of every bucket. Standard
library only (a test checks it with `ast`).

[Note: owner-aligned buckets]
Parameters are placed in gradient-ready order (reverse registration order by
default: backward produces the last layer's gradients first) and cut into
buckets of about `bucket_numel` elements; a parameter is never split between
buckets. Each bucket is padded at its end to a multiple of world_size, so it
splits into world_size equal chunks and chunk r of every bucket belongs to
rank r. A reduce-scatter of a bucket therefore leaves rank r holding exactly
its ZeRO shard of that bucket; `BufferLayout.shard(rank)` lists those spans.

    buffer: | bucket 0 (first, small)  | bucket 1                  | ...
            | c0 | c1 | c2 | c3 +pad   | c0   | c1   | c2   | c3 +pad|

Buckets come either from sizes (`plan_buckets`: DDP, ZeRO stages 0-2) or from
explicit parameter groups (`plan_groups`, `plan_module_buckets`: one stage-3
module per bucket, tied parameters in their first module's). A bucket is `resident` when every rank keeps all of its
values between uses; otherwise ranks keep only their chunk (ZeRO stage 3).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .schedule import Span  # re-exported: layouts speak in spans


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Parameter `index` (registration order) occupies buffer elements
    [begin, begin + numel) and is communicated with bucket `bucket`."""

    index: int
    begin: int
    numel: int
    bucket: int

    @property
    def end(self) -> int:
        return self.begin + self.numel


@dataclass(frozen=True, slots=True)
class BucketSpan:
    """Bucket `index` covers buffer elements [begin, begin + numel); `numel`
    includes the padding (data_numel excludes it) and is world_size * chunk_numel.
    `param_indices` are the parameters it holds, in buffer order."""

    index: int
    begin: int
    numel: int
    data_numel: int
    chunk_numel: int
    param_indices: tuple[int, ...]
    resident: bool = True

    @property
    def end(self) -> int:
        return self.begin + self.numel

    def chunk(self, rank: int) -> Span:
        """Rank `rank`'s chunk of this bucket, in buffer coordinates."""
        return Span(self.begin + rank * self.chunk_numel, self.chunk_numel)

    def local_chunk(self, rank: int) -> Span:
        """Rank `rank`'s chunk of this bucket, in the bucket's own coordinates."""
        return Span(rank * self.chunk_numel, self.chunk_numel)


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """The plan of one flat buffer. `params[i]` is parameter i (registration
    order); `buckets` are in launch order; `order` is the buffer order."""

    world_size: int
    numel: int
    params: tuple[ParamSlot, ...]
    buckets: tuple[BucketSpan, ...]
    order: tuple[int, ...]

    def shard(self, rank: int) -> tuple[Span, ...]:
        """Rank `rank`'s chunk of every bucket, in buffer coordinates (its ZeRO shard)."""
        _check_rank("BufferLayout.shard", rank, self.world_size)
        return tuple(bucket.chunk(rank) for bucket in self.buckets)

    def shard_numel(self) -> int:
        """Elements of one rank's shard (the same on every rank)."""
        return sum(bucket.chunk_numel for bucket in self.buckets)

    def local(self, index: int) -> Span:
        """Parameter `index`'s elements in its bucket's own coordinates."""
        slot = self.params[index]
        return Span(slot.begin - self.buckets[slot.bucket].begin, slot.numel)

    def local_slices(self, bucket: int, span: Span) -> tuple[tuple[int, Span, Span], ...]:
        """For each parameter of `bucket` overlapping `span` (bucket coordinates):
        (parameter index, the overlap in bucket coordinates, in parameter coordinates)."""
        out = []
        for index in self.buckets[bucket].param_indices:
            own = self.local(index)
            begin, end = max(own.begin, span.begin), min(own.end, span.end)
            if begin < end:
                out.append((index, Span(begin, end - begin), Span(begin - own.begin, end - begin)))
        return tuple(out)

    def param_shard(self, index: int, rank: int) -> Span:
        """The part of parameter `index` inside rank `rank`'s chunk, in the
        parameter's own (flattened) coordinates; numel 0 when none of it is."""
        _check_rank("BufferLayout.param_shard", rank, self.world_size)
        slot = self.params[index]
        chunk = self.buckets[slot.bucket].chunk(rank)
        begin, end = max(slot.begin, chunk.begin), min(slot.end, chunk.end)
        return Span(begin - slot.begin, end - begin) if end > begin else Span(0, 0)


def plan_buckets(param_numels: Sequence[int], *, world_size: int, bucket_numel: int,
                 first_bucket_numel: int | None = None, order: Sequence[int] | None = None) -> BufferLayout:
    """Lays out parameters of `param_numels` elements in `order` (default:
    reverse registration order) and cuts them into buckets: a bucket is closed
    once it holds at least its capacity (`first_bucket_numel` for bucket 0 when
    given, else `bucket_numel`), so a parameter larger than the capacity gets a
    bucket of its own. Parameters of zero elements never open a bucket."""
    numels = [int(n) for n in param_numels]
    _check_args(numels, world_size, bucket_numel, first_bucket_numel)
    order_t = _check_order(order, len(numels))
    groups: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index in order_t:
        capacity = first_bucket_numel if (first_bucket_numel is not None and not groups) else bucket_numel
        if current and numels[index] > 0 and current_numel >= capacity:
            groups.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += numels[index]
    if current:
        groups.append(current)
    return _place(numels, groups, world_size, order_t)


def plan_groups(param_numels: Sequence[int], groups: Sequence[Sequence[int]], *, world_size: int,
                resident: Sequence[bool] | None = None) -> BufferLayout:
    """One bucket per group of parameter indices, in the order given (every
    parameter in exactly one group); `resident[k]` marks bucket k resident
    (default: all)."""
    numels = [int(n) for n in param_numels]
    _check_args(numels, world_size, 1, None)
    flat = [int(i) for group in groups for i in group]
    if sorted(flat) != list(range(len(numels))):
        raise ValueError(f"plan_groups: the groups must hold each of the {len(numels)} parameters once; got {groups}")
    if any(not group for group in groups):
        raise ValueError(f"plan_groups: empty group in {groups}")
    flags = [True] * len(groups) if resident is None else [bool(r) for r in resident]
    if len(flags) != len(groups):
        raise ValueError(f"plan_groups: {len(flags)} resident flags for {len(groups)} groups")
    return _place(numels, [list(g) for g in groups], world_size, tuple(flat), flags)


class ModuleBuckets(NamedTuple):
    """A stage-3 plan: the layout (its last bucket resident when some parameters
    stay whole) and, per module, the buckets it uses."""

    layout: BufferLayout
    uses: tuple[tuple[int, ...], ...]


def plan_module_buckets(module_params: Sequence[Sequence[int]], param_numels: Sequence[int], *, world_size: int,
                        persistence_threshold: int) -> ModuleBuckets:
    """ZeRO stage 3: one sharded bucket per module (`module_params[m]`: the
    indices of the parameters module m uses itself), in module order, then one
    resident bucket with the persistent parameters: those of at most
    `persistence_threshold` elements (DeepSpeed's rule). A parameter of several
    modules (tied weights) is sharded once, in the bucket of the first module
    that uses it, and every module using it gathers that bucket."""
    bucket_of: dict[int, int] = {}
    groups: list[list[int]] = []
    resident: list[bool] = []
    persistent: list[int] = []
    for indices in module_params:
        fresh = [i for i in dict.fromkeys(indices) if i not in bucket_of and i not in persistent]
        persistent.extend(i for i in fresh if param_numels[i] <= persistence_threshold)
        sharded = [i for i in fresh if param_numels[i] > persistence_threshold]
        if sharded:
            bucket_of.update((i, len(groups)) for i in sharded)
            groups.append(sharded)
            resident.append(False)
    if persistent:
        groups.append(persistent)
        resident.append(True)
    layout = plan_groups(param_numels, groups, world_size=world_size, resident=resident)
    uses = tuple(tuple(dict.fromkeys(bucket_of[i] for i in indices if i in bucket_of)) for indices in module_params)
    return ModuleBuckets(layout, uses)


def _place(numels: list[int], groups: list[list[int]], world_size: int, order: tuple[int, ...],
           resident: Sequence[bool] | None = None) -> BufferLayout:
    slots: list[ParamSlot | None] = [None] * len(numels)
    buckets = []
    offset = 0
    for bucket_index, indices in enumerate(groups):
        begin = offset
        for index in indices:
            slots[index] = ParamSlot(index, offset, numels[index], bucket_index)
            offset += numels[index]
        data_numel = offset - begin
        chunk_numel = -(-data_numel // world_size)
        buckets.append(BucketSpan(bucket_index, begin, chunk_numel * world_size, data_numel, chunk_numel, tuple(indices),
                                  True if resident is None else resident[bucket_index]))
        offset = begin + chunk_numel * world_size
    assert all(slot is not None for slot in slots), "every parameter is placed in some bucket"
    return BufferLayout(world_size, offset, tuple(slots), tuple(buckets), order)  # type: ignore[arg-type]


def _check_args(numels: list[int], world_size: int, bucket_numel: int, first_bucket_numel: int | None) -> None:
    if world_size < 1:
        raise ValueError(f"plan_buckets: {world_size=} must be >= 1")
    if bucket_numel < 1:
        raise ValueError(f"plan_buckets: {bucket_numel=} must be >= 1")
    if first_bucket_numel is not None and first_bucket_numel < 1:
        raise ValueError(f"plan_buckets: {first_bucket_numel=} must be >= 1 (or None)")
    negative = [(i, n) for i, n in enumerate(numels) if n < 0]
    if negative:
        raise ValueError(f"plan_buckets: parameter numels must be >= 0; got (index, numel) {negative[:8]}")


def _check_order(order: Sequence[int] | None, num_params: int) -> tuple[int, ...]:
    if order is None:
        return tuple(range(num_params - 1, -1, -1))
    order_t = tuple(int(i) for i in order)
    if sorted(order_t) != list(range(num_params)):
        raise ValueError(f"plan_buckets: order must be a permutation of range({num_params}); got {list(order_t)[:16]}"
                         f"{'...' if len(order_t) > 16 else ''} ({len(order_t)} entries)")
    return order_t


def _check_rank(where: str, rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"{where}: {rank=} outside {world_size=}")
