"""A failed step of BucketScheduler (one bucket's collective fails, or backward
raises) leaves it ready for the next: finish() raises the error once, and the
next step reduces exactly its own gradients (ringcomm.buckets.overlap [Note: a failed
step]). One process: the collectives of two ranks holding the same gradients
are simulated on a worker thread, so the mean reduction is the gradient itself."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from ringcomm.buckets.buffer import GradBucket
from ringcomm.plan.layout import plan_buckets
from ringcomm.buckets.overlap import OwnedBucketScheduler
from ringcomm.comm.work import Work


class Injected(RuntimeError):
    pass


class TwinRanks:
    """Rank 0 of two ranks with equal gradients; call number `fail_at` fails."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="twin-comm")  # one comm thread, in launch order
        self.calls, self.fail_at = 0, None

    def _run(self, op: str, body) -> Work:
        self.calls += 1
        call, fail = self.calls, self.calls == self.fail_at

        def run() -> None:
            if fail:
                raise Injected(f"{op}: injected failure of call {call}")
            body()
        return Work(self.pool.submit(run), op, self.rank)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Work:
        return self._run("all_reduce", lambda: tensor.mul_(2))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        return self._run("reduce_scatter", lambda: output.copy_(input[:output.numel()] * 2))


class FailingBackward(torch.autograd.Function):
    """Identity whose backward raises: the layers after it already got their gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise Injected("backward")


def setup(mode: str) -> tuple[nn.Module, OwnedBucketScheduler, TwinRanks]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3))
    params = list(model.parameters())
    layout = plan_buckets([p.numel() for p in params], world_size=2, bucket_numel=16)
    sharded = mode == "reduce_scatter"
    buckets = [GradBucket(layout, k, [params[i] for i in span.param_indices], 0, sharded=sharded,
                          persistent=None if sharded else torch.zeros(span.numel))
               for k, span in enumerate(layout.buckets)]
    comm = TwinRanks()
    scheduler = OwnedBucketScheduler(buckets, comm, mode=mode, scale=0.5, timeout_s=10.0)
    scheduler.register_hooks(params)
    assert len(buckets) >= 3, f"{mode}: {len(buckets)} buckets"
    return model, scheduler, comm


def loss_of(model: nn.Module, step: int, failing: bool = False) -> torch.Tensor:
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(step))
    h = model[1](model[0](x))
    if failing:
        h = FailingBackward.apply(h)
    return model[4](model[3](model[2](h))).square().sum()


def expected_grads(step: int, scheduler: OwnedBucketScheduler) -> list[torch.Tensor]:
    """Plain autograd on a copy: each bucket's reduced gradient (its chunk of rank 0 when sharded)."""
    model, _, _ = setup("all_reduce")
    grads = torch.autograd.grad(loss_of(model, step), list(model.parameters()))
    out = []
    for bucket in scheduler.buckets:
        flat = torch.zeros(bucket.span.numel)
        for i, span in zip(bucket.indices, bucket.spans):
            flat[span.begin:span.end] = grads[i].reshape(-1)
        out.append(flat[bucket.chunk.begin:bucket.chunk.end] if bucket.accumulator is not None else flat)
    return out


def reduced(scheduler: OwnedBucketScheduler) -> list[torch.Tensor]:
    return [b.accumulator if b.accumulator is not None else b.grad for b in scheduler.buckets]


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_failed_step_leaves_scheduler_ready(mode: str) -> None:
    model, scheduler, comm = setup(mode)
    for case, failing in (("a collective fails", False), ("backward raises", True)):
        comm.fail_at = None if failing else comm.calls + 2  # the second bucket launched this step
        with pytest.raises(Injected):
            loss_of(model, 1, failing).backward()
            scheduler.finish()
        if failing:
            scheduler.discard_step()  # what the ZeRO engine does when backward raises
        assert scheduler.finish() is not None, f"{mode}, {case}: finish() after the failure raised again"
        comm.fail_at = None
        loss_of(model, 2).backward()
        scheduler.finish()
        for k, (got, want) in enumerate(zip(reduced(scheduler), expected_grads(2, scheduler), strict=True)):
            assert torch.equal(got, want), f"{mode}, {case}: bucket {k} is not the next step's gradient alone"
        scheduler.zero_grad()
    assert scheduler.transient_nbytes == 0, f"{mode}: {scheduler.transient_nbytes} bytes of transient buckets held"
