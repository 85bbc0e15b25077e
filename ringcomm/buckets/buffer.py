"""Gradient storage of buckets laid out by ringcomm.plan.layout.

- FlatBuffer: one contiguous 1-D tensor per dtype that owns the gradients (and
  optionally the values) of many parameters; each parameter's `.grad` (and
  `.data` when views_for has "data") is a view into it, allocated once.
- GradBucket: what the BucketScheduler writes and reduces for one bucket: the
  whole bucket's gradients (a persistent view of a FlatBuffer, or a transient
  tensor that lives from the bucket's first gradient to the end of its
  reduction) and, for sharded gradients, this rank's chunk accumulated over
  micro-steps.
- Spares: the storage of released transient buckets, kept for the next one.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from ..plan.layout import BufferLayout, plan_buckets
from ..plan.schedule import Span

if TYPE_CHECKING:
    from ..comm.group import Group

Allocate = Callable[[int, torch.dtype], torch.Tensor]
VIEW_KINDS = ("grad", "data")


class FlatBuffer:
    """The gradients (and values) of `params`, all of one dtype and device."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, world_size: int, bucket_bytes: int,
                 first_bucket_bytes: int | None = None, allocate: Allocate | None = None,
                 views_for: Sequence[str] = ("grad",), order: Sequence[int] | None = None) -> None:
        self.params = list(params)
        _check_params(self.params, views_for)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.world_size = world_size
        self.views_for = tuple(views_for)
        itemsize = self.params[0].element_size()
        self.bucket_numel = max(1, bucket_bytes // itemsize)
        self.first_bucket_numel = None if first_bucket_bytes is None else max(1, first_bucket_bytes // itemsize)
        self._allocate = allocate
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.layout = self._plan(order)
        self.grad = self._new_flat()
        self.data = self._new_flat() if "data" in self.views_for else None
        self._bind_all()

    def _plan(self, order: Sequence[int] | None) -> BufferLayout:
        return plan_buckets([p.numel() for p in self.params], world_size=self.world_size,
                            bucket_numel=self.bucket_numel, first_bucket_numel=self.first_bucket_numel, order=order)

    def _new_flat(self) -> torch.Tensor:
        numel = self.layout.numel
        if self._allocate is None or self.device.type != "cpu":
            return torch.zeros(numel, dtype=self.dtype, device=self.device)
        flat = self._allocate(numel, self.dtype)
        if flat.shape != (numel,) or flat.dtype != self.dtype or not flat.is_contiguous():
            raise RuntimeError(f"FlatBuffer: allocate({numel}, {self.dtype}) returned shape {tuple(flat.shape)}, "
                               f"dtype {flat.dtype}, contiguous={flat.is_contiguous()}")
        return flat.zero_()

    def _bind_all(self) -> None:
        """Points every parameter's .grad (and .data) at its view, keeping values."""
        for i, param in enumerate(self.params):
            if self.data is not None:
                view = self.view(i, "data")
                view.copy_(param.data)
                param.data = view
            self.bind_grad(param)

    def index_of(self, param: torch.Tensor) -> int:
        try:
            return self._index[id(param)]
        except KeyError:
            raise ValueError(f"FlatBuffer: parameter of shape {tuple(param.shape)} and dtype {param.dtype} "
                             f"is not in this buffer ({len(self.params)} params, {self.dtype})") from None

    def view(self, index: int, kind: str = "grad") -> torch.Tensor:
        """Parameter `index`'s slice of the buffer, shaped like the parameter."""
        slot = self.layout.params[index]
        return self._flat(kind)[slot.begin:slot.end].view(self.params[index].shape)

    def bucket_view(self, bucket: int, kind: str = "grad") -> torch.Tensor:
        span = self.layout.buckets[bucket]
        return self._flat(kind)[span.begin:span.end]

    def shard_view(self, bucket: int, rank: int, kind: str = "grad") -> torch.Tensor:
        """Rank `rank`'s chunk of bucket `bucket` (its ZeRO shard of that bucket)."""
        chunk = self.layout.buckets[bucket].chunk(rank)
        return self._flat(kind)[chunk.begin:chunk.end]

    def _flat(self, kind: str) -> torch.Tensor:
        if kind == "grad":
            return self.grad
        if kind == "data" and self.data is not None:
            return self.data
        raise ValueError(f"FlatBuffer: no {kind!r} buffer (views_for={self.views_for})")

    def bind_grad(self, param: torch.Tensor, *, zero_if_missing: bool = True) -> bool:
        """Makes param.grad the buffer view: a detached grad is copied in, a
        missing one zeroes the view (when asked). Returns whether it was already bound."""
        view = self.view(self.index_of(param), "grad")
        grad = param.grad
        if grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape:
            return True
        if grad is not None:
            view.copy_(grad)
        elif zero_if_missing:
            view.zero_()
        param.grad = view
        return False

    def zero_grad(self) -> None:
        """Zeroes the whole gradient buffer (padding included) and re-binds every .grad."""
        self.grad.zero_()
        for param in self.params:
            self.bind_grad(param, zero_if_missing=False)

    def reorder(self, order: Sequence[int]) -> None:
        """Re-plans the buffer with parameters in `order` (registration indices)
        and moves values and gradients there: allocates, so call it once, e.g.
        after the first step with the observed gradient-ready order."""
        for param in self.params:
            self.bind_grad(param)
        self.layout = self._plan(order)
        self.grad = self._new_flat()
        self.data = self._new_flat() if self.data is not None else None
        self._bind_all()

    def __repr__(self) -> str:
        return (f"FlatBuffer({len(self.params)} params, {self.dtype}, {self.device}, numel={self.layout.numel}, "
                f"buckets={len(self.layout.buckets)}, views_for={self.views_for})")


class GradBucket:
    """The gradients of bucket `index` of `layout` on this rank.

    `grad` holds the whole padded bucket: `persistent` (a view of a FlatBuffer,
    kept across steps) or, when None, allocated by `ensure()` and dropped by
    `release()`. `sharded`: the bucket is reduced every backward into
    `accumulator`, this rank's chunk summed over micro-steps (ZeRO stages 2-3).
    `fresh`: the next write starts a new accumulation window (overwrites).
    """

    def __init__(self, layout: BufferLayout, index: int, params: Sequence[torch.nn.Parameter], rank: int, *,
                 persistent: torch.Tensor | None = None, sharded: bool = False, spares: Spares | None = None) -> None:
        self.layout = layout
        self.span = layout.buckets[index]
        self.index = index
        self.params = list(params)
        self.indices = self.span.param_indices
        self.spans = [layout.local(i) for i in self.indices]
        self.chunk: Span = self.span.local_chunk(rank)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.persistent = persistent is not None
        self.grad = persistent
        self.spares = spares  # where a transient grad's storage comes from and goes back to
        self._storage: torch.Tensor | None = None  # the transient grad's whole storage (a spare may be longer)
        self.accumulator = torch.zeros(self.chunk.numel, dtype=self.dtype, device=self.device) if sharded else None
        self.fresh = True
        self.accumulator_fresh = True
        self.num_ready = 0
        self.written: set[int] = set()  # parameter indices written since the window began

    def ensure(self) -> torch.Tensor:
        """The whole-bucket gradient tensor (allocating a transient one; its
        padding is zero and stays zero through every reduction)."""
        if self.grad is None:
            numel = self.span.numel
            self._storage = self.spares.take(numel, self.dtype, self.device) if self.spares is not None else \
                torch.empty(numel, dtype=self.dtype, device=self.device)
            self.grad = self._storage[:numel]
            self.grad[self.span.data_numel:].zero_()
            self.fresh = True
        return self.grad

    def release(self) -> None:
        if not self.persistent:
            if self.spares is not None and self._storage is not None:
                self.spares.give(self._storage)
            self.grad = self._storage = None

    def write(self, position: int, grad: torch.Tensor, scale: float) -> None:
        """Adds `grad * scale` to parameter `position`'s slice (overwrites when fresh)."""
        span, target = self.spans[position], self.ensure()
        view = target[span.begin:span.end]
        if self.fresh:
            torch.mul(grad.reshape(-1), scale, out=view)
        else:
            view.add_(grad.reshape(-1), alpha=scale)
        self.written.add(self.indices[position])

    def fill_unwritten(self) -> None:
        """Zeroes the slices of parameters that got no gradient in a fresh window."""
        target = self.ensure()
        if self.fresh:
            for index, span in zip(self.indices, self.spans):
                if index not in self.written:
                    target[span.begin:span.end].zero_()

    def own_chunk(self) -> torch.Tensor:
        """This rank's chunk of the whole-bucket gradient."""
        return self.ensure()[self.chunk.begin:self.chunk.end]

    @property
    def nbytes(self) -> int:
        return self.span.numel * self.params[0].element_size()

    def __repr__(self) -> str:
        kind = "sharded" if self.accumulator is not None else "persistent" if self.persistent else "transient"
        return f"GradBucket({self.index}, {len(self.params)} params, numel={self.span.numel}, {kind})"


class Spares:
    """The storage of released transient bucket gradients, kept for the next
    bucket to take: the largest one per (dtype, device). A stage-2 run whose one
    bucket holds the model's gradients would otherwise allocate and free them
    every backward: on CPU each step faults in (and the kernel zeroes) every
    page again (97.7M parameters, 2 ranks: ~95k faults and ~125 ms per backward).
    It holds what a backward holds anyway: one bucket of reduce_bucket_size
    elements (stage 2) or of the largest unit (stage 3), as zero.estimate counts."""

    def __init__(self) -> None:
        self._kept: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()  # buckets are released by backward's hooks and by finish()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of at least numel elements (contents undefined): the spare if it is long enough."""
        with self._lock:
            spare = self._kept.get((dtype, device))
            if spare is not None and spare.numel() >= numel:
                return self._kept.pop((dtype, device))
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, storage: torch.Tensor) -> None:
        """Keeps `storage` if it is the longest of its kind (the shorter one is freed)."""
        key = (storage.dtype, storage.device)
        with self._lock:
            kept = self._kept.get(key)
            if kept is None or kept.numel() < storage.numel():
                self._kept[key] = storage


def flat_buffers(params: Iterable[torch.nn.Parameter], *, world_size: int, bucket_bytes: int,
                 first_bucket_bytes: int | None = None, allocate: Allocate | None = None,
                 views_for: Sequence[str] = ("grad",)) -> list[FlatBuffer]:
    """One FlatBuffer per (dtype, device) of the parameters that require grad,
    in the order each dtype first appears."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for param in params:
        if param.requires_grad:
            groups.setdefault((param.dtype, param.device), []).append(param)
    return [FlatBuffer(group, world_size=world_size, bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes,
                       allocate=allocate, views_for=views_for) for group in groups.values()]


def transport_allocator(group: Group) -> Allocate:
    """The group's allocator for buffers its collectives use without staging
    copies (shared memory on shm, plain torch memory elsewhere: Group.allocate).
    Collective: every rank builds its buffers in the same order."""
    return group.allocate


def _check_params(params: list[torch.nn.Parameter], views_for: Sequence[str]) -> None:
    if not params:
        raise ValueError("FlatBuffer: no parameters given")
    unknown = [kind for kind in views_for if kind not in VIEW_KINDS]
    if unknown or "grad" not in views_for:
        raise ValueError(f"FlatBuffer: views_for={tuple(views_for)} must include 'grad' and only {VIEW_KINDS}")
    first = params[0]
    mixed = [(i, p.dtype, p.device) for i, p in enumerate(params) if p.dtype != first.dtype or p.device != first.device]
    if mixed:
        raise TypeError(f"FlatBuffer: all parameters must share parameter 0's dtype {first.dtype} and device "
                        f"{first.device}; (index, dtype, device) {mixed[:8]} differ: use flat_buffers() to group them")
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"FlatBuffer: a parameter appears twice among {len(params)} parameters")
