"""The backend's lean call path (see [Note: finished works]): one dense contiguous
CPU tensor (pair) per call goes straight to the transport. Its Works keep
torch's contract (the future carries the output tensors, made on demand), a
failing transport fails the caller on every path, inline and on the comm
thread, and the calls it refuses still take the general path. Results against
gloo on many ranks: test_backend.py and test_aliasing.py, which run through it."""
from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

import ringcomm  # noqa: F401  (registers the backend)
from ringcomm import _C
from ringcomm.comm import aliasing, collectives
from ringcomm.backend.work import BackendWork, FinishedWork, FinishedWorks, accelerated_redop, takes
from ringcomm.core import compat
from ringcomm.core.ops import DTYPE_CODES, ReduceOp
from ringcomm.backend.process_group import ProcessGroupRingcomm

cpp_work = torch._C._distributed_c10d._create_work_from_future  # a C++ reader of a torch future


def options(kind, async_op: bool):
    opts = kind()
    opts.asyncOp = async_op
    return opts


def lean_calls(pg: ProcessGroupRingcomm, async_op: bool) -> dict:
    """op -> (call returning the Work, the output tensor its future must carry)."""
    tensor, gathered, scattered = torch.arange(5.0), torch.full((5,), -1.0), torch.full((5,), -1.0)
    source, sent = torch.arange(5.0) + 10, torch.arange(5.0)
    return {
        "allreduce": (lambda: pg.allreduce([tensor], options(dist.AllreduceOptions, async_op)), tensor),
        "broadcast": (lambda: pg.broadcast([sent], options(dist.BroadcastOptions, async_op)), sent),
        "all_gather_single": (lambda: pg.all_gather_single(gathered, source, options(AllgatherOptions, async_op)),
                              gathered),
        "reduce_scatter_single": (
            lambda: pg.reduce_scatter_single(scattered, source, options(dist.ReduceScatterOptions, async_op)),
            scattered),
    }


@pytest.fixture(params=["inline", "thread"])
def group(request, monkeypatch):
    """A one-rank backend group whose async calls run inline or on the comm thread."""
    monkeypatch.setenv("RINGCOMM_ASYNC", request.param)
    pg = ProcessGroupRingcomm(dist.HashStore(), 0, 1, timedelta(seconds=10))
    yield pg
    pg.shutdown()


@pytest.mark.timeout(60)
def test_lean_works_keep_torch_contract(group) -> None:
    thread = group._comm_thread
    for async_op in (False, True):
        for op, (call, output) in lean_calls(group, async_op).items():
            where = f"{op} asyncOp={async_op} comm_thread={thread}"
            work = call()
            expected = BackendWork if (thread and async_op) else FinishedWork
            assert type(work) is expected, f"{where}: {type(work).__name__}"
            assert work.wait() and work.is_completed() and work.is_success() and work.exception() is None, where
            future = work.get_future()
            assert future is work.get_future(), f"{where}: a second get_future() made another future"
            value = future.wait()
            assert isinstance(value, list) and len(value) == 1 and value[0] is output, f"{where}: future value {value}"
            assert cpp_work(future).is_success(), f"{where}: C++ readers see a failure"
            assert work.result()[0] is output, where
            moved = op in ("all_gather_single", "reduce_scatter_single")  # one rank: output = input
            assert torch.equal(output, torch.arange(5.0) + (10 if moved else 0)), f"{where}: {output}"


