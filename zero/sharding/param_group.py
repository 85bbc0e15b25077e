"""ParamGroup: the model's trainable parameters in ringcomm buckets, and every
bucket's ZeRO state, honouring a ShardingPolicy. Its verbs are what the hooks
and the engine call: unshard / reshard (stage 3), reduce_grads, step.

[Note: one class, every stage]
    policy.shard_optimizer  grads are reduce-scattered (else all-reduced); the
                            master weights and optimizer states cover only this
                            rank's chunk of each bucket; resident buckets are
                            all-gathered after the step.
    policy.shard_grads      reduce every micro-step from a transient bucket into
                            a chunk-sized accumulator (else accumulate whole
                            gradients locally and reduce at the boundary);
                            ringcomm.buckets.overlap.OwnedBucketScheduler runs the gradient side.
    policy.shard_params     buckets are not resident: only the chunk is kept and
                            gather.py unshards a bucket around its module's use.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from ringcomm import BufferLayout, GradBucket, OwnedBucketScheduler, Spares
from ringcomm.plan.schedule import Span

from ..checkpoint.format import NamedShard
from ..optim import host_adam
from ..optim.optimizers import unscaled
from . import init as zero_init
from . import state
from .policy import ShardingPolicy
from .seam import Comm, Handle
from .zeropp import Secondary, ZeroPPOptions

NORM_SLICE_NUMEL = 1 << 20  # elements converted to float64 at a time by grad_norm


class ZeroBucket:
    """One bucket's ZeRO state: parameter values (`full`: the whole padded
    bucket, always for a resident bucket and while gathered otherwise;
    `shard`: this rank's chunk), the fp32 master of the part this rank updates
    (`owned`, bucket coordinates) and the gradient storage (`grads`)."""

    def __init__(self, layout: BufferLayout, index: int, params: list[nn.Parameter], full: torch.Tensor | None,
                 shard: torch.Tensor, rank: int) -> None:
        self.span = layout.buckets[index]
        self.layout = layout
        self.indices = self.span.param_indices
        self.spans = [layout.local(i) for i in self.indices]
        self.params = params
        self.shapes = [zero_init.full_shape(p) for p in params]
        self.full = full
        self.shard = shard
        self.rank = rank
        self.owned = Span(0, self.span.numel)
        self.grads: GradBucket | None = None
        self.master: torch.Tensor | None = None  # fp32 owned span (may alias the params)
        self.master_views: list[tuple[torch.Tensor, int, int]] = []  # the optimizer's parameters
        self.gather: Handle | None = None

    def bind_params(self) -> None:
        """Points every parameter at its slice of `full` (or at nothing)."""
        for param, span, shape in zip(self.params, self.spans, self.shapes):
            if self.full is None:
                param.data = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)
            else:
                param.data = self.full[span.begin:span.end].view(shape)

    def owned_grad(self) -> torch.Tensor:
        """The reduced gradient of the owned span."""
        if self.grads.accumulator is not None:
            return self.grads.accumulator
        return self.grads.ensure()[self.owned.begin:self.owned.end]


class ParamGroup:
    """Buckets of the model plus the reduction and update rules of a policy."""

    def __init__(self, buckets: list[ZeroBucket], policy: ShardingPolicy, comm: Comm, *, timeout_s: float) -> None:
        self.buckets = buckets
        self.policy = policy
        self.comm = comm
        spares = Spares()  # the transient buckets' storage, kept from one backward to the next
        for bucket in buckets:
            persistent = None if policy.shard_grads else torch.zeros(
                bucket.span.numel, dtype=bucket.shard.dtype, device=bucket.shard.device)
            bucket.grads = GradBucket(bucket.layout, bucket.span.index, bucket.params, comm.rank,
                                      persistent=persistent, sharded=policy.shard_grads, spares=spares)
        mode = "reduce_scatter" if policy.shard_optimizer else "all_reduce"
        self.quantized_weights = False
        self.partition_comm: Comm | None = None
        self.secondary: Secondary | None = None  # hpZ ([Note: ZeRO++ in zero])
        # stage 3, [Note: reuse distance] in ringcomm/plan/gathers.py: the buckets a backward inside an
        # accumulation keeps gathered for the next forward (the gatherer's plan), and those it kept
        self.keep_after_backward: frozenset[int] = frozenset()
        self.kept: frozenset[int] = frozenset()
        self.optimizer: torch.optim.Optimizer | None = None  # attach(): what state_dict() saves
        self.param_names: list[str] = []
        self.scheduler = OwnedBucketScheduler(
            [b.grads for b in buckets], comm, mode=mode, scale=1.0 / comm.world_size, timeout_s=timeout_s,
            on_launch=self._after_launch if policy.shard_params else None)

    def register_hooks(self, params: list[nn.Parameter]) -> None:
        """Gradient hooks, in registration order (it fixes the launch order)."""
        self.scheduler.register_hooks(params)

    def close(self) -> None:
        """Removes the gradient hooks; offload also releases its files and
        threads. Idempotent (engine.destroy())."""
        self.scheduler.remove_hooks()
        if self.partition_comm is not None:
            self.partition_comm.close()

    # ---- verbs: stage 3 gathering ---------------------------------------------------
    def use_zeropp(self, options: ZeroPPOptions, partition_comm: Comm | None) -> None:
        """[Note: ZeRO++ in zero]: quantized forward gathers, hpZ's secondary partition over `partition_comm`."""
        self.quantized_weights = options.quantized_weights
        self.partition_comm = partition_comm
        self.secondary = Secondary(self.comm.rank, partition_comm.world_size) if partition_comm else None

    def start_unshard(self, bucket: ZeroBucket, backward: bool = False) -> None:
        """Starts gathering the bucket: for backward from hpZ's secondary chunks when kept."""
        if bucket.full is None and bucket.gather is None:
            bucket.full = torch.empty(bucket.span.numel, dtype=bucket.shard.dtype, device=bucket.shard.device)
            chunk = self.secondary.chunks.get(bucket.span.index) if backward and self.secondary else None
            if chunk is not None:
                bucket.gather = self.partition_comm.all_gather(bucket.full, chunk, async_op=True)
            else:
                bucket.gather = self.comm.all_gather(bucket.full, bucket.shard, async_op=True,
                                                     quantized=self.quantized_weights)

    def unshard(self, bucket: ZeroBucket, backward: bool = False) -> None:
        self.start_unshard(bucket, backward)
        if bucket.gather is not None:
            bucket.gather.wait()
            bucket.gather = None
            bucket.bind_params()

    def reshard(self, bucket: ZeroBucket) -> None:
        if bucket.span.resident or bucket.full is None:
            return
        if bucket.gather is not None:
            bucket.gather.wait()
            bucket.gather = None
        if self.secondary is not None:
            self.secondary.keep(bucket.span.index, bucket.full)
        bucket.full = None
        bucket.bind_params()

    def adopt_owned_values(self, bucket: ZeroBucket, values: torch.Tensor) -> None:
        """Stage 3, a gathered bucket: `values` (its chunk, the parameters' dtype)
        are the parameters' new values (zero.GatheredParameters with a modifier
        rank): they become the shard, and the fp32 master where they differ from
        the master rounded. Offload overrides where the shard and master live."""
        if self.secondary is not None:
            self.secondary.drop()  # the values change
        with torch.no_grad():
            fold_into_master(bucket.master, values)
            target = self.publish_target(bucket)
            if target.data_ptr() != values.data_ptr():
                target.copy_(values)

    def _after_launch(self, grads: GradBucket) -> None:
        if grads.index not in self.kept:  # its gradients are in flight: the values can go
            self.reshard(self.buckets[grads.index])

    # ---- verbs: gradients -------------------------------------------------------------
    def reduce_grads(self, scaled_loss: torch.Tensor, boundary: bool) -> None:
        """Back-propagates; at a boundary (sharded gradients: every micro-step)
        the reduced gradient of each bucket's owned span is ready afterwards."""
        sync = self.policy.shard_grads or boundary
        self.kept = frozenset() if boundary else self.keep_after_backward  # the step changes the values
        try:
            with contextlib.nullcontext() if sync else self.scheduler.no_sync():
                try:
                    scaled_loss.backward()
                except BaseException:
                    self.scheduler.discard_step()  # ringcomm.buckets.overlap [Note: a failed step]
                    raise
                self.scheduler.finish()
        except BaseException:
            self.kept = frozenset()  # a failed backward keeps nothing
            raise
        finally:
            for bucket in self.buckets:
                if bucket.span.index not in self.kept:
                    self.reshard(bucket)

    def zero_grads(self) -> None:
        self.scheduler.zero_grad()

    # ---- set-up and step ----------------------------------------------------------------
    def setup_masters(self) -> list[tuple[int, torch.Tensor]]:
        """Makes every bucket's fp32 master; returns (parameter index, master
        slice) pairs, the optimizer's parameters."""
        return [pair for bucket in self.buckets for pair in self.setup_master(bucket)]

    def setup_master(self, bucket: ZeroBucket) -> list[tuple[int, torch.Tensor]]:
        """setup_masters() for one bucket."""
        if self.policy.shard_optimizer:
            source = bucket.shard
        else:
            source = bucket.full if bucket.full is not None else bucket.shard
        slices = self.owned_slices(bucket)
        bucket.master = self.make_master(bucket, source)
        bucket.master_views = [(bucket.master[begin:end].requires_grad_(), begin, end) for _, begin, end in slices]
        return [(index, view) for (index, _, _), (view, _, _) in zip(slices, bucket.master_views)]

    def owned_slices(self, bucket: ZeroBucket) -> list[tuple[int, int, int]]:
        """(parameter index, begin, end) of each parameter piece in the bucket's
        master: its owned span when the optimizer is sharded (set here as
        bucket.owned), else all of it."""
        if self.policy.shard_optimizer:
            bucket.owned = bucket.span.local_chunk(bucket.rank)
        owned = bucket.owned
        return [(index, local.begin - owned.begin, local.end - owned.begin)
                for index, local, _ in bucket.layout.local_slices(bucket.span.index, owned)]

    def attach(self, optimizer: torch.optim.Optimizer, param_names: Sequence[str]) -> None:
        """The optimizer over the master slices and the parameters' names, by index: what state_dict names."""
        self.optimizer, self.param_names = optimizer, list(param_names)

    def state_dict(self) -> dict[str, NamedShard]:
        """Every fp32 master slice this rank holds, named, with its optimizer states (state.py)."""
        return state.state_dict(self)

    @contextlib.contextmanager
    def saved_shards(self) -> Iterator[list[NamedShard]]:
        """What a checkpoint saves of this rank: state_dict()'s shards, readable
        inside (offloaded states as tensors)."""
        with self.offloaded_states():
            yield list(self.state_dict().values())

    def load_state_dict(self, saved: dict[str, dict[str, torch.Tensor]], *, optimizer_states: bool = True) -> None:
        self.release_kept()  # the values change under them
        state.load_state_dict(self, saved, optimizer_states=optimizer_states)

    def release_kept(self) -> None:
        """Reshards the buckets a backward kept for the next forward."""
        kept, self.kept = self.kept, frozenset()
        for bucket in self.buckets:
            if bucket.span.index in kept:
                self.reshard(bucket)

    def make_master(self, bucket: ZeroBucket, source: torch.Tensor) -> torch.Tensor:
        """The fp32 master of `source` (the owned values): on the model's device,
        the values themselves when they are fp32. Offload places it elsewhere."""
        return source if source.dtype == torch.float32 else source.float()

    def offloaded(self, bucket: ZeroBucket) -> bool:
        """Whether the bucket's master and optimizer states live off the model's device."""
        return False

    def disk_nbytes(self) -> int:
        """Model-state bytes this rank keeps in NVMe swap files."""
        return 0

    def offload_host_nbytes(self) -> int:
        """Host memory an offload holds besides masters and optimizer states
        (NVMe staging buffers, stage-3 shards kept on the host)."""
        return 0

    def offloaded_states(self) -> contextlib.AbstractContextManager:
        """Inside: every bucket's `master` and the optimizer's state are ordinary
        tensors (checkpoints read and write them there); on exit, states changed
        inside go back to wherever they are offloaded."""
        return contextlib.nullcontext()

    def owned_grads_fp32(self) -> list[torch.Tensor]:
        grads = [b.owned_grad() for b in self.buckets]
        return [g if g.dtype == torch.float32 else g.float() for g in grads]

    def grad_norm(self) -> float:
        """Global L2 norm of the (still scaled) reduced gradients, read where they
        were reduced: on the model's device, not in an offload's host copies
        ([Note: gradient copies to host] in zero/offload/host.py). The squares are
        summed in float64: an fp32 sum over a multi-million-element shard drifts
        by ~1e-5 relative, and the norm drives clipping. In slices, so the float64
        copy stays small."""
        grads = [b.owned_grad() for b in self.buckets]
        total = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
        for g in grads:
            for piece in g.reshape(-1).split(NORM_SLICE_NUMEL):
                piece = piece.double()
                total += torch.dot(piece, piece)
        if self.policy.shard_optimizer:
            self.comm.all_reduce(total)
        return float(total.sqrt())

    def step(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], coef: float,
             copies: host_adam.StepCopies | None = None) -> None:
        """Hands the optimizer the owned gradients times `coef` (unscale, clip),
        steps, and publishes the updated masters into the parameters. The fused
        host step also writes `copies` (an in-memory snapshot's); another step
        leaves them to the snapshot."""
        for bucket, g in zip(self.buckets, grads):
            for view, begin, end in bucket.master_views:
                view.grad = g[begin:end]
        published: set[int] = set()
        if host_adam.applies(optimizer):
            outputs = self.host_outputs()
            host_adam.adam_step(optimizer, coef, outputs, copies)
            published = {b.span.index for b in self.buckets if all(id(v) in outputs for v, _, _ in b.master_views)}
        else:
            with unscaled(optimizer, coef) as fused:
                if not fused:
                    for g in grads:
                        g.mul_(coef)  # g is a scratch fp32 copy or the owned gradient, zeroed after the step
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.publish_masters(published)
        self.zero_grads()

    def host_outputs(self) -> dict[int, torch.Tensor]:
        """id(master slice) -> the 16-bit host parameter values it updates (the
        fused host step writes them; fp32 or device parameters are published apart)."""
        outputs = {}
        for bucket in self.buckets:
            target = self.publish_target(bucket)
            if target.dtype in host_adam.OUT_DTYPES and target.device.type == "cpu":
                for view, begin, end in bucket.master_views:
                    outputs[id(view)] = target[begin:end]
        return outputs

    def publish_masters(self, published: set[int] = frozenset()) -> None:
        """Copies updated masters into the parameters (except the buckets in
        `published`, already written); all-gathers resident buckets."""
        works = []
        for bucket in self.buckets:
            target = self.publish_target(bucket)
            if bucket.span.index not in published and target.data_ptr() != bucket.master.data_ptr():
                target.copy_(bucket.master)
            if self.policy.shard_optimizer and bucket.span.resident:
                works.append(self.comm.all_gather(bucket.full, bucket.shard, async_op=True))
        for work in works:
            work.wait()
        if self.secondary is not None:
            self.secondary.drop()  # hpZ: the values changed

    def publish_target(self, bucket: ZeroBucket) -> torch.Tensor:
        """The 16-bit (or fp32) values the bucket's master is published into: its owned span."""
        return bucket.shard if self.policy.shard_optimizer else \
            (bucket.full if bucket.full is not None else bucket.shard)

    def full_masters(self) -> list[torch.Tensor]:
        """Every parameter's whole fp32 master, in parameter-index order (collective;
        for tests and small models: it holds the whole model, see whole_masters)."""
        with self.whole_masters() as read:
            out = {index: read(index).clone() for bucket in self.buckets for index in bucket.indices}
        return [out[i] for i in sorted(out)]

    @contextlib.contextmanager
    def whole_masters(self) -> Iterator[Callable[[int], torch.Tensor]]:
        """Yields read(index): a trainable parameter's whole fp32 master, a view
        valid until the next read. Collective: every rank reads the same indices
        in the same order. A read all-gathers its parameter's bucket unless that
        bucket was the last one read, so reads in bucket order gather each bucket
        once and hold one bucket at a time (checkpoints of models larger than a
        rank's memory). Not counted as step traffic."""
        where = {index: (bucket, span, shape) for bucket in self.buckets
                 for index, span, shape in zip(bucket.indices, bucket.spans, bucket.shapes)}
        current: list = [None, None]  # the bucket read last, its whole master

        def read(index: int) -> torch.Tensor:
            bucket, span, shape = where[index]
            if current[0] is not bucket:
                current[:] = [None, None]  # the previous bucket's buffer goes before the next one comes
                whole = owned = self.owned_master(bucket)
                if self.policy.shard_optimizer:
                    whole = torch.empty(bucket.span.numel, dtype=torch.float32, device=owned.device)
                    self.comm.all_gather(whole, owned.contiguous()).wait()
                del owned  # where it was read for this (NVMe), it goes once gathered
                current[:] = [bucket, whole]
            return current[1][span.begin:span.end].view(shape)

        counts = self.comm.take_wire()
        try:
            yield read
        finally:
            current.clear()
            self.comm.take_wire()
            self.comm.restore_wire(counts)

    def owned_master(self, bucket: ZeroBucket) -> torch.Tensor:
        """This rank's fp32 master of `bucket`'s owned span, for whole_masters."""
        return bucket.master


def fold_into_master(master: torch.Tensor, values: torch.Tensor) -> None:
    """Writes `values` (16-bit or fp32, master's shape) into the fp32 `master`
    where they differ from the master rounded to their dtype (a master offloaded
    to the host takes a device model's values)."""
    values = values.to(master.device)
    differs = master.to(values.dtype) != values
    master[differs] = values[differs].to(master.dtype)
