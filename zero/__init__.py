"""zero: a ZeRO engine (stages 0-3) on ringcomm with DeepSpeed's interface.

The face is lazy: a public name imports its module on first use, so
`python -m zero.estimate` (and zero.sharding.policy) need neither ringcomm
nor its compiled extension."""
from __future__ import annotations

import argparse
import importlib

_LAZY = {  # public name -> (module, attribute or None for the module itself)
    "checkpointing": ("zero.checkpointing", None), "comm": ("zero.comm", None), "estimate": ("zero.estimate", None),
    "zero": ("zero.zero", None), "init_distributed": ("zero.comm", "init_distributed"),
    "EngineConfig": ("zero.runtime.config", "EngineConfig"), "parse": ("zero.runtime.config", "parse"),
    "ZeroEngine": ("zero.runtime.engine", "ZeroEngine"), "Init": ("zero.sharding.init", "Init"),
    "GatheredParameters": ("zero.sharding.init", "GatheredParameters"),
    "ShardingPolicy": ("zero.sharding.policy", "ShardingPolicy"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'zero' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = 29500, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               comm_backend: str | None = None, **kwargs):
    """deepspeed.initialize (same argument order): returns (engine, optimizer,
    None, lr_scheduler); training_data is not wrapped in a loader here.
    comm_backend "ringcomm" (default) or "torch"; also a config key. "auto"
    config values come from `args` (attributes or a dict: per_device_train_batch_size,
    gradient_accumulation_steps, max_grad_norm, ...), the model and the world size."""
    if model is None:
        raise ValueError("zero.initialize: model is required")
    if config is None:
        config = kwargs.pop("config_params", None)
    if kwargs:
        raise TypeError(f"zero.initialize: unexpected arguments {sorted(kwargs)}")
    if training_data is not None:
        raise ValueError("zero.initialize: training_data is not supported; build the DataLoader (with a "
                         "DistributedSampler) in the script")
    if mpu is not None:
        raise ValueError("zero.initialize: mpu (model parallelism) is not supported")
    if config is None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    from .comm import init_distributed
    from .runtime.build import build_engine

    init_distributed()
    engine = build_engine(model, optimizer, model_parameters, lr_scheduler, config, comm_backend, args)
    return engine, engine.optimizer, None, engine.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """deepspeed.add_config_arguments: --deepspeed, --deepspeed_config and their
    deprecated --deepscale spellings, in a "DeepSpeed" argument group."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated spelling of --deepspeed_config")
    return parser


__all__ = ["EngineConfig", "GatheredParameters", "Init", "ShardingPolicy", "ZeroEngine", "add_config_arguments",
           "checkpointing", "comm", "estimate", "init_distributed", "initialize", "parse", "zero"]
