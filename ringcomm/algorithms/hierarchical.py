"""Hierarchical transport for groups that span hosts: shared memory inside each
host, a torch_dist ring across hosts between the ranks of one local rank, so
the bytes that cross hosts shrink by the number of ranks per host."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..core.ops import LOW_PRECISION, ReduceOp, partial_op
from ..kernels.cpu import reduce_into
from ..transport import agreement
from ..transport.agreement import CallKey
from ..transport.base import Levels
from ..transport.link import Diagnosis
from ..transport.placement import Placement, consecutive, ranks_on_this_machine
from ..transport.shm import ShmOptions, ShmTransport
from . import ring
from .flat_ring import TorchDistOptions, TorchDistTransport, open_torch_dist
from .pipeline import Pipeline, Stages, num_pieces, pieces

LOCAL_EXPLAIN_S = 2.0  # how long a rank failed by a local peer waits for that peer's report
LOCAL_STORE_S = 0.5  # and for a store that does not answer, beyond that


class HierarchicalTransport:
    """[Note: hierarchical collectives]
    H hosts x L ranks per host. `local` is an shm transport over this host's L
    ranks; `cross` is a torch_dist ring over the H ranks that share this rank's
    local rank (cross rank = host number). With c = output (reduce-scatter)
    or input (all-gather) numel:

      all_reduce:     local reduce-scatter (shard = 1/L) -> cross all-reduce of
                      the shard -> local all-gather; elements past the last
                      multiple of L, and tensors up to the shm one-shot size
                      (where latency counts, not bytes), go through a local
                      and a cross all-reduce.
      reduce_scatter: for each host h, a local reduce-scatter of the L chunks of
                      h's ranks (in local order) -> [H, c] partials -> cross
                      reduce-scatter: chunk h is this rank's.
      all_gather:     cross all-gather of the input -> [H, c]; for each host h a
                      local all-gather of part h into the chunks of h's ranks.

    Each starts with the agreement step (_agree): every rank's call reaches
    every rank over both levels, so a mismatch raises on all ranks alike.

    A host's chunks are contiguous when its ranks are consecutive (host-major
    placement); then the data moves in place, else through a scratch buffer.
    The bytes crossing hosts shrink by L against a flat ring (by L/2 for 16-bit
    floats, whose shards cross in float32).

    Precision: AVG runs as SUM on both levels and divides once by the world
    size. 16-bit floats are widened to float32 before the local step; both
    levels sum in float32 and the result is rounded once, at the end (the cost:
    one widening copy and float32 shards across hosts).
    """

    kind = "hierarchical"
    p2p = None  # point-to-point: the backend forwards it to its process group (process_group.py)
    handle = None  # no lean calls

    def __init__(self, rank: int, placement: Placement, local: ShmTransport, cross: TorchDistTransport,
                 cross_pg: dist.ProcessGroup, *, whole_max_nbytes: int, board: Diagnosis | None = None) -> None:
        self.rank = rank
        self.world_size = len(placement.hosts)
        self.timeout_s = local.timeout_s
        self.placement = placement
        self.host = placement.host_of(rank)
        self.local_rank = placement.local_rank_of(rank)
        self.local, self.cross, self._cross_pg = local, cross, cross_pg
        self._scratch = (ring.Scratch(), ring.Scratch(), ring.Scratch())  # three buffers live at once
        self._pipe = Pipeline(rank, self._step, self.abort, self.timeout_s)
        self.whole_max_nbytes = whole_max_nbytes  # all_reduce up to here: local + cross all-reduce, no shards
        # [Note: hierarchical failures] A rank's two levels reach different peers,
        # and each level's timeout bounds one wait, not a step: a cross-host step
        # between two live ranks can run long (seconds for a large shard) while a
        # local peer has already failed, and this rank would notice only at its
        # next local step. So a rank whose step fails aborts both its levels
        # (_step): its local peers see that in the shm segment (the cross step
        # polls it before each transfer, below) and its cross-host peers see its
        # connections close. Every rank then fails within about one timeout.
        # A rank failed by a local peer (it timed out waiting, or the peer aborted)
        # knows only that peer, not why: the peer was failed by a rank on another
        # host. So every failing rank leaves its message on a board in the group's
        # store (on a thread: the store may sit across the failed link), and a rank
        # whose local step failed waits up to LOCAL_EXPLAIN_S for its peers' lines
        # (a cross-host step of the same timeout fails moments later).
        cross.stop_when(lambda: f"local {why}" if (why := local.peer_aborted()) else "")
        self._board = board or Diagnosis(None, rank, self.world_size)
        self._broken = ""

    @classmethod
    def create(cls, store: dist.Store, rank: int, placement: Placement, timeout_s: float, *, shm: ShmOptions,
               torch_dist: TorchDistOptions) -> HierarchicalTransport:
        """Collective over the group: an shm transport per host, a gloo ring per local rank."""
        host, local_rank = placement.host_of(rank), placement.local_rank_of(rank)
        shm = shm.for_ranks_on_machine(ranks_on_this_machine(store, rank, len(placement.hosts), timeout_s))
        local = ShmTransport.create(dist.PrefixStore(f"hier/host{host}/", store), local_rank,
                                    placement.local_world_size, timeout_s, shm)
        try:
            cross, pg = open_torch_dist(dist.PrefixStore(f"hier/local{local_rank}/", store), host,
                                        placement.num_hosts, timeout_s, torch_dist)
        except BaseException:
            local.close()
            raise
        board = Diagnosis(dist.PrefixStore("hier/board/", store), rank, len(placement.hosts))
        return cls(rank, placement, local, cross, pg, whole_max_nbytes=shm.oneshot_max_nbytes, board=board)

    def describe(self) -> str:
        layout = "host-major" if self.placement.is_host_major() else "interleaved"
        return (f"hierarchical: {self.placement.num_hosts} hosts x {self.placement.local_world_size} ranks "
                f"({layout}): shm inside a host, torch_dist ring across hosts")

    def supports(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    @property
    def broken(self) -> str:  # why it refuses work after a failure ("" while usable)
        return self._broken

    def peer_aborted(self) -> str:  # a local peer's abort (a cross-host peer's shows as closed connections)
        return self.local.peer_aborted()

    def mismatch_error(self, err: ValueError, op: str, key: CallKey | None = None) -> ValueError:
        return err  # the agreement step raised it, naming every rank's call

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.local.allocate(numel, dtype)  # the local steps read it in place

    @contextlib.contextmanager
    def _step(self, op: str, step: int, what: str) -> Iterator[None]:
        """Names op, step and ranks (global, and which global ranks the
        sub-transport's ranks are) in a failure of one sub-transport call; a
        failure that breaks a level aborts both ([Note: hierarchical failures])."""
        if self._broken:
            raise RuntimeError(f"{op}: rank {self.rank}: the group is unusable after an earlier failure: "
                               f"{self._broken}")
        try:
            yield
        except RuntimeError as err:
            host_ranks = self.placement.ranks_on[self.host]
            ring_ranks = [ranks[self.local_rank] for ranks in self.placement.ranks_on]
            message = (
                f"{op}: rank {self.rank} (host {self.host} {self.placement.hosts[self.rank]!r}, local rank "
                f"{self.local_rank}) failed at step {step} ({what}); local ranks 0..{len(host_ranks) - 1} are "
                f"global ranks {list(host_ranks)}, cross-host ring ranks 0..{len(ring_ranks) - 1} are global "
                f"ranks {ring_ranks}: {err}")
            if self.local.broken or self.cross.broken:  # not a refusal that leaves the level usable
                self._broken = message
                self.abort()
                if not what.startswith("local"):  # the cross level's message names its peers already
                    self._board.start(message)
                else:
                    message += self._board.explain(message, min(LOCAL_EXPLAIN_S, self.timeout_s / 2), LOCAL_STORE_S)
                    message += self._peer_rings()
                self._broken = message
            raise RuntimeError(message) from err

    def _peer_rings(self) -> str:
        """Whom this host's other ranks wait on across hosts, named without the store."""
        ranks = sorted({ranks[local] for host, ranks in enumerate(self.placement.ranks_on) if host != self.host
                        for local in range(self.placement.local_world_size) if local != self.local_rank})
        peers = ", ".join(f"global rank {r} on host {self.placement.hosts[r]!r}" for r in ranks)
        return f"; the other local ranks' cross-host rings reach {peers}" if peers else ""

    def _agree(self, op: str, tensor: torch.Tensor | None, numel: int, *, redop: int = -1, root: int = -1,
               key: CallKey | None = None, always: bool = False) -> None:
        """The agreement step ([Note: call agreement]): every rank's record reaches
        every rank (a local all-gather, then a cross-host one of the host's
        records), so all raise the same ValueError when any differ, before any
        data moves; the data steps' cross-host calls then skip their own check.
        The record describes this call as its caller made it: 16-bit floats and
        AVG, which both levels run as float32 and SUM, differ here. With the cross
        level's check_calls off it is skipped (the barrier's excepted): only the
        local steps compare, in their slots, as a torch_dist group compares nothing."""
        if not (always or self.cross.options.check_calls):
            return
        mine = torch.tensor(agreement.record(op, tensor, numel, redop=redop, root=root, key=key), dtype=torch.int64)
        host = torch.empty(self.placement.local_world_size, mine.numel(), dtype=torch.int64)
        with self._step(op, 0, "local agreement"):
            self.local.all_gather(output=host, input=mine)
        with self._step(op, 0, "cross-host agreement"):
            hosts = self.cross.share(op, host)
        if all(torch.equal(records, hosts[0]) for records in hosts) and torch.equal(hosts[0], mine.expand_as(host)):
            return
        by_rank = {rank: hosts[h][l].tolist() for h, ranks in enumerate(self.placement.ranks_on)
                   for l, rank in enumerate(ranks)}
        raise agreement.disagreement(op if key is None else key.op, [by_rank[r] for r in range(self.world_size)])

    def all_reduce(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        input, output = input.view(-1), output.view(-1)
        numel, local_size = input.numel(), self.placement.local_world_size
        self._agree("all_reduce", input, numel, redop=int(op))
        if numel * input.element_size() <= self.whole_max_nbytes:
            self._all_reduce_whole(output=output, input=input, op=op)  # small: two steps beat three
            return
        shard_numel = numel // local_size
        body = shard_numel * local_size
        if body:
            self._all_reduce_body(output=output[:body], input=input[:body], shard_numel=shard_numel, op=op)
        if body < numel:
            self._all_reduce_whole(output=output[body:], input=input[body:], op=op)

    def _all_reduce_body(self, *, output: torch.Tensor, input: torch.Tensor, shard_numel: int, op: ReduceOp) -> None:
        """Local reduce-scatter, cross-host all-reduce of the shard, local
        all-gather: piece by piece, pipelined ([Note: hierarchical pipeline])."""
        local_size, wide, sum_op = self.placement.local_world_size, input.dtype in LOW_PRECISION, partial_op(op)
        source = self._widened(0, input) if wide else input
        shards = self._scratch[1].get(shard_numel, torch.float32, input.device) if wide else None
        bounds = pieces(shard_numel, num_pieces(input.numel() * input.element_size()))

        def piece(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """(input, output, this rank's shard) of piece k; the shard is output's own part unless widened."""
            lo, hi = bounds[k]
            own = output[lo * local_size + self.local_rank * (hi - lo):][:hi - lo]
            return (source[lo * local_size:hi * local_size], output[lo * local_size:hi * local_size],
                    shards[lo:hi] if wide else own)

        def before(k: int) -> None:
            piece_input, _, shard = piece(k)
            with self._step("all_reduce", 1, "local reduce-scatter"):
                self.local.reduce_scatter(output=shard, input=piece_input, op=sum_op)

        def after(k: int) -> None:
            _, piece_output, shard = piece(k)
            own = piece_output[self.local_rank * shard.numel():][:shard.numel()]
            self._finish_reduction(output=own, reduced=shard, op=op)
            with self._step("all_reduce", 3, "local all-gather"):
                self.local.all_gather(output=piece_output, input=own)

        self._pipeline("all_reduce", 2, "cross-host all-reduce", bounds, 4, before,
                       lambda k: self.cross.all_reduce(output=piece(k)[2], input=piece(k)[2], op=sum_op,
                                                       agreed=True),
                       after)

    def _all_reduce_whole(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        """Local all-reduce, then a cross-host all-reduce of all of it (every ring
        alike): for small tensors, and for the last numel % L elements."""
        wide = input.dtype in LOW_PRECISION
        work = self._widened(0, input) if wide else output
        with self._step("all_reduce", 4, "local all-reduce"):
            self.local.all_reduce(output=work, input=input if not wide else work, op=partial_op(op))
        with self._step("all_reduce", 5, "cross-host all-reduce"):
            self.cross.all_reduce(output=work, input=work, op=partial_op(op), agreed=True)
        self._finish_reduction(output=output, reduced=work, op=op)

    def reduce_scatter(self, *, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        """Per piece of the chunks: each host's chunks reduce-scattered locally
        into [H, piece] partials, then a cross-host reduce-scatter of those."""
        input, output = input.view(-1), output.view(-1)
        numel, num_hosts = output.numel(), self.placement.num_hosts
        self._agree("reduce_scatter", input, numel, redop=int(op))
        if numel == 0:
            return
        acc_dtype = torch.float32 if input.dtype in LOW_PRECISION else input.dtype
        partials = self._scratch[1].get(num_hosts * numel, acc_dtype, input.device)
        result = output if acc_dtype == output.dtype else self._scratch[2].get(numel, acc_dtype, input.device)
        bounds = pieces(numel, num_pieces(input.numel() * input.element_size()))

        def before(k: int) -> None:
            lo, hi = bounds[k]
            for host, ranks in enumerate(self.placement.ranks_on):
                block = self._host_chunks(input, ranks, numel, acc_dtype, lo, hi)
                with self._step("reduce_scatter", 1, f"local reduce-scatter of host {host}'s chunks"):
                    self.local.reduce_scatter(output=partials[num_hosts * lo + host * (hi - lo):][:hi - lo],
                                              input=block, op=partial_op(op))

        def across(k: int) -> None:
            lo, hi = bounds[k]
            self.cross.reduce_scatter(output=result[lo:hi], input=partials[num_hosts * lo:num_hosts * hi],
                                      op=partial_op(op), agreed=True)

        def after(k: int) -> None:
            lo, hi = bounds[k]
            self._finish_reduction(output=output[lo:hi], reduced=result[lo:hi], op=op)

        self._pipeline("reduce_scatter", 2, "cross-host reduce-scatter", bounds, 4 * num_hosts, before, across,
                       after)

    def all_gather(self, *, output: torch.Tensor, input: torch.Tensor, key: CallKey | None = None) -> None:
        """Per piece of the input: a cross-host all-gather into [H, piece], then
        for each host h a local all-gather of part h into the chunks of h's ranks."""
        input, output = input.view(-1), output.view(-1)
        numel, num_hosts = input.numel(), self.placement.num_hosts
        self._agree("all_gather", input, numel, key=key)
        if numel == 0:
            return
        gathered = self._scratch[0].get(num_hosts * numel, input.dtype, input.device)
        bounds = pieces(numel, num_pieces(output.numel() * output.element_size()))

        def after(k: int) -> None:
            lo, hi = bounds[k]
            for host, ranks in enumerate(self.placement.ranks_on):
                part = gathered[num_hosts * lo + host * (hi - lo):][:hi - lo]
                in_place = consecutive(ranks) and len(bounds) == 1
                block = output[ranks[0] * numel:(ranks[-1] + 1) * numel] if in_place else \
                    self._scratch[1].get(len(ranks) * (hi - lo), input.dtype, input.device)
                with self._step("all_gather", 2, f"local all-gather of host {host}'s chunks"):
                    self.local.all_gather(output=block, input=part)
                for local_rank, rank in enumerate(ranks if not in_place else ()):
                    output[rank * numel + lo:rank * numel + hi].copy_(block[local_rank * (hi - lo):][:hi - lo])

        self._pipeline("all_gather", 1, "cross-host all-gather", bounds, 4 * num_hosts, None,
                       lambda k: self.cross.all_gather(output=gathered[num_hosts * bounds[k][0]:
                                                                       num_hosts * bounds[k][1]],
                                                       input=input[bounds[k][0]:bounds[k][1]],
                                                       agreed=True),
                       after)

    def _pipeline(self, op: str, cross_step: int, cross_what: str, bounds: list[tuple[int, int]], nbytes_per: int,
                  before: Callable[[int], None] | None, across: Callable[[int], None],
                  after: Callable[[int], None]) -> None:
        """The pieces (bounds[k]: element range of piece k) through the pipeline;
        across(k) moves about nbytes_per bytes per element of its piece. Each
        transfer of a cross-host call is bounded by the timeout: so is its wait."""
        segments = max(hi - lo for lo, hi in bounds) * nbytes_per // self.cross.options.segment_nbytes + 1
        bound_s = self.timeout_s * (2 * self.placement.num_hosts * segments + 2)
        self._pipe.run(Stages(op, cross_step, cross_what, before, across, after), len(bounds), bound_s)

    def levels(self) -> Levels:
        """The two levels for collectives that reduce where the data lands (ringcomm.comm.quantized);
        a failure of either is this group's, as in every step here."""
        def local(*, output: torch.Tensor, input: torch.Tensor) -> None:
            with self._step("all_to_all", 1, "local all-to-all"):
                self.local.all_to_all(output=output, input=input)

        def cross(*, output: torch.Tensor, input: torch.Tensor) -> None:
            with self._step("all_to_all", 2, "cross-host all-to-all"):
                self.cross.all_to_all(output=output, input=input, agreed=True)
        return Levels(local, cross, self.placement.ranks_on, lambda key: self._agree("all_to_all", None, 0, key=key))

    def all_to_all(self, *, output: torch.Tensor, input: torch.Tensor, key: CallKey | None = None) -> None:
        raise ValueError(f"all_to_all: rank {self.rank}: over two levels, use levels() (ringcomm.comm.quantized)")

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Across hosts among the root's local rank, then inside every host."""
        root_host, root_local = self.placement.host_of(root), self.placement.local_rank_of(root)
        flat = tensor.view(-1)
        self._agree("broadcast", flat, flat.numel(), root=root)
        if self.local_rank == root_local:
            with self._step("broadcast", 1, f"cross-host broadcast from host {root_host}"):
                self.cross.broadcast(flat, root_host, agreed=True)
        with self._step("broadcast", 2, f"local broadcast from local rank {root_local}"):
            self.local.broadcast(flat, root_local)

    def barrier(self) -> None:
        """The agreement step, always: a rank's cross-host all-gather ends once
        every ring's ranks ended their local all-gathers, which wait for every
        rank of their host."""
        self._agree("barrier", None, 0, always=True)

    def close(self, timeout_s: float | None = None) -> bool:
        """Closes both levels (see their close); whether both ended by themselves."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        drained = self.local.close(timeout_s) & self.cross.close(timeout_s)
        self._shutdown_cross_pg()
        return drained

    def abort(self) -> None:
        self.local.abort()
        self.cross.abort()
        self._shutdown_cross_pg()

    def _shutdown_cross_pg(self) -> None:
        self._pipe.shutdown()
        if self._cross_pg is not None:
            self._cross_pg.shutdown()
            self._cross_pg = None

    def _widened(self, which: int, tensor: torch.Tensor) -> torch.Tensor:
        """A float32 copy of `tensor` in scratch buffer `which`."""
        wide = self._scratch[which].get(tensor.numel(), torch.float32, tensor.device)
        wide.copy_(tensor)
        return wide

    def _host_chunks(self, input: torch.Tensor, ranks: tuple[int, ...], numel: int, acc_dtype: torch.dtype,
                     lo: int, hi: int) -> torch.Tensor:
        """Elements lo..hi of chunks ranks[0], ranks[1], ... of `input`, contiguous:
        a view when that is all of consecutive chunks and no widening is due,
        else a copy in scratch."""
        if consecutive(ranks) and acc_dtype == input.dtype and (lo, hi) == (0, numel):
            return input[ranks[0] * numel:(ranks[-1] + 1) * numel]
        block = self._scratch[0].get(len(ranks) * (hi - lo), acc_dtype, input.device).view(len(ranks), hi - lo)
        for local_rank, rank in enumerate(ranks):
            block[local_rank].copy_(input[rank * numel + lo:rank * numel + hi])
        return block.view(-1)

    def _finish_reduction(self, *, output: torch.Tensor, reduced: torch.Tensor, op: ReduceOp) -> None:
        """AVG's one division by the world size, then the one rounding to 16 bits."""
        if op == ReduceOp.AVG:
            reduce_into(reduced, [reduced], ReduceOp.AVG, self.world_size)
        if reduced.data_ptr() != output.data_ptr() or reduced.dtype != output.dtype:
            output.copy_(reduced)
