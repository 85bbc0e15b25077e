"""zero.estimate against the ZeRO and Megatron papers' closed forms,
DeepSpeed's own counting, and what the engine measures (memory_report, the
saved-tensor hooks of zero.checkpointing)."""
from __future__ import annotations

import json
from dataclasses import replace
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from deepspeed_cpu import skip_unless_accepted
from harness import run_ranks
from zero_reference import TinyTransformer, activation_peaks

import zero
from zero.estimate import memory_model as mm
from zero.estimate import count_model, estimate, shape_from_hf
from zero.estimate.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [  # (vocab, hidden, heads, layers, micro batch, sequence): three different transformers
    (32, 16, 2, 2, 4, 6), (50, 64, 4, 3, 2, 32), (40, 48, 6, 4, 3, 24)]


def small() -> nn.Module:
    return TinyTransformer(32, 16, 2, 2)


def wide() -> nn.Module:
    return TinyTransformer(50, 64, 4, 3)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 50), nn.ReLU(), nn.Linear(50, 7))


def test_paper_table(capsys) -> None:
    """ZeRO paper, Figure 1: 7.5 B parameters, 64 ranks, mixed precision Adam."""
    assert main(["--params", "7.5e9", "--ranks", "64"]) == 0
    rows = re.findall(r"^\s+(\d) \|\s+([\d.]+) GB \|\s+([\d.]+) GB \|\s+([\d.]+) GB \|\s+([\d.]+)x",
                      capsys.readouterr().out, re.M)
    assert [r[1] for r in rows] == ["120.0", "31.4", "16.6", "1.9"], rows
    psi, n = 7.5e9, 64
    for stage, row in enumerate(rows):  # 16-bit elements sent per rank per step
        assert float(row[3]) == pytest.approx((3 if stage == 3 else 2) * psi * (n - 1) / n * 2 / 1e9, abs=0.006)
    factors = [float(r[4]) for r in rows]
    assert factors[0] == 1.0 and 3.5 < factors[1] < 4 and 7 < factors[2] < 8 and factors[3] == 64, factors


@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 4096, 32), (512, 8, 1024, 16), (100, 3, 96, 6)])
def test_megatron_activation_formula(s: int, b: int, h: int, a: int) -> None:
    """Korthikanti et al., eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer (16 bits, dropout)."""
    shape = mm.TransformerShape(s, b, h, 1, a, dropout=True)
    assert mm.activations(shape, 2).layer_nbytes == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)


def test_ladder_hand_made() -> None:
    gb, n = 1e9, 8
    job = mm.Job(1e9, n, largest_layer=1e7, reduce_bucket_size=1e6, prefetch_bucket_size=1e6)
    # stage 2: 2 + 14/8 = 3.75 GB; + offload_optimizer: 2 + 2/8 GB on the device, 12/8 GB on the host
    rungs = mm.ladder(job, 1, 3 * gb, host_nbytes=64 * gb / n)
    names = {r.name: r for r in rungs}
    assert names["stage 2"].need.device_nbytes == pytest.approx(3.75 * gb + 2e6)
    assert not names["stage 2"].fits
    assert mm.first_fit(rungs).name == "stage 2 + offload_optimizer (cpu)"
    assert mm.first_fit(rungs).need.device_nbytes == pytest.approx(2.25 * gb + 2e6)
    assert mm.first_fit(rungs).need.host_nbytes == pytest.approx(1.5 * gb)
    # 1.5 GB: stage 3 needs 16/8, + offload_param 14/8; with both 2/8 on the device, 14/8 GB host per rank
    rungs = mm.ladder(job, 1, 1.5 * gb, host_nbytes=64 * gb / n)
    assert mm.first_fit(rungs).name == "stage 3 + offload_param + offload_optimizer (cpu)"
    assert mm.first_fit(rungs).need.host_nbytes == pytest.approx(14 / 8 * gb)
    # the same with 1.5 GB of host per rank: NVMe
    assert mm.first_fit(mm.ladder(job, 1, 1.5 * gb, 1.5 * gb)) is None
    rungs = mm.ladder(job, 1, 1.5 * gb, 1.5 * gb, nvme_nbytes=10 * gb)
    assert mm.first_fit(rungs).name == "+ NVMe (offload_param + offload_optimizer)"
    # activations decide: micro batch 8 of a 24-layer 2048-wide transformer
    shape = mm.TransformerShape(2048, 8, 2048, 24, 16)
    job = mm.Job(1e8, 1, shape=shape, reduce_bucket_size=0)
    per_sample = mm.activations(mm.TransformerShape(2048, 1, 2048, 24, 16), 2).total_nbytes
    states = 16 * 1e8
    rungs = mm.ladder(job, 8, states + 2 * per_sample)
    assert mm.first_fit(rungs).name == "micro batch 1 + gradient accumulation"
    assert mm.first_fit(rungs).plan.accumulation == 8
    assert mm.first_fit(mm.ladder(job, 8, states + 0.5 * per_sample)).name == "+ activation checkpointing"


