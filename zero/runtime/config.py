"""DeepSpeed JSON config: parse, validate (ValueError naming the key), resolve
"auto" values from the model, the arguments and the world size."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..activation import config as activation_config
from ..checkpoint import snapshot_config
from ..monitor.config import MonitoringConfig
from ..monitor.config import parse as parse_monitoring
from ..offload.config import AioOptions, OffloadOptions, parse_aio, parse_offload
from ..optim.config import parse_optimizer, parse_scheduler
from ..parsing.values import AUTO, as_bool, as_float, as_int, get, load, section_of, warn_unknown
from ..sharding import units, zeropp
from ..sharding.policy import STAGES, ShardingPolicy
from .no_effect import warn_no_effect
from .precision import ScalerOptions

__all__ = ["AUTO", "AioOptions", "EngineConfig", "ModelFacts", "OffloadOptions", "ZeroOptions", "load", "parse",
           "resolve_batch"]
TOP_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "fp16", "bf16", "optimizer", "scheduler", "zero_allow_untested_optimizer", "zero_optimization",
    "activation_checkpointing", "comm_backend", "checkpoint",
    "comms_logger", "steps_per_print", "wall_clock_breakdown", "tensorboard", "wandb", "csv_monitor",  # ..monitor
    # accepted with no effect here (knobs of DeepSpeed's own runtime): see no_effect.py
    "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "dump_state", "flops_profiler",
    "memory_breakdown", "zero_force_ds_cpu_optimizer", "seed", "aio",
}
ZERO_KEYS = {
    "stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients", "reduce_scatter",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "sub_group_size", "offload_optimizer",
    "offload_param", "allgather_partitions", "round_robin_gradients", "stage3_gather_unit", *zeropp.KEYS}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}
BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow"}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What "auto" values are resolved from: the model and the launch."""

    world_size: int
    param_dtype: str  # "float32" | "float16" | "bfloat16"
    hidden_size: int
    arguments: dict = field(default_factory=dict)  # config key -> value given by the caller, for "auto"


