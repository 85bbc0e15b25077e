"""JoinedWork: the one torch Work over the per-pair Works of a forwarded coalesced
call (backend_ops.forward_all_gather_single / forward_reduce_scatter_single).
A coalesced all_gather_into_tensor / reduce_scatter_tensor that ringcomm does not
accelerate builds one; it completes when every part did, its future and
result() carry the outputs, and a failing part fails it."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from test_backend import reinit
from torch.distributed.distributed_c10d import AllgatherOptions

import ringcomm  # noqa: F401  (registers the backend)
from ringcomm.backend import ops as backend_ops
from ringcomm.backend.work import JoinedWork

NUMELS = (1, 7, 0, 1031)  # pairs of one call: a prime, an empty one, more than one shm message


class FailedWork(dist.Work):
    """A part that failed: its wait raises, its future carries the error (or,
    as gloo's reduce-scatter Works, it has no future)."""

    def __init__(self, error: RuntimeError, *, with_future: bool) -> None:
        super().__init__()
        self.error = error
        self.future = None
        if with_future:
            self.future = torch.futures.Future()
            self.future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self.error

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self.error

    def get_future(self) -> torch.futures.Future:
        if self.future is None:
            raise RuntimeError("Work::getFuture not implemented.")
        return self.future


def spy_joins() -> list[dist.Work]:
    """Records every Work backend_ops._join builds (the forwarded coalesced calls)."""
    made, join = [], backend_ops._join
    backend_ops._join = lambda works, value: made.append(join(works, value)) or made[-1]
    return made


def public_calls(rank: int, world_size: int, gloo: dist.ProcessGroup, made: list[dist.Work]) -> None:
    """int8 is no ringcomm dtype: the coalesced calls go to the internal gloo, split per pair."""
    inputs = [torch.randint(-99, 99, (numel,), generator=torch.Generator().manual_seed(rank * 10 + i),
                            dtype=torch.int8) for i, numel in enumerate(NUMELS)]
    with dist._coalescing_manager(async_ops=True) as manager:
        gathered = [torch.full((world_size * t.numel(),), -7, dtype=torch.int8) for t in inputs]
        for out, input in zip(gathered, inputs):
            dist.all_gather_into_tensor(out, input)
    manager.wait()
    for index, (out, input) in enumerate(zip(gathered, inputs)):
        want = torch.empty_like(out)
        dist.all_gather_into_tensor(want, input, group=gloo)
        assert torch.equal(out, want), f"rank {rank}: coalesced int8 all_gather pair {index}: {out} != gloo's {want}"
    # gloo's reduce-scatter Works have no future: the joined one must not need theirs
    with dist._coalescing_manager(async_ops=True) as manager:
        scattered = [torch.full((t.numel(),), -7, dtype=torch.int8) for t in inputs]
        for out, input in zip(scattered, gathered):
            dist.reduce_scatter_tensor(out, input)
    manager.wait()
    for index, (out, input) in enumerate(zip(scattered, gathered)):
        want = torch.empty_like(out)
        dist.reduce_scatter_tensor(want, input, group=gloo)
        assert torch.equal(out, want), f"rank {rank}: coalesced int8 reduce_scatter pair {index}: {out} != {want}"
    assert len(made) == 2 and all(isinstance(w, JoinedWork) for w in made), f"rank {rank}: the calls built {made}"


def joined_calls(rank: int, world_size: int, gloo: dist.ProcessGroup) -> None:
    """The Works the forwarding builds, read as a caller of the backend reads them."""
    internal = dist.group.WORLD._gloo
    inputs = [torch.full((numel,), float(rank + 1)) for numel in NUMELS]
    outputs = [torch.full((numel,), -7.0) for numel in NUMELS]
    big = [torch.randn(world_size * n, generator=torch.Generator().manual_seed(rank)) for n in NUMELS]
    # reduce-scatter first, waited through its future; the all-gather through wait()
    work = backend_ops.forward_reduce_scatter_single(internal, outputs, big, dist.ReduceScatterOptions())
    assert isinstance(work, JoinedWork), f"rank {rank}: {work!r}"
    future = work.get_future()
    value = future.wait()
    assert work.is_completed() and work.is_success() and work.exception() is None, f"rank {rank}: reduce_scatter"
    assert len(value) == len(outputs) and all(v is o for v, o in zip(value, outputs)), \
        f"rank {rank}: the future carries {value}, not the outputs"
    result = work.result()
    assert len(result) == len(outputs) and all(r is o for r, o in zip(result, outputs)), f"rank {rank}: result()"
    for index, (out, input) in enumerate(zip(outputs, big)):
        want = torch.empty_like(out)
        dist.reduce_scatter_tensor(want, input, group=gloo)
        assert torch.equal(out, want), f"rank {rank}: forwarded reduce_scatter pair {index}: {out} != gloo's {want}"
    gathered = [torch.full((world_size * n,), -7.0) for n in NUMELS]
    work = backend_ops.forward_all_gather_single(internal, gathered, inputs, AllgatherOptions())
    assert work.wait(timedelta(seconds=30)) and work.is_completed(), f"rank {rank}: all_gather wait"
    value = work.get_future().value()
    assert len(value) == len(gathered) and all(v is g for v, g in zip(value, gathered)), \
        f"rank {rank}: all_gather future carries {value}"
    assert len(work.result()) == len(gathered), f"rank {rank}: all_gather result()"
    closed_form = [torch.arange(1, world_size + 1, dtype=torch.float32).repeat_interleave(n) for n in NUMELS]
    for index, (out, want) in enumerate(zip(gathered, closed_form)):
        assert torch.equal(out, want), f"rank {rank}: all_gather pair {index} of rank+1 fills: {out} != {want}"


def a_failing_part(rank: int, world_size: int, *, with_future: bool) -> None:
    """One good part (a real gloo all-gather) and one failed: every reader sees the failure."""
    internal = dist.group.WORLD._gloo
    output, input = torch.empty(world_size * 3), torch.full((3,), float(rank))
    good = internal._allgather_base(output, input, AllgatherOptions())
    error = RuntimeError(f"part 1 failed on rank {rank}")
    work = JoinedWork([good, FailedWork(error, with_future=with_future)], [output])
    with pytest.raises(RuntimeError, match=f"part 1 failed on rank {rank}"):
        work.wait()
    with pytest.raises(RuntimeError, match=f"part 1 failed on rank {rank}"):
        work.get_future().wait()
    with pytest.raises(RuntimeError, match=f"part 1 failed on rank {rank}"):
        work.result()
    assert work.is_completed() and not work.is_success() and work.exception() is error, f"rank {rank}"
    assert torch.equal(output, torch.arange(world_size, dtype=torch.float32).repeat_interleave(3)), \
        f"rank {rank}: the good part still finished: {output}"


def joined_worker(rank: int, world_size: int, init_method: str) -> None:
    reinit(rank, world_size, init_method)
    gloo = dist.new_group(backend="gloo")
    made = spy_joins()
    public_calls(rank, world_size, gloo, made)
    joined_calls(rank, world_size, gloo)
    a_failing_part(rank, world_size, with_future=True)
    a_failing_part(rank, world_size, with_future=False)
    dist.barrier()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_joined_work(world_size: int, tmp_path) -> None:
    run_ranks(joined_worker, world_size, f"file://{tmp_path}/rdv", timeout=50,
              env={"RINGCOMM_TRANSPORT": "shm", "RINGCOMM_ASYNC": "thread" if world_size == 3 else "inline"})
