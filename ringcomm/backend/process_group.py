"""The torch.distributed backend "ringcomm": a Python dist.ProcessGroup that runs
the collectives ringcomm accelerates on its transports and forwards every other
call to an internal gloo (CPU) or NCCL (CUDA) backend."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from ..comm import collectives
from ..comm.group import GroupOptions, create_group
from ..core import attempt, compat
from ..core.ops import ReduceOp
from ..observe import profiling
from . import ops as backend_ops, p2p as backend_p2p
from .forwarding import ForwardingGloo
from .registration import BACKEND_NAME
from .work import (FinishedWorks, accelerated_redop, accelerates, backend_work, is_async, on_cuda, takes,
                   use_comm_thread, wait_forwarded)

STORE_PREFIX = "ringcomm-backend/"

# [Note: what runs where]
# Accelerated (CPU tensors of a ringcomm dtype, contiguous, a ringcomm op):
#   allreduce(+_coalesced), broadcast, allgather, all_gather_single(+_coalesced),
#   reduce_scatter, reduce_scatter_single(+_coalesced), barrier -> ringcomm transport.
#   One dense contiguous tensor (allreduce, broadcast) or pair (all_gather_single,
#   reduce_scatter_single) with torch's options, in a call that runs inline,
#   takes the lean path: straight to the transport, with no Group.run, when the
#   group takes lean calls (nothing queued; one thread at a time). allreduce and
#   the pairs take ringcomm.comm.collectives' own lean path ([Note: lean path]),
#   broadcast takes() and _run_lean (Group.run_lean: run's bookkeeping, inline).
#   Their Works are FinishedWorks ([Note: finished works] in backend/work.py); any other
#   call goes the general path, which checks it.
# Forwarded collectives (gather, scatter, reduce, all_to_all, allgather_coalesced,
# and accelerated ones whose tensors ringcomm does not take) -> an internal gloo
# group of their own ([Note: forwarded works at exit] in forwarding.py), but
# run through the ringcomm group like its own calls (Group.run), so that every
# collective of this group completes in launch order.
# Point-to-point (send, recv, recv_anysource; isend, irecv, batch_isend_irecv are
# made of them) on dense CPU tensors of any dtype -> the transport's channels
# where it has them (shm: [Note: p2p channels] in csrc/cpu/shm_p2p.cpp), else the
# internal gloo group (torch_dist, hierarchical: the way across hosts), through
# backend/p2p.py either way (the group's timeout, named errors, ringcomm:send/recv
# events). Never queued on the comm thread: a posted call returns at once, and
# its Work makes progress when waited (a recv waiting on the comm thread would
# stall the send its peer posts after it). Sparse tensors -> gloo as they are.
# CUDA tensors -> internal NCCL backend, as they are (its own streams keep order).

# [Note: async calls]
# An async call (async_op=True, and every call from DDP's reducer) runs on the
# group's comm thread only when each local rank has a spare core for it
# (RINGCOMM_ASYNC=auto: cores this process may use >= 2 * local ranks). Otherwise it runs inline and
# returns a finished Work: with ranks >= cores, a comm thread that spins on shm
# flags takes the core its own rank computes on (measured here, 2 ranks on 2
# vCPUs: DDP steps 1.6x slower than inline), and the hand-off costs ~0.6 ms per
# call. RINGCOMM_ASYNC=thread|inline forces one. Inline, a rank must issue the
# async calls of different groups in the same order as its peers.


class ProcessGroupRingcomm(dist.ProcessGroup):
    """One group of torch.distributed on ringcomm's collectives."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta, *,
                 global_ranks: tuple[int, ...] | None = None) -> None:
        """`global_ranks`: the group's ranks in the default group, for the flight
        recorder (None: the group is the world)."""
        super().__init__(rank, world_size)  # the (store, rank, size) form is not subclassable in 2.13
        self._rank, self._world_size = rank, world_size
        self._timeout_s = timeout.total_seconds()
        self._group_name, self._group_desc = "", ""
        store = dist.PrefixStore(STORE_PREFIX, attempt.scoped(store))  # [Note: attempt-scoped keys]
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout)
        compat.register_device_backend(self, torch.device("cpu"), self._gloo)
        # Forwarded collectives: a gloo group of their own ([Note: forwarded works at exit]).
        self._forwarding = ForwardingGloo(self, dist.PrefixStore("gloo-forwarded/", store), rank, world_size, timeout)
        self._nccl = _nccl_backend(dist.PrefixStore("nccl/", store), rank, world_size, timeout)
        if self._nccl is not None:
            compat.register_device_backend(self, torch.device("cuda"), self._nccl)
        # No pg: a torch_dist transport gets its own gloo group, so that its ring's
        # tags never meet the user's send/recv tags on self._gloo.
        self._group = create_group(dist.PrefixStore("group/", store), rank, world_size,
                                   options=GroupOptions(timeout_s=self._timeout_s), global_ranks=global_ranks)
        self._comm_thread = use_comm_thread(self._group.transport.kind, world_size)
        self._transport = self._group.transport  # a group keeps its transport
        self._supports = self._transport.supports  # the lean path's check
        self._p2p = self._transport.p2p or backend_p2p.ForwardedPointToPoint(self._gloo, rank, self._timeout_s)
        self._finished = FinishedWorks()  # the Works of inline calls ([Note: reused finished works])

    # ---- names (FSDP2's DeviceMesh resolves groups by name) ----
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    # ---- accelerated collectives ----
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts or dist.AllreduceOptions()
        redop = accelerated_redop(opts)
        if (redop is not None and len(tensors) == 1 and self._may_run_lean(opts)
                and collectives.lean_all_reduce(tensors[0], redop, self._group)):
            return self._finished(tensors)
        if redop is None or not self._accelerates(tensors, strided=True):
            return self._forward("allreduce", tensors, lambda b: b.allreduce(tensors, opts), opts, inputs=tensors)
        return self._run("allreduce", backend_ops.all_reduce(self._transport, tensors, redop), opts, tensors,
                         inputs=tensors, redop=redop)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts or dist.AllreduceCoalescedOptions()
        redop = accelerated_redop(opts)
        if redop is None or not self._accelerates(tensors, strided=True):
            return self._forward("allreduce_coalesced", tensors, lambda b: b.allreduce_coalesced(tensors, opts),
                                 opts, inputs=tensors)
        return self._run("allreduce_coalesced", backend_ops.all_reduce(self._transport, tensors, redop), opts, tensors,
                         inputs=tensors, redop=redop)

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        if (isinstance(opts, dist.BroadcastOptions) and len(tensors) == 1 and takes(tensors[0], self._supports)
                and 0 <= opts.rootRank < self._world_size):
            fn = partial(self._transport.broadcast, tensors[0], opts.rootRank)
            return self._run_lean("broadcast", fn, opts, tensors, inputs=tensors)
        opts = opts or dist.BroadcastOptions()
        if not self._accelerates(tensors, strided=True):
            return self._forward("broadcast", tensors, lambda b: b.broadcast(tensors, opts), opts, inputs=tensors)
        backend_ops.check_root("broadcast", opts.rootRank, self._rank, self._world_size)
        return self._run("broadcast", backend_ops.broadcast(self._transport, tensors, opts.rootRank), opts, tensors,
                         inputs=tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts or AllgatherOptions()
        flat = [t for outputs in output_lists for t in outputs] + list(inputs)
        if len(inputs) != 1 or not self._accelerates(flat) or not backend_ops.equal_numels(flat):
            return self._forward("allgather", flat, lambda b: b.allgather(output_lists, inputs, opts), opts,
                                 inputs=inputs)
        backend_ops.check_list("allgather", output_lists[0], self._rank, self._world_size)
        fn = backend_ops.all_gather_list(self._transport, output_lists[0], inputs[0])
        return self._run("allgather", fn, opts, output_lists[0], inputs=inputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        if (isinstance(opts, AllgatherOptions) and self._may_run_lean(opts)
                and collectives.lean_all_gather(output, input, self._group)):
            return self._finished([output])
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> dist.Work:
        opts = opts or AllgatherOptions()
        if not self._accelerates_pairs(outputs, inputs):
            return self._forward("all_gather_single", outputs + inputs,
                                 lambda b: backend_ops.forward_all_gather_single(b, outputs, inputs, opts), opts,
                                 inputs=inputs)
        backend_ops.check_pairs("all_gather_single", outputs, inputs, self._rank, self._world_size, gather=True)
        return self._run("all_gather_single", backend_ops.all_gather(self._transport, outputs, inputs), opts, outputs,
                         inputs=inputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts=None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        redop = accelerated_redop(opts)
        flat = list(outputs) + [t for inputs in input_lists for t in inputs]
        if len(outputs) != 1 or redop is None or not self._accelerates(flat) or not backend_ops.equal_numels(flat):
            return self._forward("reduce_scatter", flat, lambda b: b.reduce_scatter(outputs, input_lists, opts),
                                 opts,
                                 inputs=flat[len(outputs):])
        backend_ops.check_list("reduce_scatter", input_lists[0], self._rank, self._world_size)
        fn = backend_ops.reduce_scatter_list(self._transport, outputs[0], input_lists[0], redop)
        return self._run("reduce_scatter", fn, opts, outputs, inputs=flat[1:], redop=redop)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        if isinstance(opts, dist.ReduceScatterOptions) and self._may_run_lean(opts):
            redop = accelerated_redop(opts)
            if redop is not None and collectives.lean_reduce_scatter(output, input, redop, self._group):
                return self._finished([output])
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        redop = accelerated_redop(opts)
        if redop is None or not self._accelerates_pairs(outputs, inputs):
            return self._forward("reduce_scatter_single", outputs + inputs,
                                 lambda b: backend_ops.forward_reduce_scatter_single(b, outputs, inputs, opts), opts,
                                 inputs=inputs)
        backend_ops.check_pairs("reduce_scatter_single", outputs, inputs, self._rank, self._world_size, gather=False)
        fn = backend_ops.reduce_scatter(self._transport, outputs, inputs, redop)
        return self._run("reduce_scatter_single", fn, opts, outputs, inputs=inputs, redop=redop)

    # torch <= 2.12 names of the same calls
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None) -> dist.Work:
        opts = opts or dist.BarrierOptions()
        return self._run("barrier", self._transport.barrier, opts, [])

    # ---- forwarded collectives (queued in order; see [Note: what runs where]) ----
    def gather(self, output_lists, inputs, opts=None) -> dist.Work:
        tensors = [t for outputs in output_lists for t in outputs] + list(inputs)
        return self._forward("gather", tensors, lambda b: b.gather(output_lists, inputs, opts), opts, inputs=inputs)

    def scatter(self, outputs, input_lists, opts=None) -> dist.Work:
        tensors = list(outputs) + [t for inputs in input_lists for t in inputs]
        return self._forward("scatter", tensors, lambda b: b.scatter(outputs, input_lists, opts), opts,
                             inputs=tensors[len(outputs):] or outputs)

    def reduce(self, tensors, opts=None) -> dist.Work:
        return self._forward("reduce", tensors, lambda b: b.reduce(tensors, opts), opts, inputs=tensors)

    def alltoall(self, outputs, inputs, opts=None) -> dist.Work:
        tensors = list(outputs) + list(inputs)
        return self._forward("alltoall", tensors, lambda b: b.alltoall(outputs, inputs, opts), opts, inputs=inputs)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None) -> dist.Work:
        return self._forward("all_to_all_single", [output, input],
                             lambda b: b.alltoall_base(output, input, output_splits, input_splits, opts), opts,
                             inputs=[input])

    alltoall_base = all_to_all_single

    def allgather_coalesced(self, output_lists, inputs, opts=None) -> dist.Work:
        tensors = [t for outputs in output_lists for t in outputs] + list(inputs)
        return self._forward("allgather_coalesced", tensors,
                             lambda b: b.allgather_coalesced(output_lists, inputs, opts), opts, inputs=inputs)

    # ---- point-to-point (see [Note: what runs where]) ----
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._point_to_point(backend_p2p.SEND, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._point_to_point(backend_p2p.RECV, tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._point_to_point(backend_p2p.RECV_ANYSOURCE, tensors, None, tag)

    def _point_to_point(self, op: str, tensors: list[torch.Tensor], peer: int | None, tag: int) -> dist.Work:
        if all(map(backend_p2p.takes, tensors)):  # start() refuses any count but one
            return backend_p2p.start(self._p2p, op, tensors, peer, tag, rank=self._rank, world_size=self._world_size)
        if on_cuda(tensors) and self._nccl is None:
            raise RuntimeError(f"{op}: rank {self._rank} got CUDA tensors but NCCL is not available here")
        backend = self._nccl if on_cuda(tensors) else self._gloo
        if op == backend_p2p.SEND:
            return backend.send(tensors, peer, tag)
        return backend.recv_anysource(tensors, tag) if peer is None else backend.recv(tensors, peer, tag)

    # ---- lifetime: see [Note: group lifetime] in comm/group.py ----
    def shutdown(self) -> None:
        """As ProcessGroupNCCL.shutdown (which destroy_process_group calls): new
        calls are refused, the calls in flight and queued may finish (up to the
        group's timeout, then they are aborted), then everything is released."""
        self._group.close()
        self._forwarding.release()
        for backend in (self._gloo, self._nccl):
            if backend is not None:
                backend.shutdown()

    def abort(self) -> None:
        """As ProcessGroupNCCL.abort: the call in flight fails at once, queued ones
        fail without starting ("aborted"); then everything is released."""
        self._group.abort()
        self._forwarding.abort()
        for backend in (self._gloo, self._nccl):
            if backend is not None:
                backend.abort()

    def __repr__(self) -> str:
        return f"ProcessGroupRingcomm(rank={self._rank}, world_size={self._world_size}, {self._group!r})"

    # ---- helpers ----
    def _accelerates(self, tensors: Sequence[torch.Tensor], *, strided: bool = False) -> bool:
        """Dense tensors only: sparse ones go to gloo, which reduces them as sparse."""
        return (all(t.layout == torch.strided for t in tensors)
                and accelerates(tensors, self._transport.supports, strided=strided))

    def _accelerates_pairs(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
        return (len(outputs) == len(inputs) and self._accelerates(outputs + inputs)
                and all(o.dtype == i.dtype for o, i in zip(outputs, inputs)))

    def _run(self, op: str, fn: Callable[[], None], opts: object, value: object, *,
             inputs: Sequence[torch.Tensor] = (), redop: ReduceOp | None = None) -> dist.Work:
        """Runs `fn` inline when the caller waits (or see [Note: async calls]) and
        nothing is queued, else on the group's comm thread, in launch order; on
        the comm thread always while a profiler records ([Note: profiler events]).
        Inline, the Work is a FinishedWork (see [Note: finished works])."""
        on_thread = (self._comm_thread and is_async(opts)) or profiling.active()
        return backend_work(self._group.run(op, fn, on_thread, inputs=inputs, outputs=_outputs(value), redop=redop),
                            value)

    def _may_run_lean(self, opts: object) -> bool:
        """Whether a call with these options runs inline (see [Note: async calls]),
        so it may take ringcomm.comm.collectives' lean path ([Note: lean path]); that
        path runs it only when the group takes lean calls (nothing queued)."""
        return not (self._comm_thread and opts.asyncOp)

    def _run_lean(self, op: str, fn: Callable[[], None], opts: object, value: list[torch.Tensor], *,
                  inputs: Sequence[torch.Tensor]) -> dist.Work:
        """_run for a transport call of the lean path: when it would run inline
        and the group takes lean calls, Group.run_lean runs it, else _run."""
        if self._may_run_lean(opts) and self._group.run_lean(op, fn, inputs, value):
            return self._finished(value)
        return self._run(op, fn, opts, value, inputs=inputs)

    def _forward(self, op: str, tensors: Sequence[torch.Tensor], call: Callable[[dist.ProcessGroup], dist.Work],
                 opts: object, value: object = None, *, inputs: Sequence[torch.Tensor] = ()) -> dist.Work:
        """Runs `call` on the internal NCCL backend (CUDA tensors) or gloo backend."""
        if on_cuda(tensors):
            if self._nccl is None:
                raise RuntimeError(f"{op}: rank {self._rank} got CUDA tensors but NCCL is not available here")
            return call(self._nccl)

        def body() -> None:
            wait_forwarded(call(self._forwarding.backend), op, self._rank, self._timeout_s)

        return self._run(op, body, opts, list(tensors) if value is None else value, inputs=inputs)


def _outputs(value: object) -> Sequence[torch.Tensor]:
    """The output tensors in a Work's value (a list of them, or nothing)."""
    return value if isinstance(value, list) else ()


def _nccl_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup | None:
    """The internal NCCL backend for CUDA tensors, where CUDA and NCCL exist.
    ProcessGroupNCCL makes its communicators lazily, on the first CUDA call."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    return dist.ProcessGroupNCCL(store, rank, world_size, compat.nccl_options(timeout))


def create_backend(options: object, backend_options: object = None) -> ProcessGroupRingcomm:
    """The creator torch.distributed calls for backend "ringcomm" (its extended
    form: `options` is a _DistributedBackendOptions, whose global ranks are
    empty for the default group; `backend_options`, the caller's pg_options, is
    not used)."""
    return ProcessGroupRingcomm(options.store, options.group_rank, options.group_size, options.timeout,
                                global_ranks=tuple(options.global_ranks_in_group) or None)
