"""Multi-process tests of flat buffers + BucketScheduler against gloo DDP, and
of the coalesced collectives against a closed form."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import ringcomm
from harness import run_ranks

BF16_TOL = dict(rtol=2e-2, atol=2e-2)  # bf16 has 8 mantissa bits: DDP divides before summing, ringcomm after
FP32_TOL = dict(rtol=1e-5, atol=1e-6)  # summation order differs between the gloo and ringcomm rings


class Mixed(nn.Module):
    """fp32 and bf16 parameters, plus one that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4).to(torch.bfloat16)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)).to(torch.bfloat16)).float()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), nn.Linear(16, 4))


def _batch(name: str, rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    shape = (4, 5, 16) if name == "transformer" else (6, 8)
    return torch.randn(shape, generator=gen).to(dtype)


def _build(name: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = {"mlp": _mlp, "transformer": _transformer, "mixed": Mixed}[name]()
    return model if name == "mixed" else model.to(dtype)


def _backward(model: nn.Module, name: str, rank: int, step: int, dtype: torch.dtype) -> None:
    model(_batch(name, rank, step, dtype)).float().square().mean().backward()


def _ddp_grads(name: str, dtype: torch.dtype, rank: int, steps: int, find_unused: bool) -> list[torch.Tensor]:
    """The gradients gloo DDP gives after `steps` accumulated micro-steps."""
    ddp = DistributedDataParallel(_build(name, dtype), find_unused_parameters=find_unused)
    for step in range(steps - 1):
        with ddp.no_sync():
            _backward(ddp, name, rank, step, dtype)
    _backward(ddp, name, rank, steps - 1, dtype)
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in ddp.module.parameters()]


def _scheduler(model: nn.Module, group: ringcomm.Group, bucket_bytes: int, **kwargs) -> ringcomm.BucketScheduler:
    buffers = ringcomm.flat_buffers(model.parameters(), world_size=group.world_size, bucket_bytes=bucket_bytes,
                                    first_bucket_bytes=kwargs.pop("first_bucket_bytes", None),
                                    allocate=ringcomm.transport_allocator(group))
    scheduler = ringcomm.BucketScheduler(buffers, group, **kwargs)
    scheduler.register_hooks(model.named_parameters())
    return scheduler


def _compare(model: nn.Module, expected: list[torch.Tensor], case: str, rank: int,
             shard_only: ringcomm.BucketScheduler | None = None) -> None:
    for (pname, param), want in zip(model.named_parameters(), expected):
        tol = BF16_TOL if param.dtype == torch.bfloat16 else FP32_TOL
        got, want = param.grad.float().reshape(-1), want.float().reshape(-1)
        if shard_only is not None:  # reduce_scatter: only this rank's chunk of each bucket is defined
            buffer = next(b for b in shard_only.buffers if any(p is param for p in b.params))
            span = buffer.layout.param_shard(buffer.index_of(param), rank)
            got, want = got[span.begin:span.end], want[span.begin:span.end]
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"rank {rank} {case} {pname}: {m}")


