"""ZeRO-Offload: a ParamGroup whose fp32 masters and optimizer states live in
host memory (offload_optimizer device cpu) and whose optimizer step runs there.

[Note: offload on a CPU-only machine]
There the model already lives in host memory: the masters are made as without
offload (the parameters themselves when they are fp32, else one fp32 copy), no
gradient or parameter is copied, and only the accounting changes (the states
are reported on host). On CUDA the masters are host copies (pinned with
pin_memory), each bucket's reduced gradient goes to a host fp32 buffer on a side
stream (cuda.py), the step runs on host and the updated values are
copied back into the device parameters.
The host step is ParamGroup.step, with the unscale and clip coefficient
folded into torch's fused kernel (optim.unscaled).

[Note: gradient copies to host]
owned_grads_fp32 starts the offloaded buckets' copies (grad_copies), and a host
buffer holds anything until finish_grad_copies() has waited for them:

    compute: ..backward..|reduced|norm (device grads)|overflow? clip coef|
    copy:                        |D2H bucket 0|D2H bucket 1|...|done
    host:                                          finish: wait(done)|step|H2D params

- the norm, and from it the clip coefficient and fp16's overflow check, reads
  the reduced gradients on the device (ParamGroup.grad_norm), beside the copies;
- the host buffers are handed out in a HostGrads: any read of one (the step)
  finishes the copies first;
- zero_grads finishes them before it zeroes the gradients they read (a
  skipped step).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..sharding.param_group import ParamGroup, ZeroBucket
from . import cuda
from .config import OffloadOptions


class GradCopies(Protocol):
    """Copies of device gradients into host fp32 buffers (cuda.StreamGradCopies
    on a CUDA model). A buffer's contents are defined only after finish()."""

    def start(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Starts copying every gradient given (None: none for that slot); returns the host buffers."""

    def finish(self) -> None:
        """Waits until every copy started has landed."""


class HostParamGroup(ParamGroup):
    """offload_optimizer device cpu: the first `ratio` of the owned elements (in
    bucket order) have host masters and states. offload_param device cpu (stage
    3, a CUDA model): the shards of non-resident buckets live in host memory and
    go to the device when gathered."""

    def __init__(self, *args, options: OffloadOptions, param_options: OffloadOptions | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = options
        self.device = self.buckets[0].shard.device if self.buckets else torch.device("cpu")
        offloaded = options.device != "none"
        self.on_host = host_buckets([b.span.local_chunk(b.rank).numel for b in self.buckets],
                                    options.ratio) if offloaded else set()
        # the offloaded buckets' gradients to host: none to copy where the model is on the host
        self.grad_copies: GradCopies | None = cuda.StreamGradCopies(pin=options.pin_memory) \
            if self.on_host and self.device.type != "cpu" else None
        self.param_options = param_options or OffloadOptions()
        self.host_shards: dict[int, torch.Tensor] = {}  # bucket index -> its shard in host memory (CUDA models)

    def setup_masters(self) -> list[tuple[int, torch.Tensor]]:
        out = super().setup_masters()
        self.place_host_shards()
        return out

    def place_host_shards(self) -> None:
        """offload_param cpu on an accelerator: the shards move to host memory."""
        if self.param_options.device == "cpu" and self.policy.shard_params and self.device.type != "cpu":
            for bucket in self.buckets:
                if not bucket.span.resident:
                    self.host_shards[bucket.span.index] = cuda.host_copy(
                        bucket.shard, bucket.shard.dtype, pin=self.param_options.pin_memory)
                    bucket.shard = self.placeholder(bucket)

    def placeholder(self, bucket: ZeroBucket) -> torch.Tensor:
        """An offloaded shard's stand-in between uses: no memory, the shard's dtype and device."""
        return torch.empty(0, dtype=bucket.shard.dtype, device=self.device)

    def start_unshard(self, bucket: ZeroBucket, backward: bool = False) -> None:
        host = self.host_shards.get(bucket.span.index)
        if host is not None and bucket.full is None and bucket.gather is None:
            bucket.shard = host.to(self.device, non_blocking=self.param_options.pin_memory)
        super().start_unshard(bucket, backward)

    def unshard(self, bucket: ZeroBucket, backward: bool = False) -> None:
        super().unshard(bucket, backward)
        if bucket.span.index in self.host_shards:
            bucket.shard = self.placeholder(bucket)

    def reshard(self, bucket: ZeroBucket) -> None:
        super().reshard(bucket)
        if bucket.span.index in self.host_shards:
            bucket.shard = self.placeholder(bucket)

    def publish_target(self, bucket: ZeroBucket) -> torch.Tensor:
        host = self.host_shards.get(bucket.span.index)
        return host if host is not None else super().publish_target(bucket)

    def offloaded(self, bucket: ZeroBucket) -> bool:
        return bucket.span.index in self.on_host

    def offload_host_nbytes(self) -> int:
        return sum(t.nbytes for t in self.host_shards.values())

    def make_master(self, bucket: ZeroBucket, source: torch.Tensor) -> torch.Tensor:
        if source.device.type == "cpu" or not self.offloaded(bucket):
            return super().make_master(bucket, source)
        return cuda.host_copy(source, torch.float32, pin=self.options.pin_memory)

    def owned_grads_fp32(self) -> Sequence[torch.Tensor]:
        """As ParamGroup's; an offloaded bucket's in a host buffer whose copy
        starts here ([Note: gradient copies to host])."""
        grads = [b.owned_grad() for b in self.buckets]
        if self.grad_copies is None:
            return [g if g.dtype == torch.float32 else g.float() for g in grads]
        moved = self.grad_copies.start([g if self.offloaded(b) else None for b, g in zip(self.buckets, grads)])
        return HostGrads([m if m is not None else g.float() for m, g in zip(moved, grads)], self.finish_grad_copies)

    def finish_grad_copies(self) -> None:
        """Waits for the gradient copies to host: the one wait, before any host
        buffer is read and before the gradients they read are zeroed."""
        if self.grad_copies is not None:
            self.grad_copies.finish()

    def zero_grads(self) -> None:
        self.finish_grad_copies()
        super().zero_grads()


class HostGrads(Sequence):
    """A step's owned fp32 gradients, some in host buffers still being copied
    into: reading any of them waits for every copy first."""

    def __init__(self, grads: list[torch.Tensor], finish: Callable[[], None]) -> None:
        self.grads = grads
        self.finish = finish

    def __len__(self) -> int:
        return len(self.grads)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.finish()
        return self.grads[index]


def host_buckets(owned_numels: list[int], ratio: float) -> set[int]:
    """Indices of the buckets offloaded: the first ones in order while their
    owned elements stay within `ratio` of the total (all of them at 1.0)."""
    budget, chosen, total = ratio * sum(owned_numels), set(), 0
    for index, numel in enumerate(owned_numels):
        if total + numel > budget and ratio < 1.0:
            break
        chosen.add(index)
        total += numel
    return chosen
