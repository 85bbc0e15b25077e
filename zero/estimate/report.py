"""zero.estimate's arithmetic put together: parameter counts (a number, a
model on the meta device, transformer shapes or a Hugging Face config.json),
the per-stage table, activations, buffers and the ladder, and the CLI's text."""
from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from . import memory_model as mm

GB = 1e9  # the ZeRO paper's unit
UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
         "GIB": 2 ** 30, "TIB": 2 ** 40}
COUNTS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def parse_nbytes(text: str | float, key: str = "size") -> float:
    """'80GB', '80GiB', '1.5TB', or a number of bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise ValueError(f"zero.estimate: {key} must be a size such as 80GB or 512GiB, got {text!r}")
    return float(match.group(1)) * UNITS[match.group(2).upper()]


def parse_count(text: str | float, key: str = "params") -> float:
    """'7.5e9', '7.5B', '350M'."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9.eE+-]+?)\s*([kKmMbBtT]?)\s*", text)
    if not match:
        raise ValueError(f"zero.estimate: {key} must be a count such as 7.5e9 or 350M, got {text!r}")
    return float(match.group(1)) * COUNTS[match.group(2).upper()]


@dataclass(frozen=True, slots=True)
class ModelCount:
    """A model's parameters, counted on the meta device (no weights allocated)."""

    param_numels: tuple[int, ...]  # each distinct parameter once
    largest_layer: int  # the most parameters one module owns
    units: int = 0  # modules owning parameters (stage 3 gathers at most this many units)

    @property
    def num_params(self) -> int:
        return sum(self.param_numels)

    def resident(self, persistence_threshold: int) -> int:
        """Parameters stage 3 keeps whole: numel <= the threshold (DeepSpeed's rule;
        tied weights are sharded like the others)."""
        return sum(n for n in self.param_numels if n <= persistence_threshold)


def count_model(build: str | Callable) -> ModelCount:
    """`build`: "pkg.module:build_fn" or a callable returning an nn.Module;
    it runs under torch's meta device, so no weight memory is allocated."""
    import torch

    if isinstance(build, str):
        module_name, _, attr = build.partition(":")
        if not attr:
            raise ValueError(f"zero.estimate: --model must be pkg.module:build_fn, got {build!r}")
        build = getattr(importlib.import_module(module_name), attr)
    with torch.device("meta"):
        model = build()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zero.estimate: the model builder returned {type(model).__name__}, not an nn.Module")
    owned = [sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()]
    params = list(model.parameters())  # each shared parameter once
    return ModelCount(tuple(p.numel() for p in params), max(owned, default=0), sum(1 for n in owned if n))


HF_KEYS = {  # TransformerShape field <- Hugging Face config names (GPT-2's first)
    "hidden": ("n_embd", "hidden_size", "d_model"), "layers": ("n_layer", "num_hidden_layers", "num_layers"),
    "heads": ("n_head", "num_attention_heads"), "vocab": ("vocab_size",),
    "seq": ("n_positions", "max_position_embeddings", "seq_length"),
}


def shape_from_hf(path: str, *, micro_batch: int, seq: int | None = None, dropout: bool | None = None
                  ) -> mm.TransformerShape:
    """Transformer shapes from a Hugging Face-style config.json."""
    with open(path) as f:
        raw = json.load(f)
    found = {}
    for key, names in HF_KEYS.items():
        found[key] = next((raw[n] for n in names if raw.get(n) is not None), None)
        if found[key] is None and key != "vocab":
            raise ValueError(f"zero.estimate: {path} has none of {names} (the {key})")
    inner = raw.get("n_inner") or raw.get("intermediate_size") or raw.get("ffn_dim")
    act = str(raw.get("activation_function") or raw.get("hidden_act") or "gelu")
    p_drop = max(float(raw.get(k) or 0) for k in ("resid_pdrop", "attn_pdrop", "hidden_dropout_prob",
                                                  "attention_probs_dropout_prob", "dropout"))
    return mm.TransformerShape(
        seq=seq or found["seq"], micro_batch=micro_batch, hidden=found["hidden"], layers=found["layers"],
        heads=found["heads"], vocab=found["vocab"] or 0, mlp_ratio=(inner or 4 * found["hidden"]) / found["hidden"],
        activation="relu" if act == "relu" else "gelu", dropout=p_drop > 0 if dropout is None else dropout)


def transformer_params(shape: mm.TransformerShape) -> int:
    """Parameters of a GPT-style model of `shape` (with biases and norms)."""
    h, inner = shape.hidden, int(shape.mlp_ratio * shape.hidden)
    block = 4 * h * h + 4 * h + 2 * h * inner + inner + h + 4 * h
    return shape.layers * block + shape.vocab * h + shape.seq * h + 2 * h


class StageRow(NamedTuple):
    stage: int
    mixed_nbytes: float  # model states per rank, fp16/bf16 + Adam
    fp32_nbytes: float  # fp32 + Adam
    sent_nbytes: float  # 16-bit elements each rank sends per step
    reduction: float  # DDP's model states over this stage's


