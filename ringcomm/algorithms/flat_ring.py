"""Ring over any torch.distributed process group (gloo on CPU, NCCL on CUDA):
how ringcomm spans hosts. Point-to-point transfers use the group's own
send/recv (transport/link.py); the ring itself is algorithms/ring.py walking
plan/schedule.py."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.arguments import INT64_MAX, check_int
from ..core.ops import ReduceOp, dtype_code
from ..plan import schedule
from ..transport import agreement, rendezvous
from ..transport.agreement import CallKey
from ..transport.lifecycle import CallGate
from ..transport.link import Diagnosis, P2PLink
from ..transport.placement import SETUP
from . import ring



@dataclass(frozen=True, slots=True)
class TorchDistOptions:
    segment_nbytes: int = 4 << 20
    # Compare every rank's call (op, dtype, sizes, the caller's key) before each
    # collective: one small all-gather ([Note: call agreement] in agreement.py).
    check_calls: bool = True

    def __post_init__(self) -> None:
        check_int("TorchDistOptions", "segment_nbytes", self.segment_nbytes, 1, INT64_MAX)
        if not isinstance(self.check_calls, bool):
            raise TypeError(f"TorchDistOptions: check_calls={self.check_calls!r} must be a bool")




class TorchDistTransport:
    kind = "torch_dist"
    p2p = None  # point-to-point: the backend forwards it to its process group (process_group.py)
    handle = None  # no lean calls
    levels = None  # one level

    def __init__(self, pg: dist.ProcessGroup, timeout_s: float, options: TorchDistOptions,
                 store: dist.Store | None = None) -> None:
        self.pg = pg
        self.rank, self.world_size = pg.rank(), pg.size()
        self.timeout_s = timeout_s
        self.options = options
        self._gate = CallGate(self.rank)
        self._link = P2PLink(pg, timeout_s, Diagnosis(store, self.rank, self.world_size), self._gate)
        self._scratch = ring.Scratch()
        self._backend_name = pg.name()

    def describe(self) -> str:
        """How bytes move, for benchmark headers, logs and tests."""
        return f"torch_dist: flat ring over {self.world_size} ranks on a {self._backend_name} group"

    @property
    def broken(self) -> str:
        """Why the transport refuses work after a failure ("" while it is usable)."""
        return self._link.broken

    def peer_aborted(self) -> str:
        """"": a peer's abort shows as its closed connections, which the ring's failure names."""
        return ""

    def mismatch_error(self, err: ValueError, op: str, key: CallKey | None = None) -> ValueError:
        """`err` as it is: the agreement step raised it naming every rank's call."""
        return err

    def learn_peers(self) -> None:
        """Collective, once every rank has made its transport: learns the ring
        neighbours' hosts, so that a failure names them without asking the store
        (which may sit across the failed link)."""
        link = self._link
        link.diagnosis.learn_hosts(sorted({link.left, link.right} - {self.rank}))
        link.name_peers()

    def stop_when(self, why: Callable[[], str]) -> None:
        """Before each transfer, calls why(); a non-empty answer fails the call in
        flight with it (and breaks the transport, as a failed transfer does)."""
        self._link.interrupt = why

    def supports(self, tensor: torch.Tensor) -> bool:
        return True

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)  # the ring stages nothing: plain memory is as good

    def _segment_numel(self, tensor: torch.Tensor) -> int:
        return max(1, self.options.segment_nbytes // tensor.element_size())

    def _check_call(self, op: str, tensor: torch.Tensor | None, numel: int, *, redop: int = -1, root: int = -1,
                    always: bool = False, agreed: bool = False, key: CallKey | None = None) -> None:
        """All ranks must call the same op on the same dtype and sizes, and with
        the same caller's key; a mismatch would otherwise pair unequal messages
        ([Note: call agreement]). Costs one small all-gather."""
        self._refuse_if_broken(op)
        if self.world_size == 1 or agreed or not (always or self.options.check_calls):
            return
        if tensor is not None:
            dtype_code(tensor.dtype, where=op)
        mine = torch.tensor(agreement.record(op, tensor, numel, redop=redop, root=root, key=key), dtype=torch.int64)
        everyone = self._share(op, mine)
        if not all(torch.equal(theirs, mine) for theirs in everyone):
            raise agreement.disagreement(op if key is None else key.op, [theirs.tolist() for theirs in everyone])

    def share(self, op: str, mine: torch.Tensor) -> list[torch.Tensor]:
        """Collective: every rank's `mine` (a small tensor of one shape and dtype
        on all ranks) by one all-gather, bounded by the timeout. For an agreement
        step of a caller above this transport (hierarchical.py)."""
        with self._gate.call(op):
            self._refuse_if_broken(op)
            return self._share(op, mine)

    def _refuse_if_broken(self, op: str) -> None:
        if self._link.broken:
            raise RuntimeError(f"{op}: rank {self.rank}: the group is unusable after an earlier failure: "
                               f"{self._link.broken}")

    def _share(self, op: str, mine: torch.Tensor) -> list[torch.Tensor]:
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        what = f"comparing the call with all ranks{self._link.neighbours}"
        self._link.wait(self._link.run(lambda: self.pg.allgather([everyone], [mine]), op, 0, what), op, 0, what)
        return everyone

    # agreed: the caller has compared the call across ranks already (the
    # hierarchical transport's agreement step): no check of its own.
    def all_reduce(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                   agreed: bool = False) -> None:
        with self._gate.call("all_reduce"):
            input, output = input.view(-1), output.view(-1)
            self._check_call("all_reduce", input, input.numel(), redop=int(op), agreed=agreed)
            chunks = schedule.chunk_bounds(input.numel(), self.world_size)
            own = chunks[self.rank]
            # In place is safe: the ring writes output's own chunk only in its last step,
            # element by element from the same elements of input.
            ring.reduce_scatter(self._link, output=output[own.begin:own.end], input=input, chunks=chunks, op=op,
                                segment_numel=self._segment_numel(input), name="all_reduce", scratch=self._scratch)
            ring.all_gather(self._link, output, chunks, self._segment_numel(output), name="all_reduce")

    def reduce_scatter(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                       agreed: bool = False) -> None:
        with self._gate.call("reduce_scatter"):
            input, output = input.view(-1), output.view(-1)
            self._check_call("reduce_scatter", input, output.numel(), redop=int(op), agreed=agreed)
            chunks = schedule.equal_chunks(output.numel(), self.world_size)
            ring.reduce_scatter(self._link, output=output, input=input, chunks=chunks, op=op,
                                segment_numel=self._segment_numel(input), scratch=self._scratch)

    def all_gather(self, *, output: torch.Tensor, input: torch.Tensor, agreed: bool = False,
                   key: CallKey | None = None) -> None:
        with self._gate.call("all_gather"):
            input, output = input.view(-1), output.view(-1)
            self._check_call("all_gather", input, input.numel(), agreed=agreed, key=key)
            chunks = schedule.equal_chunks(input.numel(), self.world_size)
            own = output[chunks[self.rank].begin:chunks[self.rank].end]
            if own.data_ptr() != input.data_ptr():
                own.copy_(input)
            ring.all_gather(self._link, output, chunks, self._segment_numel(output))

    def all_to_all(self, *, output: torch.Tensor, input: torch.Tensor, agreed: bool = False,
                   key: CallKey | None = None) -> None:
        """Chunk p of input to rank p, chunk p of output from rank p: world_size - 1
        pairwise steps (step k: to rank + k, from rank - k), each bounded by the timeout."""
        with self._gate.call("all_to_all"):
            input, output = input.view(-1), output.view(-1)
            chunk = output.numel() // self.world_size
            self._check_call("all_to_all", input, chunk, agreed=agreed, key=key)
            out, inp = output.view(self.world_size, chunk), input.view(self.world_size, chunk)
            out[self.rank].copy_(inp[self.rank])
            for k in range(1, self.world_size if chunk else 1):
                to, source = (self.rank + k) % self.world_size, (self.rank - k) % self.world_size
                self._link.exchange(inp[to], to, out[source], source, op="all_to_all", step=k)

    def broadcast(self, tensor: torch.Tensor, root: int, agreed: bool = False) -> None:
        with self._gate.call("broadcast"):
            self._check_call("broadcast", tensor, tensor.numel(), root=root, agreed=agreed)
            if self.world_size > 1 and tensor.numel() > 0:
                options = dist.BroadcastOptions()
                options.rootRank = root
                what = f"broadcasting from root {root}{self._link.neighbours}"
                self._link.wait(self._link.run(lambda: self.pg.broadcast([tensor], options), "broadcast", 0, what),
                                "broadcast", 0, what)

    def barrier(self) -> None:
        with self._gate.call("barrier"):
            self._check_call("barrier", None, 0, always=True)

    # [Note: torch_dist abort] gloo cannot interrupt a send or recv that a thread
    # waits on (its abort and shutdown leave the wait running, and its send/recv
    # Works have no future to wait on instead), so an abort here takes effect at
    # the call's next transfer: the call fails there, and once no call is in
    # flight the transport drops its process group, whose connections close, so
    # a peer blocked on this rank fails at once ("Connection closed by peer").
    # A transfer already blocked on a live peer that never answers still ends at
    # the group's timeout.
    def close(self, timeout_s: float | None = None) -> bool:
        """Refuses new calls, waits up to timeout_s (default: the group's timeout)
        for those in flight, aborts them past that; releases the process group
        once none is in flight. Returns whether they ended by themselves."""
        return self._gate.close(self.timeout_s if timeout_s is None else timeout_s, self._release)

    def abort(self) -> None:
        """The calls in flight fail at their next transfer ([Note: torch_dist abort]); later calls are refused."""
        self._gate.abort(self._release)

    def _release(self) -> None:
        """Drops every reference to the process group (its owner shuts it down), so
        that its connections close once no failed call's frames hold its Works."""
        self._link.pg = None
        self.pg = None


def open_torch_dist(store: dist.Store, rank: int, world_size: int, timeout_s: float, options: TorchDistOptions, *,
                    fallback: str = "") -> tuple[TorchDistTransport, dist.ProcessGroup]:
    """Collective: a torch_dist transport on a new gloo group made on `store`;
    the caller owns (and shuts down) the returned process group. `fallback`:
    why this flat ring stands in for a hierarchical transport."""
    rendezvous.check_in(store, "torch_dist/arrived", rank, world_size, timeout_s, SETUP)
    start = time.monotonic()
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timedelta(seconds=timeout_s))
    except RuntimeError as err:
        rendezvous.fail_naming_the_silent(store, "torch_dist/gloo", rank, world_size,
                                          timeout_s - (time.monotonic() - start), f"{SETUP} (gloo's connections)", err)
    rendezvous.check_in(store, "torch_dist/gloo", rank, world_size, timeout_s, SETUP, waiting=False)
    try:
        diagnosis_store = dist.PrefixStore("torch_dist/", store)
        transport = (FlatFallback(pg, timeout_s, options, diagnosis_store, fallback) if fallback
                     else TorchDistTransport(pg, timeout_s, options, diagnosis_store))
        rendezvous.check_in(store, "torch_dist/ready", rank, world_size, timeout_s, SETUP)
        transport.learn_peers()
    except BaseException:
        pg.shutdown()
        raise
    return transport, pg


class FlatFallback(TorchDistTransport):
    """The flat torch_dist ring, used where hierarchical was asked for but the
    placement does not allow it; describe() says why."""

    def __init__(self, pg: dist.ProcessGroup, timeout_s: float, options: TorchDistOptions, store: dist.Store,
                 reason: str) -> None:
        super().__init__(pg, timeout_s, options, store)
        self.reason = reason

    def describe(self) -> str:
        return f"torch_dist (flat ring; not hierarchical because {self.reason})"