@dataclass(frozen=True, slots=True)
class ZeroOptions:
    """zero_optimization, as the engine reads it (bounds checked in _zero),
    composed of the sections of sharding (policy.py, zeropp.py) and offload
    (offload/config.py)."""

    stage: int = 0  # 0-3: what is sharded (sharding/policy.py)
    reduce_bucket_size: int = 500_000_000  # >= 1 elements per gradient bucket
    overlap_comm: bool = True  # reductions run while backward goes on
    prefetch_bucket_size: int = 50_000_000  # >= 0 stage-3 elements gathered ahead of use
    param_persistence_threshold: int = 100_000  # >= 0: stage-3 parameters this small stay whole
    max_live_parameters: int = 1_000_000_000  # >= 0 stage-3 elements gathered at once
    max_reuse_distance: int = 1_000_000_000  # >= 0: a stage-3 unit reused within this many elements stays gathered
    gather_unit: str = "block"  # stage 3: "block" | "module" ([Note: gather units], sharding/units.py)
    sub_group_size: int = 1_000_000_000  # >= 1 elements per NVMe optimizer sub-group
    offload_optimizer_options: OffloadOptions = field(default_factory=OffloadOptions)  # offload/config.py
    offload_param_options: OffloadOptions = field(default_factory=lambda: OffloadOptions(buffer_count=5))
    zeropp: zeropp.ZeroPPOptions = field(default_factory=zeropp.ZeroPPOptions)  # sharding/zeropp.py

    @property
    def policy(self) -> ShardingPolicy:
        return ShardingPolicy.for_stage(self.stage)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A whole DeepSpeed config, parsed and resolved ("auto" filled in)."""

    train_batch_size: int  # micro batch x accumulation x world size, checked
    micro_batch_size: int  # >= 1, train_micro_batch_size_per_gpu
    gradient_accumulation_steps: int  # >= 1
    gradient_clipping: float  # >= 0; 0: no clipping
    dtype: str  # "float32" | "float16" | "bfloat16" (fp16 / bf16 sections)
    scaler: ScalerOptions  # fp16's loss scaling (precision.py)
    zero: ZeroOptions
    optimizer: dict | None = None  # {"type", "params"}, built by optim/optimizers.py
    scheduler: dict | None = None  # {"type", "params"}, built by optim/optimizers.py
    allow_untested_optimizer: bool = False  # zero_allow_untested_optimizer: any client optimizer at stages 1-3
    activation_checkpointing: activation_config.Options | None = None  # the engine's own (activation/)
    comm_backend: str | None = None  # "ringcomm" | "torch"
    aio: AioOptions = field(default_factory=AioOptions)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)  # zero/monitor
    snapshots: snapshot_config.SnapshotOptions = field(default_factory=snapshot_config.SnapshotOptions)



def resolve_batch(raw: dict, world_size: int, arguments: dict | None = None) -> tuple[int, int, int]:
    """DeepSpeed's rule: train_batch_size = micro * accumulation * world_size;
    "auto" takes the caller's argument, and any missing one is derived from
    the others (micro 1 and accumulation 1 when nothing is given)."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    arguments = arguments or {}
    values = {k: arguments.get(k) if raw.get(k, AUTO) == AUTO else raw[k] for k in names}
    train, micro, accum = (None if values[k] is None else as_int(values[k], k, 1) for k in names)
    if train is not None and micro is not None and accum is None:
        accum = train // (micro * world_size)
    elif train is not None and accum is not None and micro is None:
        micro = train // (accum * world_size)
    elif train is not None and micro is None and accum is None:
        accum, micro = 1, train // world_size
    micro, accum = micro or 1, accum or 1
    train = train if train is not None else micro * accum * world_size
    if micro < 1 or accum < 1 or train != micro * accum * world_size:
        raise ValueError(f"zero config: train_batch_size ({train}) != train_micro_batch_size_per_gpu ({micro}) * "
                         f"gradient_accumulation_steps ({accum}) * world_size ({world_size})")
    return train, micro, accum


def _dtype(raw: dict, facts: ModelFacts) -> str:
    fp16, bf16 = raw.get("fp16", {}), raw.get("bf16", {})
    warn_unknown(bf16, BF16_KEYS, "bf16.")
    auto_fp16 = bool(facts.arguments.get("fp16", facts.param_dtype == "float16"))
    auto_bf16 = bool(facts.arguments.get("bf16", facts.param_dtype == "bfloat16"))
    fp16_on = as_bool(get(fp16, "enabled", False, auto_fp16), "fp16.enabled")
    bf16_on = as_bool(get(bf16, "enabled", False, auto_bf16), "bf16.enabled")
    if fp16_on and bf16_on:
        raise ValueError("zero config: fp16.enabled and bf16.enabled are both true")
    return "float16" if fp16_on else "bfloat16" if bf16_on else "float32"


def _scaler(section: dict) -> ScalerOptions:
    warn_unknown(section, FP16_KEYS, "fp16.")
    d = ScalerOptions()
    return ScalerOptions(
        loss_scale=as_float(get(section, "loss_scale", d.loss_scale, d.loss_scale), "fp16.loss_scale"),
        initial_scale_power=as_int(get(section, "initial_scale_power", 16, 16), "fp16.initial_scale_power"),
        loss_scale_window=as_int(get(section, "loss_scale_window", 1000, 1000), "fp16.loss_scale_window", 1),
        hysteresis=as_int(get(section, "hysteresis", 2, 2), "fp16.hysteresis", 1),
        min_loss_scale=as_float(get(section, "min_loss_scale", 1.0, 1.0), "fp16.min_loss_scale", 1e-30),
        consecutive_hysteresis=as_bool(section.get("consecutive_hysteresis", False), "fp16.consecutive_hysteresis"))



