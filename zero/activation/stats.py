"""What activation checkpointing holds, as the saved-tensor hooks count it:
ActivationStats and the storage arithmetic behind it (a storage counted once
however many saved tensors view it; parameters are model states, not counted)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ActivationStats:
    """Activation bytes this rank holds, as the saved-tensor hooks see them:
    checkpointed inputs (`held`), tensors a recomputation saved and backward has
    not used yet (`recomputed`), and, inside `measure()`, every other saved
    tensor (`saved`). Peaks since the last reset()."""

    held_nbytes: int = 0
    recomputed_nbytes: int = 0
    saved_nbytes: int = 0
    peak_held_nbytes: int = 0
    peak_nbytes: int = 0
    num_prefetched: int = 0  # partitioned inputs whose gather started before their recomputation

    def add(self, kind: str, nbytes: int) -> None:
        setattr(self, kind, getattr(self, kind) + nbytes)
        self.peak_held_nbytes = max(self.peak_held_nbytes, self.held_nbytes)
        self.peak_nbytes = max(self.peak_nbytes, self.held_nbytes + self.recomputed_nbytes + self.saved_nbytes)

    def reset(self) -> None:
        self.peak_held_nbytes, self.peak_nbytes = self.held_nbytes, self.live_nbytes

    @property
    def live_nbytes(self) -> int:
        return self.held_nbytes + self.recomputed_nbytes + self.saved_nbytes



def storage_nbytes(tensor: torch.Tensor, seen: dict[int, int]) -> int:
    """Bytes a saved tensor adds: 0 for parameters (model states) and for a
    storage already counted in `seen` (ptr -> references)."""
    base = tensor if tensor._base is None else tensor._base
    if base.is_leaf and base.requires_grad:
        return 0
    storage = tensor.untyped_storage()
    ptr = storage.data_ptr()
    seen[ptr] = seen.get(ptr, 0) + 1
    return storage.nbytes() if seen[ptr] == 1 else 0


def forget(tensor: torch.Tensor, seen: dict[int, int]) -> int:
    ptr = tensor.untyped_storage().data_ptr()
    if ptr not in seen:
        return 0
    seen[ptr] -= 1
    if seen[ptr]:
        return 0
    del seen[ptr]
    return tensor.untyped_storage().nbytes()
