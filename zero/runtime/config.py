"""DeepSpeed JSON config: parse, validate (ValueError naming the key), resolve
"auto" values from the model, the arguments and the world size."""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field

from ..monitor.config import MonitoringConfig
from ..monitor.config import parse as parse_monitoring
from ..sharding import zeropp
from ..sharding.policy import STAGES, ShardingPolicy
from .no_effect import warn_no_effect
from .precision import ScalerOptions

AUTO = "auto"
TOP_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "fp16", "bf16", "optimizer", "scheduler", "zero_allow_untested_optimizer", "zero_optimization",
    "activation_checkpointing", "comm_backend",
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
    "offload_param", "allgather_partitions", "round_robin_gradients", *zeropp.KEYS}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}
BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow"}
_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
SCHEDULER_PARAMS = {  # type -> (required, optional) params: deepspeed.runtime.lr_schedules' constructor arguments
    "WarmupLR": ((), _WARMUP), "WarmupDecayLR": (("total_num_steps",), _WARMUP),
    "OneCycle": (("cycle_min_lr", "cycle_max_lr"), (
        "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",
        "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
        "decay_mom_rate", "last_batch_iteration")),
    "LRRangeTest": ((), ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                         "lr_range_test_staircase", "last_batch_iteration")),
}
SCHEDULER_INTS = {  # integer params and their minimum
    "warmup_num_steps": 1, "total_num_steps": 1, "cycle_first_step_size": 1, "cycle_second_step_size": 0,
    "lr_range_test_step_size": 1, "cycle_first_stair_count": 0, "cycle_second_stair_count": 0, "decay_step_size": 0,
    "last_batch_iteration": -1}
OFFLOAD_KEYS = {"device", "pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                "fast_init", "ratio", "pipeline_read", "pipeline_write", "pipeline"}
AIO_KEYS = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit", "overlap_events",
            "use_gds"}
CHECKPOINT_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                   "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULERS = tuple(SCHEDULER_PARAMS)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What "auto" values are resolved from: the model and the launch."""

    world_size: int
    param_dtype: str  # "float32" | "float16" | "bfloat16"
    hidden_size: int
    arguments: dict = field(default_factory=dict)  # config key -> value given by the caller, for "auto"


@dataclass(frozen=True, slots=True)
class OffloadOptions:
    """zero_optimization.offload_optimizer / offload_param, DeepSpeed's keys and
    defaults. buffer_count: host buffers streaming NVMe sub-groups (optimizer) or
    shards (parameters); buffer_size, max_in_cpu: parameter elements per buffer and
    kept in host memory with device nvme; ratio: the fraction of the optimizer
    states offloaded with device cpu (the rest stays on the model's device)."""

    device: str = "none"  # "none" | "cpu" | "nvme"
    pin_memory: bool = False
    nvme_path: str | None = None
    buffer_count: int = 4
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    fast_init: bool = False
    ratio: float = 1.0
    pipeline_read: bool = False
    pipeline_write: bool = False


