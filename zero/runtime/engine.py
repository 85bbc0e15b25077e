"""ZeroEngine: DeepSpeed's training-loop surface (forward, backward, step) over
a ParamGroup, with loss scaling, clipping, accumulation and accounting."""
from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ringcomm.core.compat import tree_map

from ..activation import checkpointing
from ..checkpoint import load as checkpoint_load
from ..checkpoint import save as checkpoint_save
from ..checkpoint.parts import CheckpointOptions, CheckpointParts
from ..checkpoint.snapshot import Snapshots
from ..checkpoint.snapshot_restore import Resumed
from ..checkpoint.snapshot_restore import resume as snapshot_resume
from ..monitor import comms
from ..monitor.step_log import StepLog
from ..optim.host_adam import StepCopies
from ..sharding.accounting import MemoryReport, memory_report
from ..sharding.gather import ModuleGatherer
from ..sharding.param_group import ParamGroup
from ..sharding.seam import Comm
from ..sharding.state import param_shapes
from ..sharding.wire import WireReport
from .config import EngineConfig
from .precision import LossScaler

log = logging.getLogger("zero")


@dataclass(slots=True)
class EngineParts:
    """What build.py assembles and the engine runs."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object | None
    config: EngineConfig
    group: ParamGroup
    gatherer: ModuleGatherer | None
    scaler: LossScaler
    comm: Comm
    dtype: torch.dtype
    param_names: list[str]
    trainable: list  # the trainable parameters, in the buckets' parameter-index order
    activation: checkpointing.ActivationCheckpointing | None  # its own, from the config's section; else None
    step_log: StepLog  # the monitors and step timers, made and agreed on first (monitor/setup.py)
    snapshots: Snapshots | None = None  # the config's checkpoint.in_memory (checkpoint/snapshot.py)


@dataclass(slots=True)
class Progress:
    """Where training stands, counted as DeepSpeed counts it. A resume starts
    at an accumulation boundary: micro_steps is re-derived from global_steps in
    this engine's accumulation ([Note: what a resume restores] in
    zero/checkpoint/load.py)."""

    accumulation_steps: int
    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.global_steps, self.global_samples = int(state["global_steps"]), int(state["global_samples"])
        self.skipped_steps = int(state["skipped_steps"])
        self.micro_steps = self.global_steps * self.accumulation_steps


def _progress(name: str) -> property:
    """engine.<name>, DeepSpeed's attribute, kept in engine.progress."""
    return property(lambda self: getattr(self.progress, name), lambda self, value: setattr(self.progress, name, value),
                    doc=f"engine.progress.{name}")


