"""Multi-process tier: every collective on both transports, against a closed
form and against torch.distributed gloo on the same random data."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ringcomm
from harness import run_ranks
from ringcomm import ReduceOp

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
GLOO_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.SUM, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
            ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX}
# Tiny segments so that small tensors already take the multi-segment paths;
# "shm" stages every plain tensor, "shm-cma" reads plain tensors of 128 bytes
# and more from peers by cross-memory attach (single copy).
SMALL_SHM = ringcomm.ShmOptions(slot_nbytes=256, num_slots=2, oneshot_max_nbytes=64, cma=False)
SMALL_CMA = ringcomm.ShmOptions(slot_nbytes=256, num_slots=2, oneshot_max_nbytes=64, cma_min_nbytes=128,
                                cma_reduce_min_nbytes=128, cma_piece_nbytes=4096)  # 1000 float64: 2 pieces
SMALL_TORCH_DIST = ringcomm.TorchDistOptions(segment_nbytes=96)


def make_group(transport: str, timeout: float = 30.0) -> ringcomm.Group:
    shm = SMALL_CMA if transport == "shm-cma" else SMALL_SHM
    group = ringcomm.new_group(transport=transport.removesuffix("-cma"), timeout=timeout, shm=shm,
                               torch_dist=SMALL_TORCH_DIST)
    if transport == "shm-cma" and group.world_size > 1:
        assert "CMA (process_vm_readv)" in group.transport.describe(), group.transport.describe()
    return group


def sizes(world_size: int) -> list[int]:
    return [0, 1, 2, 7, 13, 31, 4 * world_size + 1, 127, 1000]


def random_data(numel, dtype, op, rank, case):
    gen = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    high = 3 if op == ReduceOp.PRODUCT else 1000
    return torch.randint(-high, high + 1, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def gloo_reduce(tensor: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
    """gloo all-reduce, in float64/int64 so the reference itself is exact; gloo has no AVG."""
    wide = tensor.to(torch.float64 if tensor.dtype.is_floating_point else torch.int64, copy=True)
    dist.all_reduce(wide, GLOO_OPS[op])
    if op == ReduceOp.AVG:
        wide = wide / world_size if wide.is_floating_point() else torch.div(wide, world_size, rounding_mode="trunc")
    return wide.to(tensor.dtype)


def assert_close(actual, expected, what):
    dtype = actual.dtype
    if not dtype.is_floating_point:
        assert torch.equal(actual, expected), what
    elif dtype in (torch.bfloat16, torch.float16):
        # ringcomm accumulates in float32 and rounds once: within one 16-bit ulp of the exact value.
        rtol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-3, msg=what)
    else:
        # float32 sums in another order than the float64 reference: a few ulps.
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=what)


def check_against_gloo(rank, world_size, transport):
    group = make_group(transport)
    case = 0
    for dtype in DTYPES:
        for op in ReduceOp:
            for numel in sizes(world_size):
                case += 1
                what = f"rank {rank} {transport} {dtype} {op.name} numel={numel}"
                data = random_data(numel * world_size, dtype, op, rank, case)
                expected_full = gloo_reduce(data, op, world_size)
                # all_reduce, in place
                tensor = data.clone()
                ringcomm.all_reduce(tensor, op, group=group)
                assert_close(tensor, expected_full, "all_reduce " + what)
                # reduce_scatter, out of place and in place (output = own chunk of input)
                own = slice(rank * numel, (rank + 1) * numel)
                output = torch.empty(numel, dtype=dtype)
                source = data.clone()
                ringcomm.reduce_scatter(output, source, op, group=group)
                assert_close(output, expected_full[own], "reduce_scatter " + what)
                assert torch.equal(source, data), "reduce_scatter modified its input " + what
                ringcomm.reduce_scatter(source[own], source, op, group=group)
                assert_close(source[own], expected_full[own], "reduce_scatter in place " + what)
            case = check_moves(group, rank, world_size, dtype, case, sizes(world_size), transport)
    ringcomm.barrier(group=group)


def check_moves(group, rank, world_size, dtype, case, numels, label) -> int:
    """all_gather (out of place and in place) and broadcast move bytes: exact
    against gloo, once per size. Returns the last case number used."""
    for numel in numels:
        case += 1
        what = f"rank {rank} {label} {dtype} numel={numel}"
        mine = random_data(numel, dtype, ReduceOp.SUM, rank, case)
        expected = torch.empty(numel * world_size, dtype=dtype)
        dist.all_gather_into_tensor(expected, mine)
        gathered = torch.empty(numel * world_size, dtype=dtype)
        ringcomm.all_gather(gathered, mine, group=group)
        assert torch.equal(gathered, expected), "all_gather " + what
        in_place = torch.zeros(numel * world_size, dtype=dtype)
        in_place[rank * numel:(rank + 1) * numel] = mine
        ringcomm.all_gather(in_place, in_place[rank * numel:(rank + 1) * numel], group=group)
        assert torch.equal(in_place, expected), "all_gather in place " + what
        root = case % world_size
        shared = mine.clone()
        ringcomm.broadcast(shared, src=root, group=group)
        assert torch.equal(shared, expected[root * numel:(root + 1) * numel]), f"broadcast root {root} " + what
    return case


def check_closed_form(rank, world_size, transport):
    """Rank r contributes r + 1 everywhere: sum n(n+1)/2, product n!, min 1, max n, avg (n+1)/2."""
    group = make_group(transport)
    n = world_size
    factorial = 1
    for k in range(1, n + 1):
        factorial *= k
    expected = {ReduceOp.SUM: n * (n + 1) // 2, ReduceOp.PRODUCT: factorial, ReduceOp.MIN: 1, ReduceOp.MAX: n}
    for dtype in DTYPES:
        for op in ReduceOp:
            value = expected.get(op)
            if op == ReduceOp.AVG:
                value = (n + 1) / 2 if dtype.is_floating_point else (n * (n + 1) // 2) // n
            for numel in (1, 37, 3000):
                tensor = torch.full((numel,), rank + 1, dtype=dtype)
                ringcomm.all_reduce(tensor, op, group=group)
                assert torch.all(tensor == value), f"rank {rank} {transport} {dtype} {op.name} {numel}: {tensor[:4]}"
                out = torch.empty(numel, dtype=dtype)
                ringcomm.reduce_scatter(out, torch.full((numel * n,), rank + 1, dtype=dtype), op, group=group)
                assert torch.all(out == value), f"rank {rank} {transport} reduce_scatter {dtype} {op.name} {numel}"
    # all_gather: chunk r is full of r.
    for numel in (0, 1, 37, 3000):
        out = torch.empty(numel * n, dtype=torch.int64)
        ringcomm.all_gather(out, torch.full((numel,), rank, dtype=torch.int64), group=group)
        assert torch.equal(out, torch.arange(n).repeat_interleave(numel)), f"rank {rank} all_gather {numel}"


def check_async_in_order(rank, world_size, transport):
    group = make_group(transport)
    tensors = [torch.full((500,), float(rank + i)) for i in range(6)]
    works = [ringcomm.all_reduce(t, group=group, async_op=True) for t in tensors]
    sync = torch.full((10,), 1.0)
    ringcomm.all_reduce(sync, group=group)  # queued behind the async ones
    for i, (t, work) in enumerate(zip(tensors, works)):
        assert work.wait(timeout=30) and work.is_completed()
        assert torch.all(t == sum(r + i for r in range(world_size))), f"rank {rank} async {i}"
        assert work.started_at <= work.finished_at, f"rank {rank} async {i}: timestamps"
        if i:
            assert works[i - 1].finished_at <= work.started_at, f"rank {rank} async {i} ran before {i - 1} ended"
    assert torch.all(sync == world_size)


def assert_bf16_rounds_once(group, rank, world_size, where):
    """Rank 0 adds 1, the others 2^-8: every bf16 running sum 1 + 2^-8 rounds back to 1 (a tie, to
    even), while the float32 sum 1 + (n - 1) 2^-8 rounds once to something above 1."""
    tiny = 2 ** -8
    for numel in (5, 700):
        tensor = torch.full((numel,), 1.0 if rank == 0 else tiny, dtype=torch.bfloat16)
        ringcomm.all_reduce(tensor, group=group)
        exact = torch.tensor(1 + (world_size - 1) * tiny, dtype=torch.float32).to(torch.bfloat16)
        assert torch.all(tensor == exact), f"rank {rank} {where} {numel}: {tensor[:3]} != {exact}"
        assert exact != torch.tensor(1.0, dtype=torch.bfloat16)


def check_bf16_rounds_once(rank, world_size, transport):
    assert_bf16_rounds_once(make_group(transport), rank, world_size, transport)


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_match_gloo(world_size, transport):
    run_ranks(check_against_gloo, world_size, transport, timeout=240)


@pytest.mark.parametrize("world_size", [2, 3])
def test_single_copy_matches_gloo(world_size):
    """Plain tensors read from peers by cross-memory attach (CMA)."""
    run_ranks(check_against_gloo, world_size, "shm-cma", timeout=240)


def boundary_numels(nbytes: int, unit: int) -> list[int]:
    """Numels whose size (numel * unit bytes) is just below, at (or just past) and above `nbytes`."""
    at = -(-nbytes // unit)
    return sorted({max(at - 1, 0), at, at + 1})


def check_thresholds(rank, world_size):
    """Every algorithm switch of the shm transport, at sizes just below, at and
    just above it: the staged one-shot and two-shot all-reduce (oneshot_max,
    slot size), single copy by CMA (cma_min), with the default options and
    with tiny ones; the lean path and the checked path (async) agree with gloo."""
    defaults = ringcomm.ShmOptions()
    tiny = ringcomm.ShmOptions(slot_nbytes=512, num_slots=2, oneshot_max_nbytes=128, cma_min_nbytes=256,
                               cma_reduce_min_nbytes=384)
    case = 0
    for options in (tiny, defaults):
        group = ringcomm.new_group(transport="shm", timeout=60, shm=options)
        bounds = (options.oneshot_max_nbytes, options.cma_min_nbytes, options.cma_reduce_min_nbytes,
                  options.slot_nbytes)
        for dtype, op in ((torch.float32, ReduceOp.SUM), (torch.bfloat16, ReduceOp.AVG), (torch.int64, ReduceOp.MAX)):
            esize = torch.empty(0, dtype=dtype).element_size()
            for bound in bounds:
                for numel in boundary_numels(bound, esize * world_size):  # all_reduce: numel * esize bytes
                    case += 1
                    what = f"rank {rank} {dtype} {op.name} numel={numel} * {world_size} near {bound} B"
                    data = random_data(numel * world_size, dtype, op, rank, case)
                    expected = gloo_reduce(data, op, world_size)
                    for async_op in (False, True):
                        tensor = data.clone()
                        work = ringcomm.all_reduce(tensor, op, group=group, async_op=async_op)
                        if work is not None:
                            work.wait()
                        assert_close(tensor, expected, f"all_reduce async={async_op} " + what)
                    own = slice(rank * numel, (rank + 1) * numel)
                    output = torch.empty(numel, dtype=dtype)
                    ringcomm.reduce_scatter(output, data.clone(), op, group=group)
                    assert_close(output, expected[own], "reduce_scatter " + what)
                    gathered = torch.empty(numel * world_size, dtype=dtype)
                    ringcomm.all_gather(gathered, data[own].clone(), group=group)
                    reference = torch.empty_like(gathered)
                    dist.all_gather_into_tensor(reference, data[own].contiguous())
                    assert torch.equal(gathered, reference), "all_gather " + what
                    shared = data.clone()
                    ringcomm.broadcast(shared, src=world_size - 1, group=group)
                    dist.broadcast(data, src=world_size - 1)
                    assert torch.equal(shared, data), "broadcast " + what
        group.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_algorithm_thresholds_match_gloo(world_size):
    run_ranks(check_thresholds, world_size, timeout=240)


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_closed_form(world_size, transport):
    run_ranks(check_closed_form, world_size, transport)


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_async_works_complete_in_order(transport):
    run_ranks(check_async_in_order, 3, transport)


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
@pytest.mark.parametrize("world_size", [3, 4])
def test_bf16_all_reduce_rounds_once(world_size, transport):
    run_ranks(check_bf16_rounds_once, world_size, transport)


def check_shm_windows(rank, world_size):
    """Tensors from ringcomm.empty take the zero-copy paths; same results as gloo."""
    group = ringcomm.new_group(transport="shm", timeout=30)
    case = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
            for numel in (1, 13, 40000):  # 40000: above the one-shot size, so the windowed all-reduce runs
                case += 1
                what = f"rank {rank} windows {dtype} {op.name} numel={numel}"
                data = random_data(numel * world_size, dtype, op, rank, case)
                expected = gloo_reduce(data, op, world_size)
                shared = ringcomm.empty(numel * world_size, dtype=dtype, group=group)
                shared.copy_(data)
                ringcomm.all_reduce(shared, op, group=group)
                assert_close(shared, expected, "all_reduce " + what)
                shared.copy_(data)
                out = ringcomm.empty(numel * world_size, dtype=dtype, group=group)
                ringcomm.all_reduce(shared, op, group=group, output=out)
                assert_close(out, expected, "all_reduce out of place " + what)
                assert torch.equal(shared, data), "all_reduce output= changed its input " + what
                own = slice(rank * numel, (rank + 1) * numel)
                chunk = torch.empty(numel, dtype=dtype)
                ringcomm.reduce_scatter(chunk, shared, op, group=group)
                assert_close(chunk, expected[own], "reduce_scatter " + what)
                ringcomm.reduce_scatter(shared[own], shared, op, group=group)
                assert_close(shared[own], expected[own], "reduce_scatter in place " + what)
                gathered = ringcomm.empty(numel * world_size, dtype=dtype, group=group)
                gathered[own] = data[own]
                ringcomm.all_gather(gathered, gathered[own], group=group)
                reference = torch.empty_like(gathered)
                dist.all_gather_into_tensor(reference, data[own].contiguous())
                assert torch.equal(gathered, reference), "all_gather in place " + what
                ringcomm.broadcast(gathered, src=world_size - 1, group=group)
                dist.broadcast(reference, src=world_size - 1)
                assert torch.equal(gathered, reference), "broadcast " + what
                del shared, out, gathered  # windows are released and forgotten; new ones reuse the addresses
    if world_size > 1:  # all ranks or none must pass shared tensors
        shared = ringcomm.empty(100, group=group)  # collective: every rank allocates
        mixed = shared if rank == 0 else torch.ones(100)
        with pytest.raises(ValueError, match="ringcomm.empty"):
            ringcomm.all_reduce(mixed, group=group)


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_shm_windows_match_gloo(world_size):
    run_ranks(check_shm_windows, world_size)