@pytest.mark.timeout(60)
def test_lean_calls_are_in_flight_on_the_group(group, monkeypatch) -> None:
    """A call of the backend's own lean path (broadcast) is in flight on the
    Group as a checked call is: counted, and a call from a second thread while
    it runs is refused ([Note: one caller thread])."""
    seen = {}

    def broadcast(tensor: torch.Tensor, root: int) -> None:
        seen["in_flight"] = group._group._in_flight
        with ThreadPoolExecutor(1, thread_name_prefix="second") as pool:
            other = pool.submit(group.allreduce_coalesced, [torch.ones(2)], dist.AllreduceCoalescedOptions())
            try:
                other.result(timeout=30)
                seen["second"] = "ran"
            except RuntimeError as err:
                seen["second"] = str(err)

    assert group._group.lean_handle is not None, "a one-rank shm group takes lean calls"
    monkeypatch.setattr(group._group.transport, "broadcast", broadcast)
    group.broadcast([torch.ones(3)], options(dist.BroadcastOptions, False)).wait()
    assert seen["in_flight"] == 1, f"the lean broadcast is not counted in flight: {seen}"
    assert "collective(s) in flight" in seen["second"] and "'second" in seen["second"], seen["second"]
    assert group._group._in_flight == 0, "the lean call left the group with a call in flight"


def fail(*args, **kwargs) -> None:
    raise RuntimeError("injected: rank 0 lost its peer")


@pytest.mark.timeout(60)
def test_lean_call_failures_reach_every_reader(group, monkeypatch) -> None:
    """A transport error fails the call itself (inline, or sync) or its Work:
    wait, is_success, exception, and the future for Python and C++ readers."""
    transport = group._group.transport
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        monkeypatch.setattr(transport, name, fail)  # the general path and the comm thread
    for name in ("all_reduce_tensor", "reduce_scatter_tensors", "all_gather_tensors"):
        monkeypatch.setattr(_C, name, fail)  # the lean path: collectives.lean_*
    thread = group._comm_thread
    for async_op in (False, True):
        for op, (call, _) in lean_calls(group, async_op).items():
            where = f"{op} asyncOp={async_op} comm_thread={thread}"
            if not (thread and async_op):
                with pytest.raises(RuntimeError, match="injected"):
                    call()
                continue
            work = call()
            with pytest.raises(RuntimeError, match="injected"):
                work.wait()
            assert work.is_completed() and not work.is_success(), f"{where}: a failed Work reports success"
            assert "injected" in str(work.exception()), f"{where}: exception() {work.exception()!r}"
            with pytest.raises(RuntimeError, match="injected"):
                work.get_future().wait()
            assert not cpp_work(work.get_future()).is_success(), f"{where}: C++ readers see success"
    monkeypatch.undo()
    tensor = torch.ones(3)
    group.allreduce([tensor], options(dist.AllreduceOptions, False)).wait()  # the group still works
    assert torch.equal(tensor, torch.ones(3))