class ZeroEngine:
    """engine(batch); engine.backward(loss); engine.step(), as in DeepSpeed."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.module = parts.module
        self.optimizer = parts.optimizer
        self.lr_scheduler = parts.scheduler
        self.config = parts.config
        self.progress = Progress(parts.config.gradient_accumulation_steps)
        self.world_size = parts.comm.world_size
        self.global_rank = parts.comm.rank
        buckets = parts.group.buckets
        self.device = buckets[0].shard.device if buckets else torch.device("cpu")
        self._inside_no_sync = False
        self.last_wire = WireReport(0, 0, 0)
        self._global_grad_norm: float | None = None
        self._step_applied = False
        self._destroyed = False
        comms.LOGGER.configure(parts.config.monitoring.comms_logger)
        self.step_log = parts.step_log
        self.checkpoint_options = CheckpointOptions()  # how ranks agree in save/load_checkpoint (a test's hook)
        self.snapshot_client_state: Callable[[], dict] | None = None  # the client's state in each snapshot
        self.resumed: Resumed | None = None  # what resume() restored

    global_steps = _progress("global_steps")
    global_samples = _progress("global_samples")
    micro_steps = _progress("micro_steps")
    skipped_steps = _progress("skipped_steps")

    # ---- DeepSpeed surface ---------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the module; floating-point inputs are cast to the model dtype."""
        self._check_alive("forward")
        gatherer, dtype = self.parts.gatherer, self.parts.dtype

        def cast(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        with contextlib.ExitStack() as scope:
            scope.enter_context(self.step_log.timed("forward"))
            if self.parts.activation is not None:
                scope.enter_context(checkpointing.active(self.parts.activation))
            if gatherer is not None:
                gatherer.start_forward()
                scope.enter_context(gatherer.saved_weights())
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Scales the loss (loss scale / accumulation steps), back-propagates and
        reduces the gradients (overlapped with backward by the bucket hooks)."""
        self._check_alive("backward")
        scale = self.parts.scaler.scale / self.gradient_accumulation_steps()
        reduce = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        self.step_log.loss(loss)
        with self.step_log.timed("backward"):
            self.parts.group.reduce_grads(loss.float() * scale, reduce)
        return loss

    def step(self) -> None:
        """Updates the parameters at an accumulation boundary (no-op otherwise)."""
        self._check_alive("step")
        if self._inside_no_sync:
            raise RuntimeError("zero: engine.step() inside no_sync(): leave the context first (as DeepSpeed)")
        if self.is_gradient_accumulation_boundary():
            snapshots = self.parts.snapshots
            copies = None if snapshots is None else snapshots.before_step(self.global_steps + 1, self.checkpoint_parts)
            with self.step_log.timed("step"):
                self._step_applied = self._take_step(copies)
                if self._step_applied and self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.last_wire = self.parts.comm.take_wire()
            self._log_step()
            if self.parts.snapshots is not None:
                self.parts.snapshots.after_step(self.global_steps, self.checkpoint_parts, self.snapshot_client_state)
        self.micro_steps += 1

    def _log_step(self) -> None:
        group = self.optimizer.param_groups[0]
        self.step_log.boundary(step=self.global_steps, samples=self.global_samples, skipped=self.skipped_steps,
                               lr=group["lr"], mom=group.get("betas", group.get("momentum")),
                               loss_scale=self.parts.scaler.scale if self.fp16_enabled() else None)

    def _take_step(self, copies: StepCopies | None = None) -> bool:
        """Returns False when fp16 overflowed and the step was skipped. copies:
        where the step also writes the values it updates (a snapshot's)."""
        group, scaler = self.parts.group, self.parts.scaler
        grads = group.owned_grads_fp32()  # offload: copies to host start ([Note: gradient copies to host])
        used_scale = scaler.scale  # the scale these gradients carry; update() may change it
        norm = group.grad_norm() / used_scale
        overflow = scaler.checks_overflow and not math.isfinite(norm)  # the norm is global: all ranks agree
        if scaler.update(overflow):
            self.skipped_steps += 1
            self._global_grad_norm = norm
            group.zero_grads()
            return False
        self._global_grad_norm = norm
        coef = 1.0 / used_scale
        clip = self.config.gradient_clipping
        if clip > 0 and clip / (norm + 1e-6) < 1.0:
            coef *= clip / (norm + 1e-6)
        group.step(self.optimizer, grads, coef, copies)
        return True

    def destroy(self) -> None:
        """Releases what the engine holds besides memory, as DeepSpeed's
        engine.destroy(): the module and gradient hooks, the offload swap files
        and I/O threads, the comm seam. Idempotent; forward, backward and step
        refuse afterwards. The run ended on purpose: this rank's in-memory
        snapshots are removed."""
        if self._destroyed:
            return
        self._destroyed = True
        try:
            if self.parts.snapshots is not None:
                self.parts.snapshots.remove()
                self.parts.snapshots.close()
            if self.parts.gatherer is not None:
                self.parts.gatherer.remove()
            self.parts.group.close()
            self.step_log.close()
        finally:
            self.parts.comm.close()

    def _check_alive(self, op: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"zero: engine.{op}() after engine.destroy() on rank {self.global_rank}")

    def was_step_applied(self) -> bool:
        """False when the last boundary step was skipped (fp16 overflow)."""
        return self._step_applied

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def zero_grad(self) -> None:
        self.parts.group.zero_grads()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients locally without reducing them,
        even at an accumulation boundary; the next reducing backward reduces
        them all. As DeepSpeed: refused at stages 2-3 (gradients are sharded as
        they are produced), not re-entrant, and step() inside is an error."""
        if self.config.zero.policy.shard_grads:
            raise ValueError(f"zero: no_sync() is incompatible with the gradient partitioning of ZeRO stage "
                             f"{self.zero_optimization_stage()} (as in DeepSpeed)")
        if self._inside_no_sync:
            raise RuntimeError("zero: no_sync() is not re-entrant")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    @property
    def local_rank(self) -> int:
        """LOCAL_RANK as the launcher set it (DeepSpeed requires it too)."""
        if "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        if self.world_size == 1:
            return 0
        raise RuntimeError(f"zero: engine.local_rank: LOCAL_RANK is not set on rank {self.global_rank} of "
                           f"{self.world_size} (torchrun and the deepspeed launcher set it)")

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def zero_optimization(self) -> bool:
        return self.config.zero.stage > 0

    def fp16_enabled(self) -> bool:
        return self.config.dtype == "float16"

    def bfloat16_enabled(self) -> bool:
        return self.config.dtype == "bfloat16"

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.parts.scaler.scale

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    # ---- accounting ------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Model-state bytes this rank holds, communication buffers apart, and
        the peak of checkpointed inputs held since stats().reset()."""
        gatherer = self.parts.gatherer
        report = memory_report(self.parts.group, self.optimizer, gatherer.peak_live_nbytes if gatherer else 0,
                               gatherer.kept_nbytes if gatherer else 0)
        activation = self.parts.activation or checkpointing.current()
        snapshots = self.parts.snapshots.nbytes() if self.parts.snapshots is not None else 0
        return replace(report, checkpoint_nbytes=activation.stats.peak_held_nbytes, snapshot_nbytes=snapshots)

    def full_params_fp32(self) -> list[torch.Tensor]:
        """Every trainable parameter's fp32 master, whole (a collective)."""
        return self.parts.group.full_masters()

    def checkpoint_parts(self) -> CheckpointParts:
        """The stateful parts save_checkpoint and load_checkpoint compose (zero/checkpoint/parts.py)."""
        parts = self.parts
        return CheckpointParts(
            rank=parts.comm.rank, world_size=parts.comm.world_size, stage=parts.group.policy.stage, dtype=parts.dtype,
            module=self.module, param_names=parts.param_names, trainable=parts.trainable,
            param_shapes=lambda: param_shapes(parts.group), shards=parts.group, optimizer=self.optimizer,
            scaler=parts.scaler, scheduler=self.lr_scheduler, progress=self.progress,
            whole_masters=parts.group.whole_masters, config=self.config, layout={
                "world_size": self.world_size, "micro_batch_size": self.train_micro_batch_size_per_gpu(),
                "gradient_accumulation_steps": self.gradient_accumulation_steps(),
                "train_batch_size": self.train_batch_size()})

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Collective; returns True, as DeepSpeed. The checkpoint holds the
        trainable parameters (exclude_frozen_parameters is what it does anyway)."""
        self._snapshot_done()
        checkpoint_save.save(self.checkpoint_parts(), save_dir, tag, client_state, save_latest=save_latest,
                             options=self.checkpoint_options)
        return True

    def resume(self, load_dir: str | None = None) -> tuple[str | None, dict | None]:
        """Collective: restores the newest of the in-memory snapshots (config
        checkpoint.in_memory) and the disk checkpoint in load_dir; nothing for
        a fresh start. Returns (path, client_state), (None, None) when nothing;
        engine.resumed says from where, and the steps lost (checkpoint/snapshot_restore.py)."""
        if self.parts.snapshots is None:
            path, client_state = self.load_checkpoint(load_dir) if load_dir else (None, None)
            self.resumed = Resumed("disk" if path else "none", self.global_steps)
            return path, client_state
        path, client_state, self.resumed = snapshot_resume(self.checkpoint_parts(), self.parts.snapshots, load_dir,
                                                           self.checkpoint_options)
        return path, client_state

    def _snapshot_done(self) -> None:
        if self.parts.snapshots is not None:
            self.parts.snapshots.wait()

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None) -> tuple[str | None, dict | None]:
        """Returns (path, client_state), or (None, None) when `tag` is None and
        load_dir has no `latest` file, as DeepSpeed. Collective and all or
        nothing: a checkpoint that does not check out on some rank is the same
        ValueError on every rank, and no state changed (zero/checkpoint/load.py).
        A resume starts at an accumulation boundary. load_module_only restores
        the parameters only; the fp32 masters always come from the checkpoint
        (DeepSpeed rebuilds them from the 16-bit weights when it skips the
        optimizer states)."""
        if custom_load_fn is not None:
            raise ValueError("zero: load_checkpoint(custom_load_fn=...) is not supported")
        self._snapshot_done()
        if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")):
            log.warning(f"zero: load_checkpoint: no 'latest' file in {load_dir}; nothing loaded")
            return None, None
        return checkpoint_load.load(self.checkpoint_parts(), load_dir, tag, load_module_strict=load_module_strict,
                                    load_optimizer_states=load_optimizer_states,
                                    load_lr_scheduler_states=load_lr_scheduler_states,
                                    load_module_only=load_module_only, options=self.checkpoint_options)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False, *, max_shard_size: int | str | None = None) -> bool:
        """As DeepSpeed's, gathering one bucket at a time; `max_shard_size` ("2GB")
        writes Hugging Face's shards and index, a .safetensors name safetensors
        (zero/checkpoint/model_files.py)."""
        return checkpoint_save.save_16bit_model(self.checkpoint_parts(), save_dir, save_filename,
                                                exclude_frozen_parameters=exclude_frozen_parameters,
                                                max_shard_size=max_shard_size,
                                                timeout_s=self.checkpoint_options.timeout_s)

    @property
    def last_step_sent_nbytes(self) -> int:
        return self.last_wire.sent_nbytes

    def wire_report(self) -> WireReport:
        """Bytes this rank sent in the last step (ring volume of its collectives):
        in all, to its own host and across hosts (zero/sharding/wire.py)."""
        return self.last_wire
