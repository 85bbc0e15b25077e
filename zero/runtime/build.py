"""Assembles a ZeroEngine: process group, config, buckets, optimizer, hooks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringcomm import BufferLayout, host_name, plan_buckets, plan_module_buckets

from ..activation import checkpointing
from ..checkpoint.snapshot import Snapshots
from ..monitor.setup import open_step_log
from ..monitor.step_log import StepLog
from ..offload.host import HostParamGroup
from ..offload.nvme_params import NvmeParamGroup
from ..sharding import init as zero_init
from ..sharding import units, zeropp
from ..sharding.gather import ModuleGatherer
from ..sharding.fill import build_buckets
from ..sharding.param_group import ParamGroup
from ..sharding.seam import make_comm, make_partition_comm
from ..sharding.wire import Topology
from . import config as config_mod
from .memory_guard import check_host_memory
from ..optim import optimizers as optim
from .engine import EngineParts, ZeroEngine
from .precision import make_scaler

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    shapes = [zero_init.full_shape(p) for p in params]
    hidden = max((min(shape) for shape in shapes if len(shape) == 2), default=1024)
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


def plan_layout(model: nn.Module, params: list[nn.Parameter], cfg: config_mod.EngineConfig,
                world_size: int) -> tuple[BufferLayout, dict[nn.Module, tuple[int, ...]]]:
    """The buckets (ringcomm.plan.layout) and, for stage 3, the buckets each gather
    unit (sharding/units.py) gathers around its use (persistent parameters stay
    whole in a resident bucket)."""
    numels = [zero_init.full_numel(p) for p in params]
    if not cfg.zero.policy.shard_params:
        return plan_buckets(numels, world_size=world_size, bucket_numel=cfg.zero.reduce_bucket_size), {}
    modules, groups = units.gather_units(model, params, cfg.zero.gather_unit)
    plan = plan_module_buckets(groups, numels, world_size=world_size,
                               persistence_threshold=cfg.zero.param_persistence_threshold)
    return plan.layout, {modules[m]: uses for m, uses in enumerate(plan.uses) if uses}


def make_group(buckets: list, cfg: config_mod.EngineConfig, comm, optimizer: torch.optim.Optimizer) -> ParamGroup:
    """The ParamGroup for the config's offload sections."""
    zero = cfg.zero
    if zero.offload_optimizer_options.device == "none" and zero.offload_param_options.device == "none":
        return ParamGroup(buckets, zero.policy, comm, timeout_s=comm.timeout_s)
    if "nvme" not in (zero.offload_optimizer_options.device, zero.offload_param_options.device):
        return HostParamGroup(buckets, zero.policy, comm, timeout_s=comm.timeout_s,
                              options=zero.offload_optimizer_options, param_options=zero.offload_param_options)
    return NvmeParamGroup(buckets, zero.policy, comm, timeout_s=comm.timeout_s, options=zero.offload_optimizer_options,
                          param_options=zero.offload_param_options, optimizer=optimizer, aio=cfg.aio,
                          sub_group_size=zero.sub_group_size)


def use_zeropp(group: ParamGroup, comm, cfg: config_mod.EngineConfig) -> None:
    """The comm's hosts (for wire_report's split; a "torch" comm without ZeRO++ counts no split) and
    ZeRO++'s keys ([Note: ZeRO++ in zero]), checked against the hosts on every rank."""
    options = cfg.zero.zeropp
    if comm.world_size == 1 or (comm.kind != "ringcomm" and options == zeropp.ZeroPPOptions()):
        return  # a torch comm (maybe NCCL, a device per rank) asks no host names it does not need
    if comm.kind == "ringcomm":  # the group exchanged its hosts at set-up
        comm.topology = Topology.of_group(comm.group)
        hosts = list(comm.topology.hosts)
    else:
        hosts = [""] * comm.world_size
        dist.all_gather_object(hosts, host_name())
        comm.topology = Topology(comm.rank, tuple(hosts), hierarchical=False)
    if options == zeropp.ZeroPPOptions():
        return
    zeropp.check_placement(options, hosts, comm.kind, cfg.zero.offload_param_options.device)
    comm.zeropp = options
    size = options.hpz_partition_size
    group.use_zeropp(options, make_partition_comm(comm, size) if size > 1 else None)


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
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = config_mod.parse(config if config is not None else {}, model_facts(model, world_size, args))
    activation = checkpointing.for_engine(cfg.activation_checkpointing)
    step_log = open_step_log(cfg.monitoring, rank)  # collective: before the comm, so a failure leaves nothing
    try:
        return assemble(model, cfg, activation, step_log, optimizer=optimizer, model_parameters=model_parameters,
                        lr_scheduler=lr_scheduler, comm_backend=comm_backend)
    except BaseException:
        step_log.close()
        raise


def assemble(model: nn.Module, cfg: config_mod.EngineConfig, activation: checkpointing.ActivationCheckpointing | None,
             step_log: StepLog, *, optimizer, model_parameters, lr_scheduler, comm_backend: str | None) -> ZeroEngine:
    """The engine for a parsed config: optimizer, comm, buckets, hooks, scheduler, scaler."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[cfg.dtype]
    model.to(dtype)
    params = trainable_params(model)
    check_host_memory(params, cfg)  # collective: before the engine allocates ([Note: memory guard])
    optimizer = make_optimizer(optimizer, model_parameters, params, cfg)
    device = params[0].device if params else torch.device("cpu")
    offloaded = (cfg.zero.offload_optimizer_options.device, cfg.zero.offload_param_options.device) != ("none", "none")
    comm = make_comm(comm_backend or cfg.comm_backend or "ringcomm", device, host_tensors=offloaded)
    comm.overlap = cfg.zero.overlap_comm
    layout, module_uses = plan_layout(model, params, cfg, world_size)
    buckets = build_buckets(params, layout, rank, comm)
    group = make_group(buckets, cfg, comm, optimizer)
    use_zeropp(group, comm, cfg)
    optim.rebind(optimizer, params, group.setup_masters())
    names = {id(p): name for name, p in model.named_parameters()}
    param_names = [names[id(p)] for p in params]
    group.attach(optimizer, param_names)
    group.register_hooks(params)
    gatherer = None
    if cfg.zero.policy.shard_params:
        zero_init.attach(group)
        gatherer = ModuleGatherer({m: [buckets[i] for i in uses] for m, uses in module_uses.items()}, group,
                                  prefetch_numel=cfg.zero.prefetch_bucket_size,
                                  max_live_numel=cfg.zero.max_live_parameters,
                                  max_reuse_numel=cfg.zero.max_reuse_distance)
        gatherer.register()
    scheduler = make_scheduler(lr_scheduler, optimizer, cfg)
    scaler = make_scaler(dtype, cfg.scaler)
    return ZeroEngine(EngineParts(model, optimizer, scheduler, cfg, group, gatherer, scaler, comm, dtype,
                                  param_names, params, activation, step_log, make_snapshots(cfg, rank, world_size)))


def make_snapshots(cfg: config_mod.EngineConfig, rank: int, world_size: int) -> Snapshots | None:
    """The in-memory snapshots (collective: their group and placement), when the config asks for them."""
    return Snapshots(cfg.snapshots, rank, world_size) if cfg.snapshots.enabled else None
