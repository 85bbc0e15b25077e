"""The torch.distributed backend "ringcomm": every call equals gloo's on the same
random data, forwarded calls work, async Works complete in order
(init methods and launchers: test_backend_launch.py)."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import ringcomm  # noqa: F401  (registers the backend)
from ringcomm.backend.process_group import ProcessGroupRingcomm

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = ("sum", "avg", "max", "min")
NUMELS = (0, 1, 7, 1031)  # empty, one element, a prime, more than one shm one-shot message per rank

# Tolerances against gloo. ringcomm and gloo add the ranks' values in different
# orders, and in bf16/fp16 gloo rounds after every addition while ringcomm
# accumulates in fp32 and rounds once: up to world_size - 1 roundings apart
# (eps 2**-8 for bf16, 2**-11 for fp16) on sums of up to 4 N(0, 1) values.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 5e-2), torch.float16: (4e-3, 8e-3)}


def reinit(rank: int, world_size: int, init_method: str, backend: str = "ringcomm") -> None:
    """Swaps the harness's gloo default group for `backend` at `init_method`."""
    dist.barrier()  # every rank has finished connecting the harness's gloo group before any leaves it
    dist.destroy_process_group()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))


def check_transport(rank: int) -> None:
    kind = dist.group.WORLD._group.transport.kind
    wanted = os.environ["RINGCOMM_TRANSPORT"]
    assert kind == wanted, f"rank {rank}: transport {kind}, asked for {wanted}"


def rand(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def chunks(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """world_size equal views (torch.chunk gives fewer for an empty tensor)."""
    numel = tensor.numel() // world_size
    return [tensor[r * numel:(r + 1) * numel] for r in range(world_size)]


def expect_close(got: torch.Tensor, want: torch.Tensor, case: str, rank: int, op: str = "sum") -> None:
    rtol, atol = (0.0, 0.0) if op in ("max", "min") else TOLERANCE[got.dtype]  # max/min pick, never round
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"rank {rank}, {case}: {m}")


def gloo_reference(call: str, gloo: dist.ProcessGroup, op: str, world_size: int, *tensors: torch.Tensor) -> None:
    """Runs `call` on gloo; gloo has no AVG, so avg is sum / world_size."""
    redop = getattr(dist.ReduceOp, "SUM" if op == "avg" else op.upper())
    if call == "all_reduce":
        dist.all_reduce(tensors[0], redop, group=gloo)
    elif call == "reduce_scatter":
        dist.reduce_scatter_tensor(tensors[0], tensors[1], redop, group=gloo)
    if op == "avg":
        tensors[0].div_(world_size)


# ---- one process: names, argument errors, forwarding (no spawn) ----
def test_single_rank_group_checks_and_forwards() -> None:
    pg = ProcessGroupRingcomm(dist.HashStore(), 0, 1, timedelta(seconds=10))
    try:
        assert pg.name() == "ringcomm" and pg.rank() == 0 and pg.size() == 1
        pg._set_group_name("group-7")
        pg._set_group_desc("desc-7")
        assert (pg.group_name, pg.group_desc) == ("group-7", "desc-7")
        message = r"all_gather_single: pair 0: output.numel\(\)=4, input.numel\(\)=3.*rank 0"
        with pytest.raises(ValueError, match=message):
            pg.all_gather_single(torch.empty(4), torch.ones(3))
        with pytest.raises(ValueError, match="reduce_scatter_single.*rank 0"):
            pg.reduce_scatter_single(torch.empty(2), torch.ones(3))
        options = dist.BroadcastOptions()
        options.rootRank = 3
        with pytest.raises(ValueError, match=r"broadcast: root rank 3 outside the group \(world_size 1\) on rank 0"):
            pg.broadcast([torch.ones(2)], options)
        odd = torch.arange(6, dtype=torch.int8)  # not a ringcomm dtype: gloo does it
        work = pg.allreduce([odd])
        assert work.wait() and torch.equal(odd, torch.arange(6, dtype=torch.int8))
        assert torch.equal(work.get_future().value()[0], odd)
        tensor = torch.ones(5)
        assert pg.allreduce([tensor]).get_future().wait()[0] is tensor
    finally:
        pg.shutdown()


# ---- reduce calls (all_reduce, reduce_scatter in four spellings) vs gloo ----
def reductions_worker(rank: int, world_size: int, init_method: str) -> int:
    reinit(rank, world_size, init_method)
    check_transport(rank)
    gloo = dist.new_group(backend="gloo")
    checked = 0
    for seed, (dtype, op, numel) in enumerate((d, o, n) for d in DTYPES for o in OPS for n in NUMELS):
        case = f"{dtype} {op} numel={numel}"
        redop = getattr(dist.ReduceOp, op.upper())
        want = rand(seed, rank, numel, dtype)
        gloo_reference("all_reduce", gloo, op, world_size, want)
        for async_op in (False, True):
            got = rand(seed, rank, numel, dtype)
            work = dist.all_reduce(got, redop, async_op=async_op)
            if async_op:
                work.wait()
            expect_close(got, want, f"all_reduce async={async_op} {case}", rank, op)
        got = [rand(seed, rank, numel, dtype), rand(seed + 1, rank, numel, dtype)]
        dist.all_reduce_coalesced(got, redop)
        expect_close(got[0], want, f"all_reduce_coalesced {case}", rank, op)
        pairs = torch.zeros(numel, 2, dtype=dtype)  # a strided view: staged through a contiguous copy
        pairs[:, 0] = rand(seed, rank, numel, dtype)
        dist.all_reduce(pairs[:, 0], redop)
        expect_close(pairs[:, 0], want, f"all_reduce of a strided view {case}", rank, op)
        assert not pairs[:, 1].any(), f"rank {rank}: all_reduce of a strided view wrote outside it, {case}"
        checked += 4 + reduce_scatter_cases(rank, world_size, gloo, seed, dtype, op, numel)
    return checked


def reduce_scatter_cases(rank: int, world_size: int, gloo, seed: int, dtype: torch.dtype, op: str, numel: int) -> int:
    redop = getattr(dist.ReduceOp, op.upper())
    input = rand(seed, rank, numel * world_size, dtype)
    want = torch.empty(numel, dtype=dtype)
    gloo_reference("reduce_scatter", gloo, op, world_size, want, input)
    spellings = {
        "reduce_scatter_tensor": lambda out: dist.reduce_scatter_tensor(out, input, redop),
        "reduce_scatter_single": lambda out: dist.reduce_scatter_single(out, input, redop),
        "reduce_scatter (list)": lambda out: dist.reduce_scatter(out, chunks(input, world_size), redop),
        "reduce_scatter_tensor async": lambda out: dist.reduce_scatter_tensor(out, input, redop, async_op=True).wait(),
    }
    for name, call in spellings.items():
        got = torch.full((numel,), -7.0, dtype=dtype)
        call(got)
        expect_close(got, want, f"{name} {dtype} {op} numel={numel}", rank, op)
    with dist._coalescing_manager(async_ops=True) as manager:  # FSDP-style coalesced reduce-scatters
        got = [torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)]
        for out in got:
            dist.reduce_scatter_tensor(out, input, redop)
    manager.wait()
    for out in got:
        expect_close(out, want, f"coalesced reduce_scatter_tensor {dtype} {op} numel={numel}", rank, op)
    return len(spellings) + 1