def test_nvme_staging_hand_made() -> None:
    """NVMe offload's host memory: the optimizer's staging regions (3 fp32
    parts of the largest sub-group, buffer_count of them), the parameters'
    buffers (a unit's shard each) and the shards max_in_cpu keeps."""
    gb = 1e9
    job = mm.Job(1e9, 2, largest_layer=1e8, largest_param=3e7, reduce_bucket_size=0, prefetch_bucket_size=0,
                 max_live_parameters=0)
    both = mm.Plan(stage=3, offload_optimizer="nvme", offload_param="nvme", mixed_precision=True)
    # a parameter slice of 3e7 elements is a sub-group of its own: 4 x 12 B x 3e7; 3 buffers of a 5e7 shard
    sizes = mm.NvmeSizes(sub_group_size=1e7, optimizer_buffer_count=4, param_buffer_count=3, max_in_cpu=0)
    need = mm.need(replace(job, nvme=sizes), both)
    assert need.host_nbytes == pytest.approx(4 * 12 * 3e7 + 3 * 5e7 * 2)
    assert need.nvme_nbytes == pytest.approx(14 * 0.5 * gb)  # 12 B of optimizer states + 2 B of shard
    # max_in_cpu keeps the first 1e8 elements of shards in memory, not on NVMe
    need = mm.need(replace(job, nvme=replace(sizes, max_in_cpu=1e8)), both)
    assert need.host_nbytes == pytest.approx(4 * 12 * 3e7 + 3 * 5e7 * 2 + 2e8)
    assert need.nvme_nbytes == pytest.approx(7 * gb - 2e8)
    # DeepSpeed's defaults (sub_group_size 1e9, max_in_cpu 1e9): the rank's whole share in one region,
    # its shards in memory; only the optimizer states' file is on NVMe
    need = mm.need(job, both)
    assert need.host_nbytes == pytest.approx(12 * 0.5 * gb + 2 * 0.5 * gb)
    assert need.nvme_nbytes == pytest.approx(12 * 0.5 * gb)
    # optimizer states alone on NVMe at stage 2: no parameter buffers; parameters on cpu stay host bytes
    need = mm.need(replace(job, nvme=sizes), mm.Plan(stage=2, offload_optimizer="nvme", mixed_precision=True))
    assert need.host_nbytes == pytest.approx(4 * 12 * 3e7)
    need = mm.need(replace(job, nvme=sizes), replace(both, offload_param="cpu"))
    assert (need.host_nbytes, need.nvme_nbytes) == pytest.approx((4 * 12 * 3e7 + gb, 6 * gb))
    # the ladder's NVMe rung streams small sub-groups, keeps no shard, and writes that into its config
    rung = mm.ladder(job, 1, 2 * gb, 2 * gb, nvme_nbytes=10 * gb)[-1]
    assert rung.fits and rung.need.host_nbytes == pytest.approx(4 * 12 * 3e7 + 5 * 5e7 * 2)
    written = mm.deepspeed_config(rung.plan)["zero_optimization"]
    assert (written["sub_group_size"], written["offload_param"]["max_in_cpu"]) == (1e7, 0)
    assert written["offload_optimizer"]["pipeline_read"] and written["offload_optimizer"]["pipeline_write"]