def _zero(section: dict, facts: ModelFacts) -> ZeroOptions:
    warn_unknown(section, ZERO_KEYS, "zero_optimization.")
    h, d, z = facts.hidden_size, ZeroOptions(), "zero_optimization."
    stage = section.get("stage", 0)
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"zero config: zero_optimization.stage must be one of {STAGES}, got {stage!r}")
    sizes = {key: as_int(get(section, key, default, auto), z + key, minimum) for key, default, auto, minimum in (
        ("reduce_bucket_size", d.reduce_bucket_size, h * h, 1),
        ("allgather_bucket_size", 500_000_000, h * h, 1),
        ("stage3_prefetch_bucket_size", d.prefetch_bucket_size, int(0.9 * h * h), 0),
        ("stage3_param_persistence_threshold", d.param_persistence_threshold, 10 * h, 0),
        ("stage3_max_live_parameters", d.max_live_parameters, d.max_live_parameters, 0),
        ("stage3_max_reuse_distance", d.max_reuse_distance, d.max_reuse_distance, 0),
        ("sub_group_size", d.sub_group_size, d.sub_group_size, 1))}
    flags = {key: as_bool(get(section, key, default, default), z + key) for key, default in (
        ("overlap_comm", True), ("contiguous_gradients", True), ("reduce_scatter", True),
        ("stage3_gather_16bit_weights_on_model_save", False), ("allgather_partitions", True),
        ("round_robin_gradients", False))}
    offload_optimizer = parse_offload(section.get("offload_optimizer"), "offload_optimizer", stage)
    offload_param = parse_offload(section.get("offload_param"), "offload_param", stage)
    # The other sizes and flags are validated but have no effect (no_effect.py warns about them).
    return ZeroOptions(
        stage=stage, reduce_bucket_size=sizes["reduce_bucket_size"], overlap_comm=flags["overlap_comm"],
        prefetch_bucket_size=sizes["stage3_prefetch_bucket_size"],
        param_persistence_threshold=sizes["stage3_param_persistence_threshold"],
        max_live_parameters=sizes["stage3_max_live_parameters"],
        max_reuse_distance=sizes["stage3_max_reuse_distance"], gather_unit=units.parse(section),
        sub_group_size=sizes["sub_group_size"], offload_optimizer_options=offload_optimizer,
        offload_param_options=offload_param, zeropp=zeropp.parse(section, stage))


def parse(config: str | os.PathLike | dict, facts: ModelFacts) -> EngineConfig:
    """The engine's view of a DeepSpeed config."""
    raw = load(config)
    warn_unknown(raw, TOP_KEYS, "")
    for key in ("fp16", "bf16", "zero_optimization"):
        section_of(raw, key)
    train, micro, accum = resolve_batch(raw, facts.world_size, facts.arguments)
    zero = _zero(raw.get("zero_optimization", {}), facts)
    checkpointing = activation_config.parse(raw.get("activation_checkpointing"))
    backend = raw.get("comm_backend")
    if backend not in (None, "ringcomm", "torch"):
        raise ValueError(f"zero config: comm_backend must be 'ringcomm' or 'torch', got {backend!r}")
    parsed = EngineConfig(
        train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=accum,
        gradient_clipping=as_float(get(raw, "gradient_clipping", 0.0, facts.arguments.get("gradient_clipping", 1.0)),
                                 "gradient_clipping"),
        dtype=_dtype(raw, facts), scaler=_scaler(raw.get("fp16", {})), zero=zero,
        optimizer=parse_optimizer(raw.get("optimizer")), scheduler=parse_scheduler(raw.get("scheduler")),
        allow_untested_optimizer=as_bool(raw.get("zero_allow_untested_optimizer", False),
                                       "zero_allow_untested_optimizer"),
        activation_checkpointing=checkpointing, comm_backend=backend, aio=parse_aio(raw.get("aio")),
        monitoring=parse_monitoring(raw), snapshots=snapshot_config.parse(raw))
    warn_no_effect(raw)  # once every value is validated
    return parsed