def test_lean_check_refuses_what_the_general_path_must_do(group) -> None:
    """The lean checks (C++ for ringcomm.comm.collectives, takes() for broadcast) run
    only plain dense contiguous CPU tensors of a ringcomm dtype, and pairs of
    matching size that overlap only in place; any other call does nothing
    there and returns False, for the checked path to handle or refuse."""
    def cpu(t):
        return t.is_cpu

    handle, sum_ = group._group.lean_handle, ReduceOp.SUM
    dense = torch.ones(6)
    assert takes(dense, cpu) and takes(torch.ones(2, 3, dtype=torch.bfloat16), cpu)
    assert _C.all_reduce_tensor(handle, dense, sum_, 10.0) is True, "refused a dense CPU tensor"
    refused = {
        "strided view": torch.ones(6, 2)[:, 0],
        "int8": torch.ones(6, dtype=torch.int8),
        "sparse COO": torch.ones(6).to_sparse(),
        "sparse CSR": torch.ones(2, 3).to_sparse_csr(),
        "meta": torch.ones(6, device="meta"),
        "subclass": torch.nn.Parameter(torch.ones(6)),
        "not a tensor": [1.0] * 6,
    }
    for what, tensor in refused.items():
        if isinstance(tensor, torch.Tensor) and what != "subclass":
            assert not takes(tensor, cpu), f"takes() accepted a {what} tensor"
        assert _C.all_reduce_tensor(handle, tensor, sum_, 10.0) is False, f"all_reduce_tensor took a {what}"
        assert _C.reduce_scatter_tensors(handle, dense, tensor, sum_, 10.0) is False, f"reduce_scatter took a {what}"
        assert _C.all_gather_tensors(handle, tensor, dense, 10.0) is False, f"all_gather took a {what}"
    assert not takes(dense, lambda t: False), "takes() ignored the transport's supports()"
    # pairs on this one-rank group: the big tensor holds 1 chunk of the small one's size
    buffer = torch.arange(8.0)
    for gather, call in ((False, lambda o, i: _C.reduce_scatter_tensors(handle, o, i, sum_, 10.0)),
                         (True, lambda o, i: _C.all_gather_tensors(handle, o, i, 10.0))):
        def pair(big, small):
            return call(big, small) if gather else call(small, big)

        assert pair(torch.ones(6), torch.ones(2)) is False, "numel 6 != 1 * 2"
        assert pair(torch.ones(2), torch.ones(2, dtype=torch.float64)) is False, "dtypes differ"
        assert pair(buffer[0:4], buffer[1:5]) is False, "the two overlap, not in place"
        assert pair(buffer[4:8], buffer[4:8]) is True, "in place: the small one is chunk `rank` of the big one"
        source, target = torch.arange(4.0), torch.zeros(4)
        assert pair(*((target, source) if gather else (source, target))) is True
        assert torch.equal(target, torch.arange(4.0)), f"gather={gather}: {target}"
    with pytest.raises(TypeError, match="expected 4 arguments"):
        _C.all_reduce_tensor(handle, dense, sum_)
    group._group.lean_handle = None  # what Group.run sets while work is queued
    assert not collectives.lean_all_reduce(dense, sum_, group._group), "the lean path ran while work was queued"


@pytest.fixture(params=["dlpack", "attributes"])
def reader(request):
    """The lean calls read tensors through DLPack's exchange function (recent
    torch) or, where torch has none, through seven of their attributes."""
    by_dlpack = request.param == "dlpack"
    if by_dlpack and not _C._lean_reads_by_dlpack():
        pytest.skip(f"torch {torch.__version__} has no __dlpack_c_exchange_api__")
    _C._lean_setup(torch.Tensor, torch.strided, DTYPE_CODES, *compat.profiler_flag(), dlpack=by_dlpack)
    assert _C._lean_reads_by_dlpack() == by_dlpack
    yield request.param
    _C._lean_setup(torch.Tensor, torch.strided, DTYPE_CODES, *compat.profiler_flag())


