"""The comm backend seam: the four collectives the engine uses, on ringcomm or
on plain torch.distributed, and the count of bytes each rank sends (ring volume).

[Note: host tensors]
NCCL carries no host tensors. An engine with offload on a device model has
collectives on some (full_masters all-gathers host masters for a save), so
make_comm gives its comm a gloo group over the same ranks beside the default
one (`host`, as FSDP2's CPU offload and DeepSpeed's do) and every collective on
a host tensor goes through it; device tensors stay on the default group. Where
the default group carries host tensors (gloo, ringcomm, "cpu:gloo,cuda:nccl")
or the model is on the host, there is none.
"""
from __future__ import annotations

import warnings
from collections.abc import Collection
from typing import Protocol

import torch
import torch.distributed as dist

import ringcomm
from ringcomm.comm.quantized import Rows
from ringcomm.comm.work import completed_future
from ringcomm.core import compat
from ringcomm.core.ops import LOW_PRECISION
from ringcomm.plan.schedule import sent_numel

from ..monitor import comms
from .wire import Topology, WireReport
from .zeropp import ZeroPPOptions

BACKENDS = ("ringcomm", "torch")


class Handle(Protocol):
    def wait(self) -> object: ...

    def get_future(self) -> torch.futures.Future: ...


class _Done:
    """The handle of a collective that already finished."""

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return completed_future(None)


