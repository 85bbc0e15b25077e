"""The CUDA side of offload: pinned host copies and gradient copies to host on
a side stream. Nothing here runs on a CPU-only machine (the offload paths keep
host tensors as they are there); benchmarks/gpu_check.py exercises it.

    compute: ..backward..|grads reduced (event)| ........ |
    copy:                 wait(event)|D2H bucket 0|D2H bucket 1|...|done
    host:                                                    finish(done)|step|H2D params
"""
from __future__ import annotations

import torch


def host_copy(source: torch.Tensor, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A host tensor holding `source` in `dtype` (pinned: copies to and from
    the device can run asynchronously)."""
    out = torch.empty(source.numel(), dtype=dtype, pin_memory=pin and torch.cuda.is_available())
    out.copy_(source.reshape(-1))
    return out


class StreamGradCopies:
    """zero.offload.host.GradCopies on CUDA: device gradients to host fp32
    buffers on a side stream, after the compute stream's work so far (the
    reductions); buffers are kept per slot."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.stream: torch.cuda.Stream | None = None
        self.buffers: dict[int, torch.Tensor] = {}
        self.done: torch.cuda.Event | None = None

    def start(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Enqueues the copies; returns the host buffers (valid after finish())."""
        devices = {g.device for g in grads if g is not None}
        if not devices:
            return [None] * len(grads)
        device = devices.pop()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        self.stream.wait_event(ready)
        out: list[torch.Tensor | None] = []
        with torch.cuda.stream(self.stream):
            for slot, grad in enumerate(grads):
                if grad is None:
                    out.append(None)
                    continue
                host = self.buffers.get(slot)
                if host is None or host.numel() != grad.numel():
                    host = torch.empty(grad.numel(), dtype=torch.float32, pin_memory=self.pin)
                    self.buffers[slot] = host
                host.copy_(grad.float(), non_blocking=self.pin)  # the cast runs on the device, then one copy
                grad.record_stream(self.stream)
                out.append(host)
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
        return out

    def finish(self) -> None:
        """Blocks until every copy started so far has landed."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None