def described_by_torch(tensor: object) -> tuple | None:
    """What torch's own attributes say a lean call may take, as _lean_read
    gives it: (dtype code, data address, nbytes), or None."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or not tensor.is_cpu:
        return None
    if tensor.is_nested or tensor.dtype not in DTYPE_CODES or not tensor.is_contiguous():
        return None
    return DTYPE_CODES[tensor.dtype], tensor.data_ptr(), tensor.nbytes


def tensors_to_read() -> dict[str, object]:
    matrix = torch.arange(24.0).view(4, 6)
    dtypes = (*DTYPE_CODES, torch.int8, torch.uint8, torch.int16, torch.bool, torch.complex64, torch.float8_e4m3fn)
    return {
        "1-D": torch.ones(6), "0-D": torch.tensor(3.0), "empty": torch.empty(0), "empty 2-D": torch.empty(0, 3),
        "empty, a transpose's strides": torch.empty(0, 3).t(), "offset view": matrix.view(-1)[5:11],
        "rows": matrix[1:3], "a column": matrix[:, 2:3], "transposed": matrix.t(), "every other": matrix.view(-1)[::2],
        "size-1 dimension of any stride": matrix[2:3].t(),  # shape (6, 1), strides (1, 6): contiguous
        "expanded": torch.ones(1, 3).expand(4, 3),
        "channels last": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "requires grad": torch.ones(4, requires_grad=True),
        **{str(dtype): torch.ones(4).to(dtype) for dtype in dtypes},
        "sparse COO": torch.ones(6).to_sparse(), "sparse CSR": torch.ones(2, 3).to_sparse_csr(),
        "meta": torch.ones(6, device="meta"), "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "mkldnn": torch.ones(4).to_mkldnn(), "subclass": torch.nn.Parameter(torch.ones(4)), "not a tensor": [1.0],
    }


def test_lean_reads_tensors_as_torch_describes_them(reader) -> None:
    """Either reader takes exactly what torch's attributes call a plain dense
    contiguous CPU tensor of a ringcomm dtype, at its data address and size."""
    cases = tensors_to_read()
    for what, tensor in cases.items():
        assert _C._lean_read(tensor) == described_by_torch(tensor), f"{reader} reader, {what}"
    taken = [what for what, tensor in cases.items() if described_by_torch(tensor) is not None]
    assert {"0-D", "empty, a transpose's strides", "offset view", "size-1 dimension of any stride"} <= set(taken)


def test_finished_works_are_reused_only_when_no_one_else_holds_them() -> None:
    """[Note: reused finished works]: a Work held by Python, or by C++ (torch's
    work registry), keeps its value and its future; one no one holds is the next
    call's Work."""
    works = FinishedWorks()
    first, second, third = [torch.ones(1)], [torch.ones(2)], [torch.ones(3)]
    held = works(first)
    future = held.get_future()
    other = works(second)
    assert other is not held and held.result() is first and future.wait() is first
    released = weakref.ref(other)
    del other
    reused = works(third)
    assert reused is released(), "a Work no one held was not reused"
    assert reused.result() is third and reused.get_future().wait() is third
    assert held.result() is first and future.wait() is first
    registered = torch.ones(4)
    torch._C._distributed_c10d._register_work(registered, reused)  # what functional collectives do
    in_registry = weakref.ref(reused)
    del reused
    fresh = works(first)
    assert fresh is not in_registry() and in_registry().result() is third, "reused a Work the registry holds"
    torch.ops._c10d_functional.wait_tensor(registered)  # waits on it and drops it from the registry


def test_lean_reduce_ops() -> None:
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, name)
        assert accelerated_redop(opts) is ReduceOp[name], name
    for unsupported in (dist.ReduceOp.BAND, dist._make_nccl_premul_sum(2.0)):
        opts = dist.AllreduceOptions()
        opts.reduceOp = unsupported
        assert accelerated_redop(opts) is None, f"{unsupported} must be forwarded"
    assert accelerated_redop(dist.AllreduceOptions()) is ReduceOp.SUM
    assert accelerated_redop(object()) is ReduceOp.SUM  # options without reduceOp: torch's default


def test_lean_inputs_are_copied_exactly_when_they_overlap() -> None:
    buffer = torch.arange(40.0)
    output = buffer[0:40]
    own, straddling, outside = buffer[20:30], buffer[15:25], torch.zeros(10)
    assert aliasing.all_gather_input(output, own, rank=2) is own  # in place: chunk `rank` of the output
    assert aliasing.all_gather_input(output, outside, rank=1) is outside
    copied = aliasing.all_gather_input(output, straddling, rank=1)
    assert copied.data_ptr() != straddling.data_ptr() and torch.equal(copied, straddling)
    assert aliasing.reduce_scatter_input(own, output, rank=2) is output  # in place: the output is chunk `rank`
    assert aliasing.reduce_scatter_input(own, output, rank=1).data_ptr() != output.data_ptr()
    assert aliasing.reduce_scatter_input(torch.zeros(10), output, rank=1) is output
    assert not aliasing.overlaps(buffer[0:10], buffer[10:20]) and aliasing.overlaps(buffer[0:11], buffer[10:20])
    assert not aliasing.overlaps(buffer[0:0], buffer[0:10])  # an empty tensor overlaps nothing