@dataclass(slots=True)
class Estimate:
    """What zero.estimate computed; report() is the CLI's text."""

    job: mm.Job
    micro_batch: int
    stage_rows: list[StageRow] = field(default_factory=list)
    activation_rows: list[tuple[str, float]] = field(default_factory=list)
    buffer_rows: list[tuple[int, mm.Buffers]] = field(default_factory=list)
    rungs: list[mm.Rung] = field(default_factory=list)
    device_nbytes: float | None = None

    @property
    def choice(self) -> mm.Rung | None:
        return mm.first_fit(self.rungs) if self.rungs else None

    def config(self) -> dict:
        if self.choice is None:
            raise ValueError("zero.estimate: no rung of the ladder fits; nothing to write")
        return mm.deepspeed_config(self.choice.plan)

    def report(self) -> str:
        job, lines = self.job, []
        lines.append(f"model states per rank, {job.num_params:.4g} parameters, {job.world_size} ranks (GB = 1e9 B)")
        lines.append("stage | fp16/bf16 + Adam (K=12) | fp32 + Adam (K=8) | sent per step (16-bit) | reduction")
        for stage, mixed, fp32, wire, factor in self.stage_rows:
            lines.append(f"{stage:5d} | {mixed / GB:20.1f} GB | {fp32 / GB:14.1f} GB | {wire / GB:19.2f} GB | "
                         f"{factor:8.2f}x")
        if self.activation_rows:
            lines.append("activations per rank (micro batch %d)" % self.micro_batch)
            lines += [f"  {name:48s} {nbytes / GB:10.3f} GB" for name, nbytes in self.activation_rows]
        lines.append("communication buffers per rank (reduce_bucket_size, stage3 prefetch / max live)")
        lines += [f"  stage {stage}: {b.total / GB:.3f} GB" for stage, b in self.buffer_rows]
        if self.rungs:
            lines.append(f"out-of-memory ladder, device {self.device_nbytes / GB:.1f} GB per rank "
                         "(offload as this engine does it: gradients stay on the device)")
            for rung in self.rungs:
                need = rung.need
                lines.append(f"  {'fits' if rung.fits else 'OOM ':4s}  {rung.name:50s} device "
                             f"{need.device_nbytes / GB:8.2f} GB  host {need.host_nbytes / GB:8.2f} GB  "
                             f"nvme {need.nvme_nbytes / GB:8.2f} GB")
            choice = self.choice
            lines.append(f"first that fits: {choice.name}" if choice else "nothing fits")
        return "\n".join(lines)


def estimate(params: float | str | None = None, ranks: int = 1, *, model: str | Callable | None = None,
             shape: mm.TransformerShape | None = None, mixed_precision: bool = True,
             device_memory: float | str | None = None, host_memory: float | str | None = None,
             nvme: float | str | None = None, ranks_per_node: int | None = None,
             reduce_bucket_size: float = 5e8, prefetch_bucket_size: float = 5e7,
             max_live_parameters: float = 1e9, persistence_threshold: int = 100_000,
             max_reuse_distance: float = 1e9) -> Estimate:
    """Memory per rank for `params` parameters (or `model`, counted on the meta
    device, or `shape`'s GPT-style count); with `device_memory`, the ladder.
    Host and NVMe sizes are per node (`ranks_per_node`, default all ranks)."""
    if ranks < 1:
        raise ValueError(f"zero.estimate: ranks must be >= 1, got {ranks!r}")
    count = count_model(model) if model is not None else None
    if count is not None:
        num_params, largest, resident = count.num_params, count.largest_layer, count.resident(persistence_threshold)
    elif params is not None:
        num_params, largest, resident = parse_count(params), 0, 0
    elif shape is not None:
        num_params, largest, resident = transformer_params(shape), 4 * shape.hidden * shape.hidden, 0
    else:
        raise ValueError("zero.estimate: give params, model or transformer shapes")
    if not largest and shape is not None:
        largest = 4 * shape.hidden * shape.hidden
    job = mm.Job(num_params, ranks, largest, resident, shape, mixed_precision, reduce_bucket_size,
                 prefetch_bucket_size, max_live_parameters, max_reuse_distance, units=count.units if count else 0)
    result = Estimate(job, shape.micro_batch if shape else 1)
    for stage in mm.STAGES:
        result.stage_rows.append(StageRow(stage, mm.model_states(num_params, ranks, stage, mm.MIXED, resident).total,
                                  mm.model_states(num_params, ranks, stage, mm.FP32, resident).total,
                                  2 * mm.comm_elements(num_params, ranks, stage), mm.reduction_factor(ranks, stage)))
        result.buffer_rows.append((stage, mm.comm_buffers(
            num_params, stage, 2 if mixed_precision else 4, reduce_bucket_size=reduce_bucket_size,
            prefetch_bucket_size=prefetch_bucket_size, max_live_parameters=max_live_parameters,
            largest_layer=largest, max_reuse_distance=max_reuse_distance)))
    if shape is not None:
        element = 2 if mixed_precision else 4
        result.activation_rows = [
            ("without checkpointing", mm.activations(shape, element).total_nbytes),
            ("checkpointing every block", mm.activations(shape, element, checkpointed=True).total_nbytes)]
        if ranks > 1:
            result.activation_rows.append((f"  inputs partitioned over {ranks} model-parallel ranks", mm.activations(
                shape, element, checkpointed=True, partition_world_size=ranks).total_nbytes))
    if device_memory is not None:
        per_node = ranks_per_node or ranks
        host = math.inf if host_memory is None else parse_nbytes(host_memory, "host_memory") / per_node
        disk = 0.0 if nvme is None else parse_nbytes(nvme, "nvme") / per_node
        result.device_nbytes = parse_nbytes(device_memory, "device_memory")
        result.rungs = mm.ladder(job, shape.micro_batch if shape else 1, result.device_nbytes, host, disk)
    return result
