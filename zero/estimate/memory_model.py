"""Pure arithmetic of training memory per rank (standard library only): model
states per ZeRO stage (the ZeRO paper's table), communication volume,
transformer activations, communication buffers, offload (ZeRO-Offload /
ZeRO-Infinity), and the out-of-memory ladder over them.

[Note: what is counted]
Model states follow the ZeRO paper: psi parameters, p bytes each for the
parameters and the gradients, K bytes of optimizer state (mixed precision
Adam: fp32 master 4 + momentum 4 + variance 4 = 12; fp32 Adam: 8, the master is
the parameter). Stage 1 shards K, stage 2 also the gradients, stage 3 also the
parameters, except those kept whole on every rank (stage-3 persistent ones).
Activations follow "Reducing Activation Recomputation in Large Transformer
Models" (Korthikanti et al.): what one pre-norm block saves for backward is
s*b*h*(attention 5 + norm inputs 2 + MLP) + a*s*s*b elements (+ dropout), the
MLP term 1 + 2*ratio for an activation that saves its input (GeLU) or
1 + ratio for one that saves its output, which is the next input (ReLU); in
16 bits with dropout that is the paper's s*b*h*(34 + 5*a*s/h) bytes.
Offload follows this engine (zero/offload/host.py, zero/offload/nvme_params.py), which
keeps its 16-bit gradient accumulators on the device: offload_optimizer moves
the optimizer states (fp32 master and Adam's moments, K bytes per parameter,
divided by the ranks) to the host or NVMe, offload_param (stage 3) the 16-bit
parameter shards. DeepSpeed's ZeRO-Offload moves fp32 gradients too (16 bytes
per parameter on the host, none on the device).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from ringcomm.plan.schedule import bus_factor

from ..sharding.policy import STAGES, ShardingPolicy


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    param_bytes: int  # p: parameters and gradients
    optimizer_bytes: int  # K


MIXED = Precision("fp16/bf16 + Adam", 2, 12)
FP32 = Precision("fp32 + Adam", 4, 8)


class ModelStates(NamedTuple):
    params_nbytes: float
    grads_nbytes: float
    optimizer_nbytes: float

    @property
    def total(self) -> float:
        return self.params_nbytes + self.grads_nbytes + self.optimizer_nbytes


def model_states(num_params: float, world_size: int, stage: int, precision: Precision = MIXED,
                 resident_params: float = 0) -> ModelStates:
    """Bytes per rank (see the Note); `resident_params` stay whole at stage 3."""
    if stage not in STAGES:
        raise ValueError(f"model_states: stage must be one of {STAGES}, got {stage!r}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"model_states: {world_size=} must be >= 1 and {num_params=} >= 0")
    policy, p, k, n = ShardingPolicy.for_stage(stage), precision.param_bytes, precision.optimizer_bytes, world_size
    params = p * num_params / n + p * resident_params * (1 - 1 / n) if policy.shard_params else p * num_params
    grads = p * num_params / n if policy.shard_grads else p * num_params
    optimizer = k * num_params / n if policy.shard_optimizer else k * num_params
    return ModelStates(params, grads, optimizer)


def comm_elements(num_params: float, world_size: int, stage: int) -> float:
    """Elements each rank sends per step: 2 psi (n-1)/n (all-reduce, or
    reduce-scatter + all-gather), 3 psi (n-1)/n at stage 3 (parameters
    gathered for forward and again for backward). ringcomm.plan.schedule is
    standard library only, so the estimate runs where ringcomm is not built."""
    return ShardingPolicy.for_stage(stage).ring_phases * num_params * bus_factor("all_gather", world_size)


def reduction_factor(world_size: int, stage: int) -> float:
    """Model-state memory of DDP over that of `stage` (mixed precision Adam)."""
    return model_states(1, world_size, 0).total / model_states(1, world_size, stage).total


@dataclass(frozen=True, slots=True)
class TransformerShape:
    seq: int
    micro_batch: int
    hidden: int
    layers: int
    heads: int
    vocab: int = 0
    mlp_ratio: float = 4.0
    activation: str = "gelu"  # "gelu": saves its input; "relu": saves its output
    dropout: bool = False

    def __post_init__(self) -> None:
        for key in ("seq", "micro_batch", "hidden", "layers", "heads"):
            if getattr(self, key) < 1:
                raise ValueError(f"TransformerShape: {key} must be >= 1, got {getattr(self, key)!r}")
        if self.activation not in ("gelu", "relu"):
            raise ValueError(f"TransformerShape: activation must be 'gelu' or 'relu', got {self.activation!r}")


class Activations(NamedTuple):
    layer_nbytes: float  # what one block saves for backward
    input_nbytes: float  # one block's input (what a per-block checkpoint keeps)
    outside_nbytes: float  # outside the blocks: token ids, the head's input
    total_nbytes: float  # the peak


def activations(shape: TransformerShape, element_bytes: int, *, checkpointed: bool = False,
                partition_world_size: int = 1) -> Activations:
    """Activation bytes per rank (see the Note). Checkpointed per block: every
    block's input (1/partition_world_size of it when partitioned) plus one
    block recomputed at a time, whose saved tensors include its whole input."""
    s, b, h, a = shape.seq, shape.micro_batch, shape.hidden, shape.heads
    sbh, attention = s * b * h, a * s * s * b
    mlp = 1 + (2 if shape.activation == "gelu" else 1) * shape.mlp_ratio
    elements = sbh * (7 + mlp) + attention
    masks = 0
    if shape.dropout:  # two residual masks and the attention-probability mask (1 byte), its output
        masks, elements = 2 * sbh + attention, elements + attention
    layer = elements * element_bytes + masks
    block_input, token_ids = sbh * element_bytes, s * b * 8
    outside = token_ids + block_input  # int64 token ids, the head's input
    if checkpointed:  # the peak: the end of forward, or the last block recomputed (its input whole
        # again) after the head's backward freed its input
        held = math.ceil(block_input / partition_world_size)
        peak = max(shape.layers * held + outside, (shape.layers - 1) * held + layer + token_ids)
        return Activations(layer, block_input, outside, peak)
    return Activations(layer, block_input, outside, shape.layers * layer + outside)


class Buffers(NamedTuple):
    gradient_nbytes: float  # a transient gradient bucket (stages 2-3)
    gathered_nbytes: float  # stage 3: gathered parameters alive at once

    @property
    def total(self) -> float:
        return self.gradient_nbytes + self.gathered_nbytes


def kept_for_backward(num_params: float, largest_layer: float, max_reuse_distance: float) -> float:
    """Stage 3's gathered elements kept from forward for backward at the turn:
    a suffix within half the reuse distance, at most that plus one unit
    ([Note: reuse distance] in ringcomm/plan/gathers.py); none without reuse."""
    return min(max_reuse_distance / 2 + largest_layer, num_params) if max_reuse_distance > 0 else 0.0


def comm_buffers(num_params: float, stage: int, param_bytes: int, *, reduce_bucket_size: float,
                 prefetch_bucket_size: float, max_live_parameters: float, largest_layer: float,
                 max_reuse_distance: float = 0) -> Buffers:
    """Stage 2 reduces from one transient bucket of reduce_bucket_size
    elements. Stage 3 gathers per unit (`largest_layer`, the largest) and
    holds the unit in use plus the prefetched ones, or at the turn from
    forward to backward the units kept for backward (a suffix of forward
    within half the reuse distance, [Note: reuse distance] in
    ringcomm/plan/gathers.py: at most that plus one unit), at most
    stage3_max_live_parameters; it reduces per unit, so one unit's gradients
    are transient beside the kept units (a second one's, while the first is
    reduce-scattered, takes the place of a kept unit backward released)."""
    gradient = gathered = 0.0
    if stage == 2:
        gradient = min(reduce_bucket_size, num_params) * param_bytes
    if stage == 3:
        gradient = min(largest_layer, num_params) * param_bytes
        kept = kept_for_backward(num_params, largest_layer, max_reuse_distance)
        in_use = max(kept, largest_layer + prefetch_bucket_size)
        gathered = min(max_live_parameters, in_use, num_params) * param_bytes
    return Buffers(gradient, gathered)


@dataclass(frozen=True, slots=True)
class NvmeSizes:
    """The NVMe sections' sizes (DeepSpeed's keys and defaults): what the
    staging buffers and the shards kept in memory come from."""

    sub_group_size: float = 1e9  # zero_optimization.sub_group_size
    optimizer_buffer_count: int = 4  # offload_optimizer.buffer_count
    param_buffer_count: int = 5  # offload_param.buffer_count
    param_buffer_size: float = 1e8  # offload_param.buffer_size (elements)
    max_in_cpu: float = 1e9  # offload_param.max_in_cpu (elements kept in memory)


def nvme_host(num_params: float, world_size: int, stage: int, param_bytes: int, *, largest_layer: float,
              largest_param: float, units: int, sizes: NvmeSizes, optimizer: bool, params: bool
              ) -> tuple[float, float]:
    """(host bytes, bytes of 16-bit shards kept in memory) of NVMe offload per
    rank (zero/offload/nvme_states.py, nvme_params.py). The optimizer's
    staging: min(buffer_count, sub-groups) regions of three fp32 parts
    (master, exp_avg, exp_avg_sq) of the largest sub-group, which is
    sub_group_size elements, or a larger parameter slice alone, at most the
    rank's share. The parameters': min(buffer_count, units) buffers of the
    largest unit's shard (`units` 0: buffer_count); the first max_in_cpu
    elements of shards stay in memory."""
    owned = num_params / world_size if stage >= 1 else num_params
    staging = kept = 0.0
    if optimizer and owned > 0:
        sub = min(owned, max(sizes.sub_group_size, min(largest_param, owned)))
        staging += min(sizes.optimizer_buffer_count, math.ceil(owned / sub)) * 3 * 4 * sub
    if params and stage == 3 and owned > 0:
        kept = min(sizes.max_in_cpu, owned) * param_bytes
        swapped = owned - kept / param_bytes
        shard = min(largest_layer / world_size, sizes.param_buffer_size, swapped) if largest_layer else 0.0
        if shard > 0:
            staging += min(sizes.param_buffer_count, units or sizes.param_buffer_count) * shard * param_bytes
    return staging + kept, kept


def nvme_traffic(job: Job, plan: Plan) -> tuple[float, float]:
    """(read, written) bytes per rank of one optimizer step on NVMe. The
    optimizer reads and writes each sub-group's three fp32 parts once (12
    bytes per owned parameter); offload_param (stage 3) writes the updated
    shards beyond max_in_cpu once and reads them at every gather, forward and
    backward of each micro step, but for the units kept gathered across the
    turn (comm_buffers: a suffix within half the reuse distance)."""
    precision = MIXED if plan.mixed_precision else FP32
    p, n = precision.param_bytes, job.world_size
    owned = job.num_params / n if plan.stage >= 1 else job.num_params
    read = written = 0.0
    if plan.offload_optimizer == "nvme":
        read, written = 12 * owned, 12 * owned
    if plan.offload_param == "nvme" and plan.stage == 3:
        sizes = plan.nvme or job.nvme
        swapped = max(owned - sizes.max_in_cpu, 0.0)
        kept = kept_for_backward(job.num_params, job.largest_layer, job.max_reuse_distance) / n
        read += p * plan.accumulation * (2 * swapped - min(kept, swapped))
        written += p * swapped
    return read, written


def snapshot_nbytes(num_params: float, world_size: int, stage: int, *, replicas: int = 1, slots: int = 2,
                    hosts: int = 1) -> float:
    """Shared memory per rank that the in-memory snapshots add
    (zero/checkpoint/snapshot.py): `slots` steps of the `replicas` buddy copies
    it keeps, and of its own piece; on one host with a buddy the own piece is
    one, and holds Adam's two moments (the optimizer's: not counted again,
    [Note: moments in the own piece]). A piece is the fp32 masters and the two
    moments the rank owns, 12 bytes per parameter (at stage 0 rank 0 owns them
    all: the figure is then its and its buddy's)."""
    owned = num_params if stage == 0 else num_params / world_size
    replicas = replicas if world_size > 1 else 0  # one rank has no buddy
    if replicas and hosts == 1:
        return 12.0 * owned * (1 + slots * replicas) - 8.0 * owned
    return 12.0 * owned * slots * (1 + replicas)


# ---- the out-of-memory ladder -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Plan:
    """One configuration: what a rung of the ladder turns on."""

    stage: int = 0
    micro_batch: int = 1
    accumulation: int = 1
    checkpointing: bool = False
    offload_optimizer: str = "none"  # "none" | "cpu" | "nvme"
    offload_param: str = "none"
    mixed_precision: bool = False
    nvme: NvmeSizes | None = None  # the NVMe sections' sizes where the plan sets them (else the job's)


class Need(NamedTuple):
    device_nbytes: float
    host_nbytes: float  # per rank
    nvme_nbytes: float  # per rank


@dataclass(frozen=True, slots=True)
class Job:
    num_params: float
    world_size: int
    largest_layer: float = 0
    resident_params: float = 0
    shape: TransformerShape | None = None
    mixed_precision: bool = True  # the model already trains in fp16/bf16
    reduce_bucket_size: float = 5e8
    prefetch_bucket_size: float = 5e7
    max_live_parameters: float = 1e9
    max_reuse_distance: float = 1e9
    largest_param: float = 0  # elements of the largest parameter (0: largest_layer)
    units: int = 0  # stage 3's gather units (0: unknown, so at least the buffers NVMe offload may fill)
    nvme: NvmeSizes = NvmeSizes()


def need(job: Job, plan: Plan) -> Need:
    """Bytes per rank on the device, the host and NVMe for `plan`."""
    precision = MIXED if plan.mixed_precision else FP32
    p, psi, n = precision.param_bytes, job.num_params, job.world_size
    states = model_states(psi, n, plan.stage, precision, job.resident_params)
    device_params, device_grads, device_optimizer = states
    moved = {"cpu": 0.0, "nvme": 0.0}  # what leaves the device, by where it goes
    if plan.offload_optimizer != "none":  # [Note: what is counted]: the gradients stay
        moved[plan.offload_optimizer], device_optimizer = moved[plan.offload_optimizer] + device_optimizer, 0.0
    if plan.offload_param != "none":  # stage 3: the shards leave; gathered modules and persistent ones stay
        whole = p * job.resident_params
        moved[plan.offload_param], device_params = moved[plan.offload_param] + device_params - whole, whole
    buffers = comm_buffers(psi, plan.stage, p, reduce_bucket_size=job.reduce_bucket_size,
                           prefetch_bucket_size=job.prefetch_bucket_size,
                           max_live_parameters=job.max_live_parameters, largest_layer=job.largest_layer,
                           max_reuse_distance=job.max_reuse_distance)
    acts = 0.0
    if job.shape is not None:
        shape = replace(job.shape, micro_batch=plan.micro_batch)
        acts = activations(shape, p, checkpointed=plan.checkpointing).total_nbytes
    device = device_params + device_grads + device_optimizer + buffers.total + acts
    host, kept = nvme_host(psi, n, plan.stage, p, largest_layer=job.largest_layer,
                           largest_param=job.largest_param or job.largest_layer, units=job.units,
                           sizes=plan.nvme or job.nvme,
                           optimizer=plan.offload_optimizer == "nvme", params=plan.offload_param == "nvme")
    return Need(device, moved["cpu"] + host, moved["nvme"] - kept)


class Rung(NamedTuple):
    name: str
    plan: Plan
    need: Need
    fits: bool


def ladder(job: Job, micro_batch: int, device_nbytes: float, host_nbytes: float = math.inf,
           nvme_nbytes: float = 0.0) -> list[Rung]:
    """The users' out-of-memory ladder, in order; host and NVMe sizes are per
    rank. Every rung after the second keeps micro batch 1 + accumulation and
    checkpointing; the stage-3 rungs start again without offload."""
    start = Plan(micro_batch=micro_batch, mixed_precision=job.mixed_precision)
    small = replace(start, micro_batch=1, accumulation=micro_batch)
    ckpt = replace(small, checkpointing=True)
    z2 = replace(ckpt, stage=2)
    z2_off = replace(z2, offload_optimizer="cpu")
    z3 = replace(ckpt, stage=3)
    z3_param = replace(z3, offload_param="cpu")
    z3_both = replace(z3_param, offload_optimizer="cpu")
    steps = [("stage 0 (DDP)", start), ("micro batch 1 + gradient accumulation", small),
             ("+ activation checkpointing", ckpt), ("stage 2", z2), ("stage 2 + offload_optimizer (cpu)", z2_off),
             ("stage 3", z3), ("stage 3 + offload_param (cpu)", z3_param),
             ("stage 3 + offload_param + offload_optimizer (cpu)", z3_both)]
    if not job.mixed_precision:
        steps.append(("+ bf16", replace(z3_both, mixed_precision=True)))
    last = steps[-1][1]
    steps.append(("+ NVMe (offload_param + offload_optimizer)", replace(last, offload_param="nvme",
                                                                      offload_optimizer="nvme", nvme=NVME_RUNG)))
    rungs = []
    for name, plan in steps:
        needed = need(job, plan)
        fits = needed.device_nbytes <= device_nbytes and needed.host_nbytes <= host_nbytes \
            and needed.nvme_nbytes <= nvme_nbytes
        rungs.append(Rung(name, plan, needed, fits))
    return rungs


# The ladder's NVMe rung: DeepSpeed's defaults keep a whole sub-group of 1e9
# elements (12 GB of staging) and 1e9 elements of shards in memory; the rung
# streams small sub-groups and keeps no shard, as ZeRO-Infinity's runs do.
NVME_RUNG = NvmeSizes(sub_group_size=1e7, max_in_cpu=0)


def first_fit(rungs: list[Rung]) -> Rung | None:
    return next((r for r in rungs if r.fits), None)


def deepspeed_config(plan: Plan, *, nvme_path: str = "/local_nvme") -> dict:
    """A DeepSpeed JSON config for `plan`. No optimizer section: the caller
    passes theirs, which DeepSpeed accepts under offload only with
    zero_force_ds_cpu_optimizer false (an "optimizer" section instead gets
    DeepSpeed's CPU Adam)."""
    zero: dict = {"stage": plan.stage}
    for key, device in (("offload_optimizer", plan.offload_optimizer), ("offload_param", plan.offload_param)):
        if device == "cpu":
            zero[key] = {"device": "cpu", "pin_memory": True}
        elif device == "nvme":
            zero[key] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
    if plan.nvme is not None:
        zero["sub_group_size"] = int(plan.nvme.sub_group_size)
        if "offload_param" in zero:
            zero["offload_param"]["max_in_cpu"] = int(plan.nvme.max_in_cpu)
    if plan.offload_optimizer == "nvme":  # the next sub-group read, the last written, while one updates
        zero["offload_optimizer"].update(pipeline_read=True, pipeline_write=True)
    config = {"train_micro_batch_size_per_gpu": plan.micro_batch, "gradient_accumulation_steps": plan.accumulation,
              "gradient_clipping": 1.0, "zero_optimization": zero}
    if plan.offload_optimizer != "none":
        config["zero_force_ds_cpu_optimizer"] = False
    if plan.mixed_precision:
        config["bf16"] = {"enabled": True}
    if plan.checkpointing:
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False}
    return config