# ---- data movement (all_gather in three spellings, broadcast, barrier): exact ----
def movement_worker(rank: int, world_size: int, init_method: str) -> int:
    reinit(rank, world_size, init_method)
    check_transport(rank)
    gloo = dist.new_group(backend="gloo")
    checked = 0
    for seed, (dtype, numel) in enumerate((d, n) for d in DTYPES for n in NUMELS):
        case = f"{dtype} numel={numel}"
        input = rand(seed, rank, numel, dtype)
        want = torch.empty(numel * world_size, dtype=dtype)
        dist.all_gather_into_tensor(want, input, group=gloo)
        spellings = {
            "all_gather_into_tensor": lambda out: dist.all_gather_into_tensor(out, input),
            "all_gather_single": lambda out: dist.all_gather_single(out, input),
            "all_gather_into_tensor async": lambda out: dist.all_gather_into_tensor(out, input, async_op=True).wait(),
            "all_gather (list)": lambda out: dist.all_gather(chunks(out, world_size), input),
            "all_gather_into_tensor 2-D": lambda out: dist.all_gather_into_tensor(out.view(world_size, numel), input),
        }
        for name, call in spellings.items():
            got = torch.full((numel * world_size,), -7.0, dtype=dtype)
            call(got)
            assert torch.equal(got, want), f"rank {rank}: {name} {case}: {got} != gloo's {want}"
        with dist._coalescing_manager(async_ops=True) as manager:
            got = [torch.empty(numel * world_size, dtype=dtype) for _ in range(2)]
            for out in got:
                dist.all_gather_into_tensor(out, input)
        manager.wait()
        assert all(torch.equal(out, want) for out in got), f"rank {rank}: coalesced all_gather {case}"
        for src in range(world_size):
            got = rand(seed, rank, numel, dtype)
            dist.broadcast(got, src)
            assert torch.equal(got, rand(seed, src, numel, dtype)), f"rank {rank}: broadcast src={src} {case}"
        strided = torch.stack([rand(seed, rank, numel, dtype)] * 2, dim=1)[:, 1]
        dist.broadcast(strided, world_size - 1)
        assert torch.equal(strided, rand(seed, world_size - 1, numel, dtype)), f"rank {rank}: strided broadcast {case}"
        checked += len(spellings) + 2 + world_size
    dist.barrier()
    dist.barrier(async_op=True).wait()
    return checked + 2