def test_nvme_traffic_hand_made() -> None:
    """NVMe bytes per rank and step: the optimizer's 12 bytes per owned
    parameter read and written; offload_param's shards written once and read
    at each gather but for the suffix kept across the turn, per micro step."""
    job = mm.Job(1e9, 2, largest_layer=1e8, max_reuse_distance=4e8, nvme=mm.NvmeSizes(max_in_cpu=0))
    both = mm.Plan(stage=3, accumulation=2, offload_optimizer="nvme", offload_param="nvme", mixed_precision=True)
    kept = (2e8 + 1e8) / 2  # half the reuse distance plus a unit, this rank's shard of it
    assert mm.nvme_traffic(job, both) == pytest.approx((6e9 + 2 * 2 * (2 * 5e8 - kept), 6e9 + 2 * 5e8))
    # max_in_cpu keeps 1e8 elements of shards in memory: neither read nor written
    job = replace(job, nvme=mm.NvmeSizes(max_in_cpu=1e8))
    assert mm.nvme_traffic(job, both) == pytest.approx((6e9 + 2 * 2 * (2 * 4e8 - kept), 6e9 + 2 * 4e8))
    assert mm.nvme_traffic(job, mm.Plan(stage=2, offload_optimizer="nvme")) == pytest.approx((6e9, 6e9))
    assert mm.nvme_traffic(job, replace(both, offload_optimizer="cpu", offload_param="cpu")) == (0.0, 0.0)


def test_counts_match_deepspeed() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for build in (small, wide, mlp):
        count = count_model(build)  # meta device: no weights
        total, largest = model_to_params(build())
        assert (count.num_params, count.largest_layer) == (total, largest), build.__name__
        job = mm.Job(total, 4, largest_layer=largest, reduce_bucket_size=0)
        # the device keeps the 16-bit parameters, and this engine its 16-bit gradient shard too
        offload = mm.need(job, mm.Plan(stage=2, offload_optimizer="cpu", mixed_precision=True))
        _, gpu_mem = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=4, cpu_offload=True)
        assert offload.device_nbytes == gpu_mem + 2 * total / 4, build.__name__
        # both offloads at stage 3: the gradient shard and the gathered parameters (DeepSpeed: those only)
        both = mm.need(job, mm.Plan(stage=3, offload_optimizer="cpu", offload_param="cpu", mixed_precision=True))
        _, gpu_mem, largest_memory = estimate_zero3_model_states_mem_needs(total, largest, 4)
        assert both.device_nbytes - mm.comm_buffers(total, 3, 2, reduce_bucket_size=0, prefetch_bucket_size=5e7,
                                                    max_live_parameters=1e9, largest_layer=largest).total \
            == gpu_mem - largest_memory + 2 * total / 4