def _grads_match_ddp(rank: int, world_size: int, transport: str) -> None:
    group = ringcomm.new_group(transport=transport, timeout=60)
    model_numel = 2000
    for name in ("mlp", "transformer"):
        for dtype in (torch.float32, torch.bfloat16):
            expected = _ddp_grads(name, dtype, rank, 1, False)
            numel = sum(p.numel() for p in _build(name, dtype).parameters())
            assert numel < model_numel * 4, numel
            for bucket_numel in (1, 37, 300, numel * 2):
                for mode in ("all_reduce", "reduce_scatter"):
                    case = f"{name} {dtype} bucket_numel={bucket_numel} {mode}"
                    model = _build(name, dtype)
                    size = bucket_numel * dtype.itemsize
                    scheduler = _scheduler(model, group, size, first_bucket_bytes=size // 2 or 1, mode=mode)
                    _backward(model, name, rank, 0, dtype)
                    report = scheduler.finish()
                    assert report.num_buckets == sum(len(b.layout.buckets) for b in scheduler.buffers), case
                    _compare(model, expected, case, rank, scheduler if mode == "reduce_scatter" else None)


@pytest.mark.parametrize("world_size,transport", [(2, "auto"), (3, "auto"), pytest.param(4, "auto", marks=pytest.mark.slow), (2, "torch_dist")])
def test_grads_match_ddp(world_size: int, transport: str) -> None:
    run_ranks(_grads_match_ddp, world_size, transport, timeout=240)


def _features(rank: int, world_size: int) -> None:
    group = ringcomm.new_group(timeout=60)
    # mixed dtypes get separate buffers; unused params are an error naming them, or zero when asked
    model = _build("mixed", torch.float32)
    scheduler = _scheduler(model, group, 64)
    assert sorted(str(b.dtype) for b in scheduler.buffers) == ["torch.bfloat16", "torch.float32"]
    _backward(model, "mixed", rank, 0, torch.float32)
    with pytest.raises(RuntimeError, match=r"unused\.weight"):
        scheduler.finish()
    expected = _ddp_grads("mixed", torch.float32, rank, 1, True)
    model = _build("mixed", torch.float32)
    scheduler = _scheduler(model, group, 64, mode="all_reduce", find_unused_parameters=True)
    _backward(model, "mixed", rank, 0, torch.float32)
    scheduler.finish()
    _compare(model, expected, "mixed find_unused", rank)
    _accumulation_and_reuse(rank, group)
    _overlap_off_and_misuse(rank, group)


def _overlap_off_and_misuse(rank: int, group: ringcomm.Group) -> None:
    model = _build("mlp", torch.float32)
    scheduler = _scheduler(model, group, 256)
    _backward(model, "mlp", rank, 0, torch.float32)
    num_buckets = len(scheduler.buffers[0].layout.buckets)
    assert num_buckets > 1 and len(scheduler._launches) == num_buckets, f"rank {rank}: not launched during backward"
    scheduler.finish()
    scheduler.remove_hooks()
    model = _build("mlp", torch.float32)
    scheduler = _scheduler(model, group, 256, overlap=False)
    assert ringcomm.transport_allocator(group) is not None or group.transport.kind != "shm", f"rank {rank}"
    _backward(model, "mlp", rank, 0, torch.float32)
    assert not scheduler._launches, f"rank {rank}: overlap=False launched during backward"
    report = scheduler.finish()
    assert report.num_buckets > 1 and report.exposed_s == pytest.approx(report.comm_s), f"rank {rank}: {report}"
    assert report.hidden_fraction == pytest.approx(0.0, abs=1e-9), f"rank {rank}: {report}"
    _backward(model, "mlp", rank, 0, torch.float32)
    with pytest.raises(RuntimeError, match="marked ready twice"):
        _backward(model, "mlp", rank, 0, torch.float32)


def _accumulation_and_reuse(rank: int, group: ringcomm.Group) -> None:
    """no_sync accumulates without communicating; from step 2 on nothing is allocated."""
    model = _build("mlp", torch.float32)
    scheduler = _scheduler(model, group, 512, mode="all_reduce")
    for step in range(4):
        if step == 1:
            observed = scheduler.observed_order()
            assert sorted(observed) == [(0, i) for i in range(6)], f"rank {rank}: observed {observed}"
            scheduler.rebuild_buckets()  # the only re-allocation, right after the first step
            if rank == 0:
                assert scheduler.buffers[0].layout.order == tuple(i for _, i in observed), f"rank {rank}"
            grads, flats = [p.grad for p in model.parameters()], [b.grad for b in scheduler.buffers]
            pointers = [g.data_ptr() for g in grads]
        scheduler.zero_grad()
        with scheduler.no_sync():
            _backward(model, "mlp", rank, 0, torch.float32)
            assert not scheduler._launches, f"rank {rank} step {step}: no_sync launched a collective"
            scheduler.finish()
        _backward(model, "mlp", rank, 1, torch.float32)
        launches = list(scheduler._launches)
        if step % 2 == 0:  # compute that outlasts the comm: busy until every bucket's collective has ended
            spins, x = 0, torch.ones(64, 64)
            while not all(launch.succeeded() for launch in launches) and spins < 10**6:
                x = x @ x / 64
                spins += 1
        report = scheduler.finish()
        assert scheduler.finish() is report, f"rank {rank}: finish() is not idempotent"
        assert report.comm_s > 0 and report.num_overlapped == report.num_buckets == len(launches), \
            f"rank {rank} step {step}: {report}"
        if step % 2 == 0:  # every bucket ran during backward and the compute after it: none of it exposed
            assert report.exposed_s == 0.0 and report.hidden_fraction == 1.0, f"rank {rank} step {step}: {report}"
        _compare(model, _ddp_grads("mlp", torch.float32, rank, 2, False), f"accumulate step {step}", rank)
        if step >= 1:
            assert all(p.grad is g for p, g in zip(model.parameters(), grads)), f"rank {rank} step {step}: new .grad"
            assert [g.data_ptr() for g in grads] == pointers, f"rank {rank} step {step}: grad storage moved"
            assert all(b.grad is f for b, f in zip(scheduler.buffers, flats)), f"rank {rank} step {step}: new buffer"


@pytest.mark.parametrize("world_size", [2, 3])
def test_features(world_size: int) -> None:
    run_ranks(_features, world_size, timeout=120)


def _rank_tensor(rank: int, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float64).mul(0.5).add(rank * 10 + i).to(dtype)


def _coalesced(rank: int, world_size: int) -> None:
    group = ringcomm.new_group(timeout=60)
    ws = world_size
    numels = [0, 1, 7, 13, 64, 3]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float64, torch.bfloat16]
    for bucket_bytes in (None, 1, 40, 1 << 20):
        for async_op in (False, True):
            case = f"bucket_bytes={bucket_bytes} async_op={async_op}"
            inputs = [_rank_tensor(rank, i, ws * n, d) for i, (n, d) in enumerate(zip(numels, dtypes))]
            outputs = [torch.empty(n, dtype=d) for n, d in zip(numels, dtypes)]
            work = ringcomm.reduce_scatter_coalesced(outputs, inputs, "sum", group, async_op, bucket_bytes=bucket_bytes)
            if async_op:
                work.wait(60)
            for i, (n, d) in enumerate(zip(numels, dtypes)):
                full = sum(_rank_tensor(r, i, ws * n, torch.float64) for r in range(ws))
                want = full[rank * n:(rank + 1) * n].to(d)
                torch.testing.assert_close(outputs[i], want, msg=lambda m: f"rank {rank} rs {case} tensor {i}: {m}")
            inputs = [_rank_tensor(rank, i, n, d) for i, (n, d) in enumerate(zip(numels, dtypes))]
            outputs = [torch.empty(ws * n, dtype=d) for n, d in zip(numels, dtypes)]
            work = ringcomm.all_gather_coalesced(outputs, inputs, group, async_op, bucket_bytes=bucket_bytes)
            if async_op:
                work.wait(60)
            for i, (n, d) in enumerate(zip(numels, dtypes)):
                want = torch.cat([_rank_tensor(r, i, n, d) for r in range(ws)])
                torch.testing.assert_close(outputs[i], want, msg=lambda m: f"rank {rank} ag {case} tensor {i}: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_coalesced(world_size: int) -> None:
    run_ranks(_coalesced, world_size, timeout=120)


@pytest.mark.slow
def test_overlap_benchmark_smoke(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap.py"
    out = tmp_path / "overlap.json"
    args = ["--layers", "2", "--width", "32", "--batch", "4", "--steps", "2", "--warmup", "1", "--bucket-mb", "0.001",
            "--first-bucket-mb", "0.001", "--transport", "shm", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hidden behind backward" in proc.stdout, proc.stdout
    (summary,) = json.loads(out.read_text())["runs"]
    on, off, _ = summary["rows"]
    assert summary["num_buckets"] > 1 and on["comm_ms"] > 0 and off["hidden_fraction"] == 0.0, summary
