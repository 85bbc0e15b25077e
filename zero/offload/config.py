"""The offload config: zero_optimization.offload_optimizer / offload_param
(OffloadOptions) and the top-level aio section (AioOptions), parsed and checked."""
from __future__ import annotations

from dataclasses import dataclass

from ..parsing.values import as_bool, as_float, as_int, warn_unknown

OFFLOAD_KEYS = {"device", "pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                "fast_init", "ratio", "pipeline_read", "pipeline_write", "pipeline"}
# queue_depth, single_submit, overlap_events: validated, no effect (runtime/no_effect.py warns)
AIO_KEYS = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit", "overlap_events",
            "use_gds"}


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
    have: validated, no effect (runtime/no_effect.py)."""

    block_size: int = 1_048_576
    thread_count: int = 1


def parse_offload(section: object, key: str, stage: int) -> OffloadOptions:
    """One offload section; see OffloadOptions."""
    where = f"zero_optimization.{key}"
    default = OffloadOptions(buffer_count=5 if key == "offload_param" else 4)
    if section is None:
        return default
    if not isinstance(section, dict):
        raise ValueError(f"zero config: {where} must be an object, got {section!r}")
    warn_unknown(section, OFFLOAD_KEYS, where + ".")
    device = section.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"zero config: {where}.device must be none/cpu/nvme, got {device!r}")
    nvme_path = section.get("nvme_path")
    if device == "nvme" and (not isinstance(nvme_path, str) or not nvme_path):
        raise ValueError(f"zero config: {where}.nvme_path is required with device nvme, got {nvme_path!r}")
    ratio = as_float(section.get("ratio", 1.0), f"{where}.ratio")
    if not 0.0 < ratio <= 1.0 or (ratio != 1.0 and device != "cpu"):
        raise ValueError(f"zero config: {where}.ratio must be in (0, 1], and below 1 only with device cpu, "
                         f"got {ratio!r} with device {device!r}")
    if device != "none" and stage < (3 if key == "offload_param" else 1):
        raise ValueError(f"zero config: {where}.device {device!r} needs zero_optimization.stage >= "
                         f"{3 if key == 'offload_param' else 1}, got stage {stage}")
    pipeline = as_bool(section.get("pipeline", False), f"{where}.pipeline")
    return OffloadOptions(
        device=device, pin_memory=as_bool(section.get("pin_memory", False), f"{where}.pin_memory"),
        nvme_path=nvme_path if device == "nvme" else None,
        buffer_count=as_int(section.get("buffer_count", default.buffer_count), f"{where}.buffer_count", 1),
        buffer_size=as_int(section.get("buffer_size", default.buffer_size), f"{where}.buffer_size", 1),
        max_in_cpu=as_int(section.get("max_in_cpu", default.max_in_cpu), f"{where}.max_in_cpu", 0),
        fast_init=as_bool(section.get("fast_init", False), f"{where}.fast_init"), ratio=ratio,
        pipeline_read=as_bool(section.get("pipeline_read", pipeline), f"{where}.pipeline_read"),
        pipeline_write=as_bool(section.get("pipeline_write", pipeline), f"{where}.pipeline_write"))


def parse_aio(section: object) -> AioOptions:
    if section is None:
        return AioOptions()
    if not isinstance(section, dict):
        raise ValueError(f"zero config: aio must be an object, got {section!r}")
    warn_unknown(section, AIO_KEYS, "aio.")
    if as_bool(section.get("use_gds", False), "aio.use_gds"):
        raise ValueError("zero config: aio.use_gds true (GPUDirect Storage) is not supported; set it false")
    d = AioOptions()
    block_size = as_int(section.get("block_size", d.block_size), "aio.block_size", 1)
    if block_size % 4096:
        raise ValueError(f"zero config: aio.block_size must be a multiple of 4096 bytes (direct I/O), got {block_size}")
    as_int(section.get("queue_depth", 8), "aio.queue_depth", 1)
    for flag in ("single_submit", "overlap_events"):
        as_bool(section.get(flag, flag == "overlap_events"), f"aio.{flag}")
    threads = section.get("thread_count", section.get("intra_op_parallelism", d.thread_count))
    return AioOptions(block_size=block_size, thread_count=as_int(threads, "aio.thread_count", 1))