@dataclass(frozen=True, slots=True)
class AioOptions:
    """The top-level "aio" section, as zero's NVMe I/O uses it: thread_count
    (alias intra_op_parallelism) I/O threads, each transfer split into requests
    of block_size bytes. queue_depth, single_submit and overlap_events steer
    libaio's submission queue, which threads doing blocking pread/pwrite do not
    have: validated, no effect."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True, slots=True)
class ZeroOptions:
    """zero_optimization, as the engine reads it (bounds checked in _zero)."""

    stage: int = 0  # 0-3: what is sharded (sharding/policy.py)
    reduce_bucket_size: int = 500_000_000  # >= 1 elements per gradient bucket
    overlap_comm: bool = True  # reductions run while backward goes on
    prefetch_bucket_size: int = 50_000_000  # >= 0 stage-3 elements gathered ahead of use
    param_persistence_threshold: int = 100_000  # >= 0: stage-3 parameters this small stay whole
    max_live_parameters: int = 1_000_000_000  # >= 0 stage-3 elements gathered at once
    sub_group_size: int = 1_000_000_000  # >= 1 elements per NVMe optimizer sub-group
    offload_optimizer: str = "none"  # the device of offload_optimizer_options, for a quick test
    offload_param: str = "none"  # the device of offload_param_options
    offload_optimizer_options: OffloadOptions = field(default_factory=OffloadOptions)
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
    optimizer: dict | None = None  # {"type", "params"}, built by optim.py
    scheduler: dict | None = None  # {"type", "params"}, built by optim.py
    allow_untested_optimizer: bool = False  # zero_allow_untested_optimizer: any client optimizer at stages 1-3
    activation_checkpointing: dict | None = None  # validated section, for the engine's own checkpointing
    comm_backend: str | None = None  # "ringcomm" | "torch"
    aio: AioOptions = field(default_factory=AioOptions)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)  # zero/monitor


def load(config: str | os.PathLike | dict) -> dict:
    if isinstance(config, dict):
        return dict(config)
    with open(config) as f:
        return json.load(f)


def _warn_unknown(section: dict, known: set[str], where: str) -> None:
    for key in section:
        if key not in known:
            warnings.warn(f"zero config: unknown key {where}{key!r} ignored", stacklevel=3)


def _int(value: object, key: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < minimum:
        raise ValueError(f"zero config: {key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _float(value: object, key: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"zero config: {key} must be a number >= {minimum}, got {value!r}")
    return float(value)


def _bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"zero config: {key} must be true or false, got {value!r}")
    return value


def _get(section: dict, key: str, default: object, auto: object, where: str = "") -> object:
    value = section.get(key, default)
    return auto if value == AUTO else value


def resolve_batch(raw: dict, world_size: int, arguments: dict | None = None) -> tuple[int, int, int]:
    """DeepSpeed's rule: train_batch_size = micro * accumulation * world_size;
    "auto" takes the caller's argument, and any missing one is derived from
    the others (micro 1 and accumulation 1 when nothing is given)."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    arguments = arguments or {}
    values = {k: arguments.get(k) if raw.get(k, AUTO) == AUTO else raw[k] for k in names}
    train, micro, accum = (None if values[k] is None else _int(values[k], k, 1) for k in names)
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
    _warn_unknown(bf16, BF16_KEYS, "bf16.")
    auto_fp16 = bool(facts.arguments.get("fp16", facts.param_dtype == "float16"))
    auto_bf16 = bool(facts.arguments.get("bf16", facts.param_dtype == "bfloat16"))
    fp16_on = _bool(_get(fp16, "enabled", False, auto_fp16), "fp16.enabled")
    bf16_on = _bool(_get(bf16, "enabled", False, auto_bf16), "bf16.enabled")
    if fp16_on and bf16_on:
        raise ValueError("zero config: fp16.enabled and bf16.enabled are both true")
    return "float16" if fp16_on else "bfloat16" if bf16_on else "float32"


def _scaler(section: dict) -> ScalerOptions:
    _warn_unknown(section, FP16_KEYS, "fp16.")
    d = ScalerOptions()
    return ScalerOptions(
        loss_scale=_float(_get(section, "loss_scale", d.loss_scale, d.loss_scale), "fp16.loss_scale"),
        initial_scale_power=_int(_get(section, "initial_scale_power", 16, 16), "fp16.initial_scale_power"),
        loss_scale_window=_int(_get(section, "loss_scale_window", 1000, 1000), "fp16.loss_scale_window", 1),
        hysteresis=_int(_get(section, "hysteresis", 2, 2), "fp16.hysteresis", 1),
        min_loss_scale=_float(_get(section, "min_loss_scale", 1.0, 1.0), "fp16.min_loss_scale", 1e-30),
        consecutive_hysteresis=_bool(section.get("consecutive_hysteresis", False), "fp16.consecutive_hysteresis"))


def _offload(section: object, key: str, stage: int) -> OffloadOptions:
    """One offload section; see OffloadOptions."""
    where = f"zero_optimization.{key}"
    default = OffloadOptions(buffer_count=5 if key == "offload_param" else 4)
    if section is None:
        return default
    if not isinstance(section, dict):
        raise ValueError(f"zero config: {where} must be an object, got {section!r}")
    _warn_unknown(section, OFFLOAD_KEYS, where + ".")
    device = section.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"zero config: {where}.device must be none/cpu/nvme, got {device!r}")
    nvme_path = section.get("nvme_path")
    if device == "nvme" and (not isinstance(nvme_path, str) or not nvme_path):
        raise ValueError(f"zero config: {where}.nvme_path is required with device nvme, got {nvme_path!r}")
    ratio = _float(section.get("ratio", 1.0), f"{where}.ratio")
    if not 0.0 < ratio <= 1.0 or (ratio != 1.0 and device != "cpu"):
        raise ValueError(f"zero config: {where}.ratio must be in (0, 1], and below 1 only with device cpu, "
                         f"got {ratio!r} with device {device!r}")
    if device != "none" and stage < (3 if key == "offload_param" else 1):
        raise ValueError(f"zero config: {where}.device {device!r} needs zero_optimization.stage >= "
                         f"{3 if key == 'offload_param' else 1}, got stage {stage}")
    pipeline = _bool(section.get("pipeline", False), f"{where}.pipeline")
    return OffloadOptions(
        device=device, pin_memory=_bool(section.get("pin_memory", False), f"{where}.pin_memory"),
        nvme_path=nvme_path if device == "nvme" else None,
        buffer_count=_int(section.get("buffer_count", default.buffer_count), f"{where}.buffer_count", 1),
        buffer_size=_int(section.get("buffer_size", default.buffer_size), f"{where}.buffer_size", 1),
        max_in_cpu=_int(section.get("max_in_cpu", default.max_in_cpu), f"{where}.max_in_cpu", 0),
        fast_init=_bool(section.get("fast_init", False), f"{where}.fast_init"), ratio=ratio,
        pipeline_read=_bool(section.get("pipeline_read", pipeline), f"{where}.pipeline_read"),
        pipeline_write=_bool(section.get("pipeline_write", pipeline), f"{where}.pipeline_write"))


