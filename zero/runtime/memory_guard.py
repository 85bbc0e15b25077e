"""The host-memory check at initialize.

[Note: memory guard]
A run that needs more host memory than its memory cgroup allows is killed by
the kernel mid-step (SIGKILL: no traceback, no message, a peer left waiting).
zero.initialize checks first, when the ranks run under a memory cgroup with a
limit (v1 or v2; ringcomm.core.host.memory_cgroup), before the engine
allocates anything: each rank's model states and communication buffers still
to come are zero.estimate's figure for the configuration (memory_model.need:
the stage, the precision, offload, the bucket sizes) less the parameters the
model already holds. The ranks exchange (host, cgroup, need, limit, usage);
the ranks that share a cgroup must fit together in what it has left
(limit - usage). If any cgroup falls short, every rank raises the same
MemoryError naming the host, the cgroup, the memory needed and what to change,
instead of meeting the kernel's OOM kill. Activations are not counted: the
check is a floor, and the estimate's own margin (docs/zero.md) applies.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ringcomm.core import host
from ringcomm.transport.placement import host_name

from ..estimate import memory_model as mm
from ..sharding import init as zero_init
from . import config as config_mod

GiB = 2**30


def host_need_nbytes(params: list[nn.Parameter], cfg: config_mod.EngineConfig, world_size: int) -> int:
    """Host bytes this rank's engine will still allocate ([Note: memory guard])."""
    numels = [zero_init.full_numel(p) for p in params]
    zero = cfg.zero
    optimizer, param = zero.offload_optimizer_options, zero.offload_param_options
    nvme = mm.NvmeSizes(zero.sub_group_size, optimizer.buffer_count, param.buffer_count, param.buffer_size,
                        param.max_in_cpu)
    job = mm.Job(float(sum(numels)), world_size, float(max(numels, default=0)), 0.0, None,
                 cfg.dtype != "float32", zero.reduce_bucket_size, zero.prefetch_bucket_size,
                 zero.max_live_parameters, zero.max_reuse_distance, nvme=nvme)
    plan = mm.Plan(stage=zero.stage, offload_optimizer=optimizer.device, offload_param=param.device,
                   mixed_precision=cfg.dtype != "float32")
    need = mm.need(job, plan)
    on_host = params[0].device.type == "cpu" if params else True
    total = need.host_nbytes + (need.device_nbytes if on_host else 0.0)
    held = sum(p.untyped_storage().nbytes() for p in params if p.device.type == "cpu")
    return max(int(total) - held, 0)


def check_host_memory(params: list[nn.Parameter], cfg: config_mod.EngineConfig) -> None:
    """Collective: raises the same MemoryError on every rank when the ranks
    sharing a memory cgroup need more than it has left ([Note: memory guard])."""
    world_size = dist.get_world_size()
    cgroup = host.memory_cgroup()
    mine = (host_name(), None, 0, 0, 0) if cgroup is None else \
        (host_name(), cgroup[0], host_need_nbytes(params, cfg, world_size), cgroup[1], cgroup[2])
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    shared: dict[tuple[str, str], list[int]] = {}
    for rank, (name, path, _, _, _) in enumerate(everyone):
        if path is not None:
            shared.setdefault((name, path), []).append(rank)
    for (name, path), ranks in sorted(shared.items()):
        need = sum(everyone[r][2] for r in ranks)
        limit = min(everyone[r][3] for r in ranks)
        usage = max(everyone[r][4] for r in ranks)
        if need > limit - usage:
            raise MemoryError(
                f"zero.initialize: ranks {ranks} on host {name} share the memory cgroup {path}, limited to "
                f"{limit / GiB:.2f} GiB with {usage / GiB:.2f} GiB in use; their model states and buffers need about "
                f"{need / GiB:.2f} GiB more (stage {cfg.zero.stage}, {cfg.dtype}, "
                f"offload_optimizer {cfg.zero.offload_optimizer_options.device}, "
                f"offload_param {cfg.zero.offload_param_options.device}; python -m zero.estimate prints the ladder). "
                f"A higher stage, offload to nvme, more hosts or a larger limit fits it; training would have been "
                f"killed by the kernel's OOM killer.")