class Comm:
    """Collectives over every rank of the default process group. Subclasses
    implement `_all_reduce`, `_reduce_scatter`, `_all_gather`, `_broadcast`;
    this class handles world_size 1 and counts the wire bytes."""

    kind = "local"
    timeout_s = 1800.0  # the longest a bucket's reduction is waited for (torch.distributed's default timeout)

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.sent_nbytes = self.inside_nbytes = self.across_nbytes = 0
        self.topology: Topology | None = None  # set by the engine: splits sent bytes into inside / across hosts
        self.counter: Comm | None = None  # the comm whose counts this one adds to (hpZ's partition comm)
        self.zeropp = ZeroPPOptions()  # which collectives move quantized ([Note: ZeRO++ in zero])
        self.overlap = True  # zero_optimization.overlap_comm: False runs every collective inline
        self.host: Comm | None = None  # the collectives on host tensors, where not this one's ([Note: host tensors])

    def count(self, kind: str, tensor: torch.Tensor) -> None:
        """Adds the ring volume this rank sends for `kind` over `tensor` (full size)."""
        nbytes = tensor.numel() * tensor.element_size()
        widened = kind != "all_gather" and tensor.dtype in LOW_PRECISION
        self._add(sent_numel(kind, tensor.numel(), self.world_size) * tensor.element_size(), kind, nbytes, widened)

    def count_nbytes(self, kind: str, nbytes: int, all_to_all: bool = False) -> None:
        """count() for a collective of `nbytes` bytes in all (a quantized one's rows)."""
        self._add(sent_numel(kind, nbytes, self.world_size), kind, nbytes, all_to_all=all_to_all)

    def _add(self, sent: int, kind: str, nbytes: int, widened: bool = False, all_to_all: bool = False) -> None:
        """`sent`: the plain ring volume, for a comm whose topology (and so its
        transport's widening) is not known."""
        counter = self.counter or self
        if self.topology is not None:
            inside, across = self.topology.split(kind, nbytes, widened=widened, all_to_all=all_to_all)
            counter.inside_nbytes += inside
            counter.across_nbytes += across
            sent = inside + across
        counter.sent_nbytes += sent

    def take_wire(self) -> WireReport:
        """The bytes counted since the last call, by where they went ([Note: wire model]); restarts the count."""
        report = WireReport(self.sent_nbytes, self.inside_nbytes, self.across_nbytes)
        self.sent_nbytes = self.inside_nbytes = self.across_nbytes = 0
        return report

    def restore_wire(self, report: WireReport) -> None:
        """Sets the counts back to `report` (from take_wire()): the collectives
        between the two calls (set-up, checkpoints) are not a step's traffic."""
        self.sent_nbytes, self.inside_nbytes, self.across_nbytes = \
            report.sent_nbytes, report.inside_host_nbytes, report.across_host_nbytes

    def _quantized_all_gather(self, output, input, async_op):
        raise ValueError("zero: quantized collectives need comm_backend 'ringcomm'")

    _quantized_reduce_scatter = _quantized_all_gather

    def _host_for(self, tensor: torch.Tensor) -> Comm | None:
        """The comm a collective on `tensor` goes through instead of this one ([Note: host tensors])."""
        return self.host if self.host is not None and tensor.device.type == "cpu" else None

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle:
        """Sum in place."""
        if self.world_size == 1:
            return _Done()
        async_op = async_op and self.overlap
        if (host := self._host_for(tensor)) is not None:
            return host.all_reduce(tensor, async_op)
        self.count("all_reduce", tensor)
        return comms.timed("all_reduce", tensor, self._all_reduce, tensor, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
        """Sum; output (maybe a view of input's own chunk) gets chunk `rank`."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _Done()
        async_op = async_op and self.overlap
        if (host := self._host_for(input)) is not None:
            return host.reduce_scatter(output, input, async_op)
        if self.zeropp.quantized_gradients:  # zero_quantized_gradients: every gradient reduce-scatter
            rows = Rows(output.numel(), self.zeropp.grad_bits, self.zeropp.grad_block)
            self.count_nbytes("reduce_scatter", self.world_size * rows.nbytes, all_to_all=True)
            return comms.timed("reduce_scatter_tensor", input, self._quantized_reduce_scatter, output, input,
                               async_op)
        self.count("reduce_scatter", input)
        return comms.timed("reduce_scatter_tensor", input, self._reduce_scatter, output, input, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   quantized: bool = False) -> Handle:
        """quantized: the chunks move as blockwise int8 (zero_quantized_weights, [Note: ZeRO++ in zero])."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _Done()
        async_op = async_op and self.overlap
        if (host := self._host_for(input)) is not None:
            return host.all_gather(output, input, async_op, quantized=quantized)
        if quantized:
            rows = Rows(input.numel(), self.zeropp.weight_bits, self.zeropp.weight_block)
            self.count_nbytes("all_gather", self.world_size * rows.nbytes)
            return comms.timed("all_gather_into_tensor", input, self._quantized_all_gather, output, input, async_op)
        self.count("all_gather", output)
        return comms.timed("all_gather_into_tensor", input, self._all_gather, output, input, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.world_size > 1 and (host := self._host_for(tensor)) is not None:
            host.broadcast(tensor, src)
        elif self.world_size > 1:
            comms.timed("broadcast", tensor, self._broadcast, tensor, src)  # set-up: not step traffic

    def close(self) -> None:
        """Releases the host comm's group, if any; the default group belongs to torch.distributed / ringcomm."""
        if self.host is not None:
            self.host.close()
            self.host = None


class RingComm(Comm):
    kind = "ringcomm"

    def __init__(self, rank: int, world_size: int, group: ringcomm.Group) -> None:
        super().__init__(rank, world_size)
        self.group = group
        self.timeout_s = group.transport.timeout_s + 5.0  # the group's own waits fail first

    def _all_reduce(self, tensor, async_op):
        return ringcomm.all_reduce(tensor, ringcomm.ReduceOp.SUM, self.group, async_op=async_op) or _Done()

    def _reduce_scatter(self, output, input, async_op):
        return ringcomm.reduce_scatter(output, input, ringcomm.ReduceOp.SUM, self.group, async_op=async_op) or _Done()

    def _all_gather(self, output, input, async_op):
        return ringcomm.all_gather(output, input, self.group, async_op=async_op) or _Done()

    def _broadcast(self, tensor, src):
        ringcomm.broadcast(tensor, src, self.group)

    def _quantized_all_gather(self, output, input, async_op):
        z = self.zeropp
        return ringcomm.quantized_all_gather(output, input, self.group, bits=z.weight_bits, block=z.weight_block,
                                             async_op=async_op) or _Done()

    def _quantized_reduce_scatter(self, output, input, async_op):
        z = self.zeropp
        return ringcomm.quantized_reduce_scatter(output, input, ringcomm.ReduceOp.SUM, self.group, bits=z.grad_bits,
                                                 block=z.grad_block, async_op=async_op) or _Done()


class TorchComm(Comm):
    kind = "torch"

    def __init__(self, rank: int, world_size: int, pg: dist.ProcessGroup | None = None, *,
                 owned: bool = False) -> None:
        super().__init__(rank, world_size)
        self.pg = pg  # None: the default group
        self.owned = owned  # close() destroys pg

    def close(self) -> None:
        super().close()
        if self.owned and self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None

    def _all_reduce(self, tensor, async_op):
        return dist.all_reduce(tensor, group=self.pg, async_op=async_op) or _Done()

    def _reduce_scatter(self, output, input, async_op):
        target = output
        if _aliases(output, input):
            output = torch.empty_like(output)  # gloo wants distinct buffers: reduce, then copy back
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            work = dist.reduce_scatter_tensor(output, input, group=self.pg, async_op=async_op)
        if output is target:
            return work or _Done()
        if work is not None:
            work.wait()
        target.copy_(output)
        return _Done()

    def _all_gather(self, output, input, async_op):
        if _aliases(output, input):
            input = input.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return dist.all_gather_into_tensor(output, input, group=self.pg, async_op=async_op) or _Done()

    def _broadcast(self, tensor, src):
        dist.broadcast(tensor, dist.get_global_rank(self.pg, src) if self.pg is not None else src, group=self.pg)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def make_comm(backend: str, device: torch.device, *, host_tensors: bool = False) -> Comm:
    """The engine's collectives over the initialized default process group. On
    a CUDA model, "ringcomm" means the default group's own collectives: run the
    job on torch.distributed backend "ringcomm" and its CUDA tensors go to NCCL
    (ringcomm's transports move host memory). host_tensors: the engine has
    collectives on host tensors (offload), [Note: host tensors]. Collective."""
    if backend not in BACKENDS:
        raise ValueError(f"comm_backend: {backend!r} is not one of {BACKENDS}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return Comm(rank, world_size)
    if backend == "torch" or device.type != "cpu":
        comm = TorchComm(rank, world_size)
        carried = compat.device_types(dist.group.WORLD)  # the device types the default group has a backend for
        if needs_host_comm(device, carried, host_tensors=host_tensors):
            comm.host = TorchComm(rank, world_size, dist.new_group(backend="gloo"), owned=True)
            comm.host.counter = comm
        return comm
    return RingComm(rank, world_size, ringcomm.default_group())  # ringcomm keeps (and closes) it


def needs_host_comm(device: torch.device, carried: Collection[torch.device], *, host_tensors: bool) -> bool:
    """Whether an engine on `device` whose default group carries tensors of the
    `carried` devices needs a gloo group beside it ([Note: host tensors])."""
    return host_tensors and device.type != "cpu" and all(d.type != "cpu" for d in carried)


def make_partition_comm(comm: Comm, size: int) -> Comm:
    """Collective: collectives over this rank's run of `size` consecutive ranks
    (hpZ's secondary partition); close() releases its group."""
    made = {}
    for first in range(0, comm.world_size, size):
        ranks = list(range(first, first + size))
        made[first] = ringcomm.new_group(ranks, timeout=comm.group.transport.timeout_s) \
            if isinstance(comm, RingComm) else dist.new_group(ranks)
    mine = made[comm.rank - comm.rank % size]
    if isinstance(comm, RingComm):
        sub = RingComm(comm.rank % size, size, mine)
        sub.close = mine.close
    else:
        sub = TorchComm(comm.rank % size, size, mine)
    sub.overlap, sub.counter = comm.overlap, comm
    if comm.topology is not None:
        first = comm.rank - comm.rank % size
        sub.topology = Topology(comm.rank % size, comm.topology.hosts[first:first + size], hierarchical=False,
                                widens=isinstance(comm, RingComm) and mine.transport.kind == "torch_dist")
    return sub
