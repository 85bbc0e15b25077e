"""zero: a ZeRO engine (stages 0-3) on ringcomm with DeepSpeed's interface."""
from __future__ import annotations

from . import checkpointing
from .build import build_engine
from .config import EngineConfig, parse
from .engine import ZeroEngine
from .estimate import estimate
from .partition import ShardingPolicy


def initialize(model=None, optimizer=None, model_parameters=None, lr_scheduler=None, config=None,
               comm_backend: str | None = None, **kwargs):
    """deepspeed.initialize: returns (engine, optimizer, None, lr_scheduler).
    comm_backend "ringcomm" (default) or "torch"; also a config key. "auto"
    config values come from `args` (attributes or a dict: per_device_train_batch_size,
    gradient_accumulation_steps, max_grad_norm, ...), the model and the world size."""
    if model is None:
        raise ValueError("zero.initialize: model is required")
    if config is None:
        config = kwargs.pop("config_params", None)
    unknown = set(kwargs) - {"args", "training_data", "collate_fn", "mpu", "dist_init_required"}
    if unknown:
        raise TypeError(f"zero.initialize: unexpected arguments {sorted(unknown)}")
    args = kwargs.get("args")
    if config is None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
    engine = build_engine(model, optimizer, model_parameters, lr_scheduler, config, comm_backend, args)
    return engine, engine.optimizer, None, engine.lr_scheduler


__all__ = ["EngineConfig", "checkpointing", "ShardingPolicy", "ZeroEngine", "estimate", "initialize", "parse"]
