"""Assembles a ZeroEngine: process group, config, units, optimizer, hooks."""
from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ringcomm.layout import BufferLayout, plan_buckets

from . import config as config_mod
from . import optim
from .comm import Comm, RingComm, make_comm
from .engine import EngineParts, ZeroEngine
from .gather import UnitGatherer
from .param_group import ParamGroup
from .reducer import BucketReducer, FlatBufferReducer, GradReducer
from .unit import Unit, build_units, units_on_buffer
from .partition import ParamSlot, UnitPlan, module_units
from .precision import make_scaler

log = logging.getLogger("zero")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def init_distributed() -> None:
    """env:// under a launcher (torchrun sets RANK/WORLD_SIZE); else one process."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


ARGUMENTS = {  # config key <- attribute of `args` (DeepSpeed/HF launcher arguments), for "auto"
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "train_batch_size": ("train_batch_size",),
    "gradient_clipping": ("gradient_clipping", "max_grad_norm"),
    "fp16": ("fp16",),
    "bf16": ("bf16",),
}


def model_facts(model: nn.Module, world_size: int, args: object = None) -> config_mod.ModelFacts:
    params = list(model.parameters())
    dtype = str(params[0].dtype).removeprefix("torch.") if params else "float32"
    hidden = max((min(p.shape) for p in params if p.dim() == 2), default=1024)
    given = {}
    for key, names in ARGUMENTS.items():
        for name in names:
            value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
            if value is not None:
                given[key] = value
                break
    return config_mod.ModelFacts(world_size, dtype, hidden, given)


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def plan_units(model: nn.Module, params: list[nn.Parameter], cfg: config_mod.EngineConfig,
               world_size: int) -> tuple[tuple[UnitPlan, ...], list[nn.Module | None]]:
    """Units and, for stage 3, the module of each unit (None: resident)."""
    numels = [p.numel() for p in params]
    if not cfg.zero.policy.shard_params:
        return units_from_layout(plan_buckets(numels, world_size=world_size,
                                              bucket_numel=cfg.zero.reduce_bucket_size)), []
    modules, groups = module_groups(model, params)
    plans = module_units(groups, numels, world_size, cfg.zero.param_persistence_threshold)
    owners = []
    for plan in plans:
        owners.append(None if plan.resident else _module_of(plan, groups, modules))
    return plans, owners


WHOLE_MODULES = (nn.MultiheadAttention,)  # use their children's parameters without calling the children


def module_groups(model: nn.Module, params: list[nn.Parameter]) -> tuple[list[nn.Module], list[list[int]]]:
    """Stage 3: each module with parameters of its own and the indices of those
    parameters; a WHOLE_MODULES module takes its whole subtree."""
    index_of = {id(p): i for i, p in enumerate(params)}
    modules, groups, inside = [], [], set()
    for module in model.modules():
        if id(module) in inside:
            continue
        whole = isinstance(module, WHOLE_MODULES)
        if whole:
            inside.update(id(m) for m in module.modules())
        indices = [index_of[id(p)] for p in module.parameters(recurse=whole) if id(p) in index_of]
        if indices:
            modules.append(module)
            groups.append(indices)
    return modules, groups


def units_from_layout(layout: BufferLayout) -> tuple[UnitPlan, ...]:
    """Stages 0-2 take ringcomm's owner-aligned bucket layout (ringcomm/layout.py):
    each bucket becomes a resident unit, chunk r of it rank r's shard."""
    units = []
    for bucket in layout.buckets:
        slots = tuple(ParamSlot(i, layout.params[i].begin - bucket.begin, layout.params[i].numel)
                      for i in bucket.param_indices)
        units.append(UnitPlan(slots, bucket.chunk_numel, layout.world_size, resident=True))
    return tuple(units)


def _module_of(plan: UnitPlan, groups: list[list[int]], modules: list[nn.Module]) -> nn.Module:
    first = plan.slots[0].index
    return next(m for g, m in zip(groups, modules) if first in g)