def trained_engine(build, bf16: bool, zero_section: dict):
    """An engine on build()'s model after one step (Adam, so every state exists)."""
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "bf16": {"enabled": bf16},
           "zero_optimization": {"reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 40, **zero_section}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=build(), config=cfg)
    x = torch.randint(0, 32, (2, 5)) if build is not mlp else torch.randn(2, 100)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    return engine


def states_worker(rank: int, world_size: int) -> list[str]:
    lines = []
    for build in (small, wide, mlp):
        for dtype_name in ("fp32", "bf16"):
            for stage in range(4):
                engine = trained_engine(build, dtype_name == "bf16", {"stage": stage})
                measured = engine.memory_report().model_state_nbytes
                row = estimate(model=build, ranks=world_size, persistence_threshold=40,
                               mixed_precision=dtype_name == "bf16").stage_rows[stage]
                expected = row.mixed_nbytes if dtype_name == "bf16" else row.fp32_nbytes
                case = f"rank {rank} {build.__name__} {dtype_name} stage {stage}"
                assert abs(measured - expected) <= 0.02 * expected, f"{case}: measured {measured} B, estimate {expected:.0f} B"
                lines.append(f"{case}: {measured} / {expected:.0f}")
    return lines


def offload_worker(rank: int, world_size: int, nvme_path: str) -> None:
    """The offload rungs against the engine: bytes on the device, the host
    (with NVMe: its staging buffers) and NVMe per rank (bf16 + Adam)."""
    for build in (small, mlp):
        for stage, offload in ((1, "cpu"), (2, "cpu"), (3, "nvme")):
            section = {"device": offload, "nvme_path": nvme_path}
            zero_section = {"stage": stage, "offload_optimizer": section}
            if stage == 3:
                zero_section["offload_param"] = dict(section, max_in_cpu=0)
            engine = trained_engine(build, True, zero_section)
            report = engine.memory_report()
            job = estimate(model=build, ranks=world_size, persistence_threshold=40, mixed_precision=True).job
            plan = mm.Plan(stage=stage, offload_optimizer=offload, offload_param=offload if stage == 3 else "none",
                           mixed_precision=True)
            job = replace(job, reduce_bucket_size=0, max_live_parameters=0, nvme=mm.NvmeSizes(max_in_cpu=0))
            need = mm.need(job, plan)
            buffers = mm.comm_buffers(job.num_params, stage, 2, reduce_bucket_size=0, prefetch_bucket_size=0,
                                      max_live_parameters=0, largest_layer=job.largest_layer)
            need = need._replace(device_nbytes=need.device_nbytes - buffers.total)  # the states (and NVMe staging)
            case = f"rank {rank} {build.__name__} stage {stage} {offload}: {report}"
            measured = (report.device_nbytes, report.host_nbytes) + ((report.disk_nbytes,) if offload == "nvme" else ())
            expected = (need.device_nbytes, need.host_nbytes) + ((need.nvme_nbytes,) if offload == "nvme" else ())
            # swap files and staging buffers page-align each part: 3 per sub-group (master, exp_avg,
            # exp_avg_sq), 1 per bucket's shard
            aligned = 4096 * (3 + len(engine.parts.group.buckets)) if offload == "nvme" else 0
            for got, want, where in zip(measured, expected, ("device", "host", "nvme")):
                assert want * 0.98 <= got <= want * 1.02 + aligned, \
                    f"{case} {where}: measured {got} B, estimate {want:.0f} B"


@pytest.mark.slow
def test_model_states_match_memory_report(tmp_path) -> None:
    run_ranks(states_worker, 2, timeout=240)
    run_ranks(offload_worker, 2, str(tmp_path), timeout=240)


@pytest.mark.parametrize("vocab,hidden,heads,layers,batch,seq", SHAPES)
def test_activation_estimate_against_measured_peak(vocab, hidden, heads, layers, batch, seq) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(vocab, hidden, heads, layers)
    tokens = torch.randint(0, vocab, (batch, seq))
    shape = mm.TransformerShape(seq, batch, hidden, layers, heads, vocab, activation="relu")  # Block: ReLU MLP
    for checkpointed, peak in activation_peaks(model, tokens, lambda out: out.sum()).items():
        expected = mm.activations(shape, 4, checkpointed=checkpointed).total_nbytes
        assert abs(peak - expected) <= 0.25 * peak, \
            f"{shape} checkpointed={checkpointed}: measured {peak} B, estimate {expected:.0f} B"


def test_hf_config_and_errors(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
                                "vocab_size": 50257, "activation_function": "gelu_new", "resid_pdrop": 0.1}))
    shape = shape_from_hf(str(path), micro_batch=2)
    assert (shape.hidden, shape.layers, shape.heads, shape.seq, shape.dropout) == (768, 12, 12, 1024, True)
    result = estimate(ranks=1, shape=shape)
    assert result.job.num_params == pytest.approx(124.4e6, rel=0.01)  # GPT-2 small (tied head counted once)
    path.write_text(json.dumps({"n_layer": 12}))
    with pytest.raises(ValueError, match="hidden"):
        shape_from_hf(str(path), micro_batch=1)
    with pytest.raises(ValueError, match="device_memory"):
        estimate(1e9, 8, device_memory="eighty")
    with pytest.raises(ValueError, match="ranks"):
        estimate(1e9, 0)


