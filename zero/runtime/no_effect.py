"""The DeepSpeed config keys zero accepts without acting on them, in one table:
for each, when its value asks for nothing zero does not do anyway, and why it
has no effect. config.parse warns (NoEffectWarning, once per key and process)
for each key present with a value that would ask for something else;
docs/zero.md ("Config keys without effect") lists the same table."""
from __future__ import annotations

import warnings
from collections.abc import Callable


class NoEffectWarning(UserWarning):
    """A config key that zero accepts but does not act on asks for something."""


def _is(expected: object) -> Callable[[object], bool]:
    return lambda value: value == expected


def _disabled(value: object) -> bool:
    return not (isinstance(value, dict) and value.get("enabled", False))


def _never(value: object) -> bool:
    return False


# dotted key -> (whether the value asks for nothing beyond what zero does, why the key has no effect)
NO_EFFECT: dict[str, tuple[Callable[[object], bool], str]] = {
    "memory_breakdown": (_is(False), "zero prints no memory breakdown (engine.memory_report() has it)"),
    "dump_state": (_is(False), "zero does not dump its state at start-up"),
    "flops_profiler": (_disabled, "zero has no FLOPs profiler"),
    "prescale_gradients": (_is(False), "gradients are averaged once, after the reduction"),
    "gradient_predivide_factor": (_is(1.0), "gradients are averaged once, after the reduction"),
    "communication_data_type": (_is(None), "gradients are reduced in their own dtype (16-bit ones accumulate "
                                           "in float32 and are rounded once)"),
    "seed": (_never, "zero seeds nothing: call torch.manual_seed yourself"),
    "aio.queue_depth": (_is(8), "NVMe I/O runs blocking pread/pwrite on aio.thread_count threads: no libaio queue"),
    "aio.single_submit": (_is(False), "NVMe I/O runs blocking pread/pwrite on aio.thread_count threads: no libaio "
                                      "submission"),
    "aio.overlap_events": (_is(True), "NVMe I/O runs blocking pread/pwrite on aio.thread_count threads: no libaio "
                                      "events"),
    "zero_force_ds_cpu_optimizer": (lambda value: True, "zero's host optimizer step is its own"),
    "fp16.auto_cast": (_is(False), "the model runs in the precision of its parameters; no autocast"),
    "fp16.fp16_master_weights_and_grads": (_is(False), "fp32 master weights are always kept"),
    "bf16.immediate_grad_update": (lambda value: True, "gradients are reduced per bucket as backward produces them"),
    "bf16.check_grad_overflow": (_is(False), "bf16 gradients are not checked for overflow (as in DeepSpeed's default)"),
    "checkpoint.tag_validation": (lambda value: str(value).upper() != "FAIL",
                                  "tags are not compared across ranks (every rank saves under the tag it is given)"),
    "checkpoint.load_universal": (_is(False), "zero's own checkpoints load on any world size; DeepSpeed's universal "
                                              "format is not read"),
    "checkpoint.use_node_local_storage": (_is(False), "checkpoints go to one shared folder (in-memory snapshots: "
                                                      "checkpoint.in_memory)"),
    "checkpoint.parallel_write": (lambda value: not (isinstance(value, dict) and value.get("pipeline_stage")),
                                  "every rank writes its own shard file already; there are no pipeline stages"),
    "zero_optimization.allgather_bucket_size": (
        _never, "updated parameters are all-gathered in the gradient buckets (reduce_bucket_size)"),
    "zero_optimization.contiguous_gradients": (_is(True), "gradients always live in contiguous flat buckets"),
    "zero_optimization.reduce_scatter": (_is(True), "gradients are always reduce-scattered"),
    "zero_optimization.allgather_partitions": (_is(True), "partitions are always all-gathered in one collective"),
    "zero_optimization.round_robin_gradients": (_is(False), "buckets are owner-aligned; there is no round robin"),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        _is(False), "frozen parameters are not partitioned (every rank keeps them whole): none is gathered"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        _is(True), "save_16bit_model always writes the whole model (rank 0 writes; every rank gathers one "
                   "bucket at a time)"),
}


def warn_no_effect(raw: dict) -> list[str]:
    """Warns for each key of NO_EFFECT present in `raw` with a value that asks for
    something; returns those keys."""
    asked = []
    for key, (harmless, why) in NO_EFFECT.items():
        section, _, name = key.rpartition(".")
        holder = raw.get(section, {}) if section else raw
        if not isinstance(holder, dict) or name not in holder or harmless(holder[name]):
            continue
        asked.append(key)
        # From this one line: the warnings module shows each message once per process.
        warnings.warn(f"zero config: {key}={holder[name]!r} has no effect: {why}", NoEffectWarning, stacklevel=2)
    return asked