def flat_buffer_reducer(params: list[nn.Parameter], names: list[str], cfg: config_mod.EngineConfig,
                        comm: Comm) -> tuple[list[Unit], GradReducer]:
    """Stages 0-1 on ringcomm: a FlatBuffer in the group's shared memory owns the
    parameters and gradients; a BucketScheduler averages its buckets."""
    from ringcomm import ReduceOp
    from ringcomm.buffer import FlatBuffer, transport_allocator
    from ringcomm.overlap import BucketScheduler

    group = comm.group
    buffer = FlatBuffer(params, world_size=comm.world_size, views_for=("grad", "data"),
                        bucket_bytes=cfg.zero.reduce_bucket_size * params[0].element_size(),
                        allocate=transport_allocator(group))
    kind = "reduce_scatter" if cfg.zero.policy.shard_optimizer else "all_reduce"
    scheduler = BucketScheduler([buffer], group, mode=kind, op=ReduceOp.AVG, overlap=cfg.zero.overlap_comm,
                                find_unused_parameters=True)
    units = units_on_buffer(buffer, units_from_layout(buffer.layout), params, comm.rank, comm)
    reducer = FlatBufferReducer(buffer, scheduler, comm, kind)
    reducer.named_params = list(zip(names, params))
    return units, reducer


def make_optimizer(optimizer, model_parameters, params: list[nn.Parameter],
                   cfg: config_mod.EngineConfig) -> torch.optim.Optimizer:
    if optimizer is not None:
        if cfg.optimizer is not None:
            raise ValueError("zero: an optimizer was passed and the config has an 'optimizer' section; pass one")
        optim.check_supported(optimizer, cfg.zero.stage, cfg.allow_untested_optimizer)
        return optimizer
    if cfg.optimizer is None:
        raise ValueError("zero: no optimizer: pass optimizer= or give the config an 'optimizer' section")
    chosen = list(model_parameters) if model_parameters is not None else params
    return optim.from_config(cfg.optimizer, chosen)


def make_scheduler(lr_scheduler, optimizer, cfg: config_mod.EngineConfig):
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if cfg.scheduler is not None:
        return optim.scheduler_from_config(cfg.scheduler, optimizer)
    return None


def build_engine(model: nn.Module, optimizer=None, model_parameters=None, lr_scheduler=None,
                 config=None, comm_backend: str | None = None, args: object = None) -> ZeroEngine:
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = config_mod.parse(config if config is not None else {}, model_facts(model, world_size, args))
    for note in cfg.not_implemented:
        message = f"zero: {note} is parsed and validated but not implemented yet (a later issue); ignored"
        warnings.warn(message, stacklevel=3)
        if rank == 0:
            log.warning(message)
    dtype = DTYPES[cfg.dtype]
    model.to(dtype)
    params = trainable_params(model)
    optimizer = make_optimizer(optimizer, model_parameters, params, cfg)
    comm = make_comm(comm_backend or cfg.comm_backend or "ringcomm")
    comm.overlap = cfg.zero.overlap_comm
    plans, owners = plan_units(model, params, cfg, world_size)
    if cfg.reducer == "flat_buffer" and comm.kind == "torch":
        raise ValueError("zero config: zero_reducer 'flat_buffer' runs on ringcomm; comm_backend is 'torch'")
    if cfg.reducer == "flat_buffer" and isinstance(comm, RingComm):
        names = {id(p): name for name, p in model.named_parameters()}
        units, reducer = flat_buffer_reducer(params, [names[id(p)] for p in params], cfg, comm)
    else:
        units = build_units(params, plans, rank, comm)
        # gradients become ready in reverse forward order: stage 0-2 buckets are laid out
        # that way already; stage 3 units follow the modules (forward order), resident last
        order = units if not cfg.zero.policy.shard_params else \
            [u for u in reversed(units) if not u.plan.resident] + [u for u in units if u.plan.resident]
        reducer = BucketReducer(units, cfg.zero.policy, comm, order)
    group = ParamGroup(units, cfg.zero.policy, comm, reducer)
    optim.rebind(optimizer, params, group.setup_masters())
    reducer.register()
    gatherer = None
    if cfg.zero.policy.shard_params:
        gatherer = UnitGatherer({m: u for m, u in zip(owners, units) if m is not None}, comm,
                                prefetch_numel=cfg.zero.prefetch_bucket_size,
                                max_live_numel=cfg.zero.max_live_parameters)
        gatherer.register()
    scheduler = make_scheduler(lr_scheduler, optimizer, cfg)
    scaler = make_scaler(dtype, cfg.scaler)
    names = {id(p): name for name, p in model.named_parameters()}
    return ZeroEngine(EngineParts(model, optimizer, scheduler, cfg, group, gatherer, scaler, comm, dtype,
                                  [names[id(p)] for p in params], params))