def _aio(section: object) -> AioOptions:
    if section is None:
        return AioOptions()
    if not isinstance(section, dict):
        raise ValueError(f"zero config: aio must be an object, got {section!r}")
    _warn_unknown(section, AIO_KEYS, "aio.")
    if _bool(section.get("use_gds", False), "aio.use_gds"):
        raise ValueError("zero config: aio.use_gds true (GPUDirect Storage) is not supported; set it false")
    d = AioOptions()
    block_size = _int(section.get("block_size", d.block_size), "aio.block_size", 1)
    if block_size % 4096:
        raise ValueError(f"zero config: aio.block_size must be a multiple of 4096 bytes (direct I/O), got {block_size}")
    threads = section.get("thread_count", section.get("intra_op_parallelism", d.thread_count))
    return AioOptions(block_size=block_size, queue_depth=_int(section.get("queue_depth", d.queue_depth),
                                                              "aio.queue_depth", 1),
                      thread_count=_int(threads, "aio.thread_count", 1),
                      single_submit=_bool(section.get("single_submit", d.single_submit), "aio.single_submit"),
                      overlap_events=_bool(section.get("overlap_events", d.overlap_events), "aio.overlap_events"))


def _zero(section: dict, facts: ModelFacts) -> ZeroOptions:
    _warn_unknown(section, ZERO_KEYS, "zero_optimization.")
    h, d, z = facts.hidden_size, ZeroOptions(), "zero_optimization."
    stage = section.get("stage", 0)
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"zero config: zero_optimization.stage must be one of {STAGES}, got {stage!r}")
    sizes = {key: _int(_get(section, key, default, auto), z + key, minimum) for key, default, auto, minimum in (
        ("reduce_bucket_size", d.reduce_bucket_size, h * h, 1),
        ("allgather_bucket_size", 500_000_000, h * h, 1),
        ("stage3_prefetch_bucket_size", d.prefetch_bucket_size, int(0.9 * h * h), 0),
        ("stage3_param_persistence_threshold", d.param_persistence_threshold, 10 * h, 0),
        ("stage3_max_live_parameters", d.max_live_parameters, d.max_live_parameters, 0),
        ("stage3_max_reuse_distance", 1_000_000_000, 1_000_000_000, 0),
        ("sub_group_size", d.sub_group_size, d.sub_group_size, 1))}
    flags = {key: _bool(_get(section, key, default, default), z + key) for key, default in (
        ("overlap_comm", True), ("contiguous_gradients", True), ("reduce_scatter", True),
        ("stage3_gather_16bit_weights_on_model_save", False), ("allgather_partitions", True),
        ("round_robin_gradients", False))}
    offload_optimizer = _offload(section.get("offload_optimizer"), "offload_optimizer", stage)
    offload_param = _offload(section.get("offload_param"), "offload_param", stage)
    # The other sizes and flags are validated but have no effect (no_effect.py warns about them).
    return ZeroOptions(
        stage=stage, reduce_bucket_size=sizes["reduce_bucket_size"], overlap_comm=flags["overlap_comm"],
        prefetch_bucket_size=sizes["stage3_prefetch_bucket_size"],
        param_persistence_threshold=sizes["stage3_param_persistence_threshold"],
        max_live_parameters=sizes["stage3_max_live_parameters"],
        sub_group_size=sizes["sub_group_size"], offload_optimizer=offload_optimizer.device,
        offload_param=offload_param.device, offload_optimizer_options=offload_optimizer,
        offload_param_options=offload_param, zeropp=zeropp.parse(section, stage))