WRITTEN_TRAINS = """
import json, os, sys, warnings, torch
sys.path[:0] = [{root!r}, {tests!r}]
from torch import nn
import zero
from zero_reference import Block, TinyTransformer
config = json.load(open({path!r}))
model = TinyTransformer()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
assert zero.checkpointing.is_configured() == ("activation_checkpointing" in config)
zero.checkpointing.checkpoint_modules(model, Block)
losses = []
for step in range(2 * engine.gradient_accumulation_steps()):
    tokens = torch.randint(0, 32, (engine.train_micro_batch_size_per_gpu(), 6))
    loss = nn.functional.cross_entropy(engine(tokens).float().reshape(-1, 32), tokens.reshape(-1))
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
assert engine.global_steps == 2 * engine.gradient_accumulation_steps() and all(map(torch.isfinite, torch.tensor(losses)))
print("trained", losses)
"""
WRITTEN_LOADS = """
import json, sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
from deepspeed_cpu import import_deepspeed
from zero_reference import TinyTransformer
deepspeed = import_deepspeed()
import tempfile, torch.distributed as dist
# one rank, initialized as a launcher would: DeepSpeed takes the group instead of looking for MPI
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = TinyTransformer()
ds, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                              config=json.load(open({path!r})))
print("loaded", type(ds).__name__)
"""


def written_config(tmp_path) -> str:
    """The config zero.estimate writes for 1e9 parameters on 8 ranks of 3 GB; its path."""
    path = str(tmp_path / "ds_config.json")
    args = ["--params", "1e9", "--ranks", "8", "--device-memory", "3GB", "--host-memory", "64GB",
            "--reduce-bucket-size", "1e6", "--stage3-prefetch-bucket-size", "1e6", "--write", path]
    assert main(args) == 0
    config = json.load(open(path))
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert config["train_micro_batch_size_per_gpu"] == 1 and "activation_checkpointing" in config
    return path


def run_written(code: str, path: str) -> subprocess.CompletedProcess:
    code = code.format(root=ROOT, tests=os.path.join(ROOT, "tests"), path=path)
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, "DS_ACCELERATOR": "cpu",
           "LOCAL_RANK": "0"}  # DeepSpeed's sanity check wants a launcher's variable
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)


def test_written_config_trains_with_zero(tmp_path) -> None:
    result = run_written(WRITTEN_TRAINS, written_config(tmp_path))
    assert result.returncode == 0 and "trained" in result.stdout, (result.stdout + result.stderr)[-3000:]


@pytest.mark.slow
def test_written_config_loads_in_deepspeed(tmp_path) -> None:
    """DeepSpeed builds its engine from the written config, in the config's dtype
    (skipped where DeepSpeed refuses that dtype on this CPU)."""
    path = written_config(tmp_path)
    config = json.load(open(path))
    skip_unless_accepted(next((d for d in ("bf16", "fp16") if config.get(d, {}).get("enabled")), "fp32"))
    result = run_written(WRITTEN_LOADS, path)
    assert result.returncode == 0 and "loaded" in result.stdout, (result.stdout + result.stderr)[-3000:]


def test_cli_model_and_shapes(capsys) -> None:
    assert main(["--model", "tests.test_zero_estimate:wide", "--ranks", "2", "--seq", "32", "--hidden", "64",
                 "--layers", "3", "--heads", "4", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{count_model(wide).num_params:.4g} parameters" in out and "checkpointing every block" in out