# (world_size, transport); with 3 ranks async calls run on the comm thread, else inline.
CASES = [(2, "shm"), (3, "shm"), pytest.param(4, "shm", marks=pytest.mark.slow), (3, "torch_dist")]


def case_env(world_size: int, transport: str) -> dict[str, str]:
    return {"RINGCOMM_TRANSPORT": transport, "RINGCOMM_ASYNC": "thread" if world_size == 3 else "inline"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,transport", CASES)
def test_reductions_match_gloo(world_size: int, transport: str, tmp_path) -> None:
    env = case_env(world_size, transport)
    checked = run_ranks(reductions_worker, world_size, f"file://{tmp_path}/rdv", timeout=100, env=env)
    assert checked[0] == len(DTYPES) * len(OPS) * len(NUMELS) * 9


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,transport", CASES)
def test_movement_matches_gloo(world_size: int, transport: str, tmp_path) -> None:
    env = case_env(world_size, transport)
    checked = run_ranks(movement_worker, world_size, f"file://{tmp_path}/rdv", timeout=100, env=env)
    assert checked[0] > 0


# ---- forwarded calls equal gloo's; the group is a ringcomm ProcessGroup ----
def forwarded_worker(rank: int, world_size: int, init_method: str) -> None:
    reinit(rank, world_size, init_method)
    world = dist.group.WORLD
    assert isinstance(world, ProcessGroupRingcomm) and dist.get_backend() == "ringcomm", f"rank {rank}: {world!r}"
    assert world.group_name and world.name() == "ringcomm", f"rank {rank}: {world.group_name=} {world.name()=}"
    check_transport(rank)
    gloo = dist.new_group(backend="gloo")
    p2p_across_collectives(rank, world_size)
    ours, theirs = forwarded_calls(rank, world_size), forwarded_calls(rank, world_size, group=gloo)
    for index, (got, want) in enumerate(zip(ours, theirs)):
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        assert same, f"rank {rank}: forwarded call {index}: {got} != {want}"
    members = [0, world_size - 1]  # a ringcomm subgroup (the default backend) of some ranks
    sub = dist.new_group(members)
    if rank in members:
        tensor = torch.full((3,), float(rank))
        dist.all_reduce(tensor, group=sub)
        assert isinstance(sub, ProcessGroupRingcomm) and torch.all(tensor == world_size - 1), f"rank {rank}: {tensor}"
    objects = [None] * world_size
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(world_size)], f"rank {rank}: all_gather_object {objects}"


def p2p_across_collectives(rank: int, world_size: int) -> None:
    """A user's irecv (tag 0) pending while all_reduce runs: the torch_dist ring's own
    tag-0 transfers must not land in it (the ring rides a gloo group of its own)."""
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    received = torch.empty(4)
    pending = dist.irecv(received, left, tag=0)
    tensor = torch.full((4096,), float(rank))
    dist.all_reduce(tensor)
    dist.isend(torch.full((4,), -1.0 - rank), right, tag=0).wait()
    pending.wait()
    assert torch.all(tensor == sum(range(world_size))), f"rank {rank}: all_reduce beside a pending irecv: {tensor[:4]}"
    assert torch.all(received == -1.0 - left), f"rank {rank}: irecv got {received}, not rank {left}'s message"