def _optimizer(section: object) -> dict | None:
    if section is None:
        return None
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise ValueError(f"zero config: optimizer must be an object with a string 'type', got {section!r}")
    if section["type"].lower() not in OPTIMIZERS:
        raise ValueError(f"zero config: optimizer.type {section['type']!r} is not one of Adam, AdamW, SGD")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"zero config: optimizer.params must be an object, got {params!r}")
    return {"type": section["type"].lower(), "params": dict(params)}


def _scheduler(section: object) -> dict | None:
    """DeepSpeed builds the schedule as type(optimizer, **params): an unknown or
    missing argument is a mistake, named here rather than as a TypeError later.
    "auto" (a Hugging Face placeholder) leaves the schedule's default."""
    if section is None:
        return None
    if not isinstance(section, dict) or section.get("type") not in SCHEDULERS:
        raise ValueError(f"zero config: scheduler.type must be one of {SCHEDULERS}, got {section!r}")
    kind, params = section["type"], section.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"zero config: scheduler.params must be an object, got {params!r}")
    required, optional = SCHEDULER_PARAMS[kind]
    for key in params:
        if key not in required + optional:
            raise ValueError(f"zero config: scheduler.params.{key!r} is not an argument of {kind} "
                             f"(it takes {', '.join(required + optional)})")
    for key in required:
        if params.get(key, AUTO) == AUTO:
            raise ValueError(f"zero config: scheduler.params.{key} is required for {kind}")
    given = {k: v for k, v in params.items() if v != AUTO}
    for key, value in given.items():
        if value is None:  # DeepSpeed's default for the *_second_* sizes and warmup_max_lr
            continue
        if key in SCHEDULER_INTS:
            given[key] = _int(value, f"scheduler.params.{key}", SCHEDULER_INTS[key])
        elif key.endswith(("_lr", "_rate", "_mom")) and not isinstance(value, (list, tuple)):
            _float(value, f"scheduler.params.{key}")
    if given.get("warmup_type", "log") not in ("log", "linear"):
        raise ValueError(f"zero config: scheduler.params.warmup_type must be log or linear, got {given['warmup_type']!r}")
    return {"type": kind, "params": given}


def activation_checkpointing(section: object) -> dict | None:
    """The validated activation_checkpointing section (zero.checkpointing reads it)."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"zero config: activation_checkpointing must be an object, got {section!r}")
    _warn_unknown(section, CHECKPOINT_KEYS, "activation_checkpointing.")
    for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                "synchronize_checkpoint_boundary", "profile"):
        _bool(section.get(key, False), f"activation_checkpointing.{key}")
    if section.get("number_checkpoints") is not None:
        _int(section["number_checkpoints"], "activation_checkpointing.number_checkpoints", 1)
    return dict(section)


def parse(config: str | os.PathLike | dict, facts: ModelFacts) -> EngineConfig:
    """The engine's view of a DeepSpeed config."""
    raw = load(config)
    _warn_unknown(raw, TOP_KEYS, "")
    for key in ("fp16", "bf16", "zero_optimization"):
        if not isinstance(raw.get(key, {}), dict):
            raise ValueError(f"zero config: {key} must be an object, got {raw[key]!r}")
    train, micro, accum = resolve_batch(raw, facts.world_size, facts.arguments)
    zero = _zero(raw.get("zero_optimization", {}), facts)
    checkpointing = activation_checkpointing(raw.get("activation_checkpointing"))
    backend = raw.get("comm_backend")
    if backend not in (None, "ringcomm", "torch"):
        raise ValueError(f"zero config: comm_backend must be 'ringcomm' or 'torch', got {backend!r}")
    parsed = EngineConfig(
        train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=accum,
        gradient_clipping=_float(_get(raw, "gradient_clipping", 0.0, facts.arguments.get("gradient_clipping", 1.0)),
                                 "gradient_clipping"),
        dtype=_dtype(raw, facts), scaler=_scaler(raw.get("fp16", {})), zero=zero,
        optimizer=_optimizer(raw.get("optimizer")), scheduler=_scheduler(raw.get("scheduler")),
        allow_untested_optimizer=_bool(raw.get("zero_allow_untested_optimizer", False),
                                       "zero_allow_untested_optimizer"),
        activation_checkpointing=checkpointing, comm_backend=backend, aio=_aio(raw.get("aio")),
        monitoring=parse_monitoring(raw))
    warn_no_effect(raw)  # once every value is validated
    return parsed