def forwarded_calls(rank: int, world_size: int, **group_kw) -> list[list[torch.Tensor]]:
    """Calls ringcomm does not accelerate; returns what each produced here."""
    mine = torch.arange(world_size * 3, dtype=torch.float32) + 100 * rank
    gathered = [torch.empty(3 * world_size) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, gathered, dst=0, **group_kw)
    scattered = torch.empty(3)
    dist.scatter(scattered, list(mine.chunk(world_size)) if rank == 0 else None, src=0, **group_kw)
    reduced = mine.clone()
    dist.reduce(reduced, dst=world_size - 1, **group_kw)
    swapped = torch.empty_like(mine)
    dist.all_to_all_single(swapped, mine, **group_kw)
    swapped_list = [torch.empty(3) for _ in range(world_size)]
    dist.all_to_all(swapped_list, list(mine.chunk(world_size)), **group_kw)
    odd = torch.arange(6, dtype=torch.int8).view(2, 3).t() + rank  # int8 and not contiguous: gloo does it
    dist.all_reduce(odd, **group_kw)
    ring_recv = torch.empty(3)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine[:3].clone(), right, **group_kw),
                                        dist.P2POp(dist.irecv, ring_recv, left, **group_kw)]):
        work.wait()
    if rank == 0:
        dist.send(mine, 1, **group_kw)
    elif rank == 1:
        dist.recv(swapped, 0, **group_kw)
    return [gathered or [], [scattered], [reduced], [swapped], swapped_list, [odd], [ring_recv]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size,transport", [(2, "shm"), (3, "torch_dist")])
def test_forwarded_calls_match_gloo(world_size: int, transport: str, tmp_path) -> None:
    run_ranks(forwarded_worker, world_size, f"file://{tmp_path}/rdv", timeout=50, env={"RINGCOMM_TRANSPORT": transport})


# ---- async Works complete in launch order, forwarded ones included ----
def async_order_worker(rank: int, world_size: int, init_method: str) -> None:
    reinit(rank, world_size, init_method)
    big = [torch.full((1 << 18,), float(rank + i)) for i in range(6)]
    small = torch.full((world_size * 4,), float(rank))
    works = []
    for i, tensor in enumerate(big):
        works.append(dist.all_reduce(tensor, async_op=True))
        if i == 2:
            works.append(dist.all_to_all_single(torch.empty_like(small), small, async_op=True))  # forwarded
    for index, work in enumerate(works):
        work.wait()
        late = [i for i, w in enumerate(works[:index]) if not w.is_completed()]
        assert not late, f"rank {rank}: work {index} finished before works {late}"
        total = sum(range(world_size))
    for i, tensor in enumerate(big):
        want = float(total + world_size * i)
        assert torch.all(tensor == want), f"rank {rank}: async all_reduce {i}: {tensor[:2]} != {want}"
    future = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    assert torch.equal(future.wait()[0], torch.full((3,), float(world_size))), f"rank {rank}: future {future.value()}"


@pytest.mark.parametrize("mode, transport, local_ranks, cores, thread", [
    ("auto", "shm", 2, 2, False), ("auto", "shm", 2, 3, False), ("auto", "shm", 2, 4, True),
    ("auto", "shm", 3, 6, True), ("auto", "torch_dist", 1, 1, False), ("auto", "torch_dist", 1, 2, True),
    ("auto", "torch_dist", 4, 7, False), ("thread", "shm", 2, 1, True), ("inline", "torch_dist", 1, 64, False)])
def test_auto_async_mode_follows_the_usable_cores(mode: str, transport: str, local_ranks: int, cores: int,
                                                  thread: bool, monkeypatch) -> None:
    """RINGCOMM_ASYNC=auto runs async calls on the comm thread when every rank on this machine
    has a spare core for it (shm: the group's ranks; torch_dist: LOCAL_WORLD_SIZE);
    a forced mode ignores the cores. The core count is injected, not this machine's."""
    from ringcomm.backend import work as backend_work

    monkeypatch.setenv("RINGCOMM_ASYNC", mode)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    monkeypatch.setattr(backend_work, "usable_cores", lambda: cores)
    world_size = local_ranks if transport == "shm" else 2 * local_ranks
    got = backend_work.use_comm_thread(transport, world_size)
    assert got is thread, f"RINGCOMM_ASYNC={mode} {transport} {local_ranks} local ranks on {cores} cores: {got}"
    monkeypatch.setenv("RINGCOMM_ASYNC", "threads")
    with pytest.raises(ValueError, match="RINGCOMM_ASYNC='threads'"):
        backend_work.use_comm_thread(transport, world_size)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_async_works_complete_in_order(mode: str, tmp_path) -> None:
    run_ranks(async_order_worker, 2, f"file://{tmp_path}/rdv", timeout=50, env={"RINGCOMM_ASYNC": mode})
