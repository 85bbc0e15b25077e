"""Multi-process: model-state bytes per rank (ZeRO paper), wire bytes per step,
and forced fp16 overflows moving the loss scale identically on every rank."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from harness import run_ranks
import zero_reference  # noqa: F401  (puts the repo root on sys.path)

import zero

PAPER = {  # model-state bytes per rank / psi, mixed precision Adam (K = 12)
    0: lambda n: 16.0, 1: lambda n: 4 + 12 / n, 2: lambda n: 2 + 14 / n, 3: lambda n: 16 / n}
WIRE = {0: 2, 1: 2, 2: 2, 3: 3}  # elements sent per rank per step / (psi (n-1)/n)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


def config(stage: int, dtype_name: str, **fp16) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "fp16": {"enabled": dtype_name == "fp16", "initial_scale_power": 8, **fp16},
            "bf16": {"enabled": dtype_name == "bf16"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096, "stage3_param_persistence_threshold": 0}}


def train_step(engine, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(10 * step + rank)
    x, y = torch.randn(4, 100, generator=g), torch.randn(4, 10, generator=g)
    engine.backward(nn.functional.mse_loss(engine(x).float(), y))
    engine.step()


def check_memory_and_wire(rank: int, world_size: int, stage: int, dtype_name: str, backend: str,
                          reuse: int | None = 0) -> None:
    """reuse: stage3_max_reuse_distance (None: DeepSpeed's default, 1e9). With 0
    backward gathers every unit again (3 ring phases); with the default this
    small model is kept gathered from forward to backward (2 phases)."""
    case = f"rank {rank}/{world_size} stage {stage} {dtype_name} {backend} reuse {reuse}"
    model = make_mlp()
    psi = sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = config(stage, dtype_name)
        cfg["comm_backend"] = backend  # the config key (zero.initialize's argument would win)
        if reuse is not None:
            cfg["zero_optimization"]["stage3_max_reuse_distance"] = reuse
        engine, *_ = zero.initialize(model=model, config=cfg)
    for step in range(2):
        train_step(engine, rank, step)
    group = engine.parts.group
    overlapped = group.scheduler.report.num_overlapped
    assert overlapped == len(group.buckets) > 1, \
        f"{case}: {overlapped} of {len(group.buckets)} buckets reduced during backward"
    report = engine.memory_report()
    padding = len(engine.parts.group.buckets) * world_size  # elements added to split buckets evenly
    expected = PAPER[stage](world_size) * psi
    assert abs(report.model_state_nbytes - expected) <= 16 * padding, f"{case}: {report} vs paper {expected:.0f} B"
    if stage >= 2:
        assert report.comm_buffer_nbytes > 0, f"{case}: transient buckets are reported apart: {report}"
    if stage == 3:  # the next buckets were gathered (prefetched) while one was in use
        bucket_nbytes = max(b.span.numel for b in group.buckets) * 2
        assert engine.parts.gatherer.peak_live_nbytes > bucket_nbytes, f"{case}: no prefetch"
    assert engine.parts.comm.kind == ("torch" if backend == "torch" else "ringcomm"), case
    sent_elements = engine.wire_report().sent_nbytes / 2  # fp16 / bf16 elements
    phases = 2 if stage == 3 and reuse is None else WIRE[stage]
    expected_wire = phases * psi * (world_size - 1) / world_size
    assert abs(sent_elements - expected_wire) <= 3 * padding + 16, f"{case}: sent {sent_elements} vs {expected_wire}"
    kept = 2 * sum(b.span.numel for b in group.buckets) if stage == 3 and reuse is None else 0
    assert report.kept_gathered_nbytes == kept, f"{case}: {report.kept_gathered_nbytes} B kept, expected {kept}"


def check_forced_overflow(rank: int, world_size: int, stage: int, static: bool = False) -> list[float]:
    """`x` steps get an inf in one gradient element on the last rank only. A
    static fp16 scale also skips those steps, and never moves."""
    pattern, expected = "xx....x.x", [16, 8, 8, 8, 8, 16, 16, 16, 8]
    if static:
        expected = [16.0] * len(pattern)
    model = make_mlp()
    inject = {"on": False}
    model[0].weight.register_hook(
        lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("inf"), dtype=g.dtype))
        if inject["on"] and rank == world_size - 1 else g)
    cfg = config(stage, "fp16", initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=1,
                 loss_scale=16 if static else 0)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 9e-4,
                                                       "warmup_num_steps": 8, "warmup_type": "linear"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=cfg)
    scales = []
    for step, flag in enumerate(pattern):
        before = engine.full_params_fp32()
        inject["on"] = flag == "x"
        train_step(engine, rank, step)
        after = engine.full_params_fp32()
        changed = any(not torch.equal(a, b) for a, b in zip(before, after))
        assert changed == (flag == ".") == engine.was_step_applied(), \
            f"rank {rank} stage {stage} step {step}: {flag=} but {changed=}, {engine.was_step_applied()=}"
        scales.append(engine.loss_scale)
    assert scales == expected, f"rank {rank} stage {stage}: scales {scales} != {expected}"
    assert engine.skipped_steps == pattern.count("x") and engine.global_steps == len(pattern)
    clean = pattern.count(".")  # the scheduler steps only with the optimizer, from iteration -1 (as DeepSpeed's)
    assert engine.get_lr()[0] == pytest.approx(1e-4 + 8e-4 * (clean - 1) / 8), f"rank {rank} stage {stage}: {engine.get_lr()}"
    return scales


class WithUnused(nn.Module):
    """`unused` never gets a gradient: its bucket slots must read as zero."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused = make_mlp(), nn.Linear(100, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def check_unused_params(rank: int, world_size: int, stage: int, accumulation: int) -> None:
    torch.manual_seed(0)
    model = WithUnused()
    before = [p.detach().clone() for p in model.unused.parameters()]
    cfg = config(stage, "bf16")
    cfg["optimizer"]["params"]["weight_decay"] = 0.0  # Adam on a zero gradient then leaves it unchanged
    cfg["gradient_accumulation_steps"] = accumulation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=model, config=cfg)
    for step in range(2 * accumulation):
        train_step(engine, rank, step)
    after = engine.full_params_fp32()[-2:]  # unused.weight, unused.bias: registered last
    for b, a in zip(before, after):
        assert torch.equal(b.to(torch.bfloat16).float(), a), f"rank {rank} stage {stage}: unused parameter moved"
    assert all(torch.isfinite(p).all() for p in engine.full_params_fp32()), f"rank {rank} stage {stage}"


def accounting_worker(rank: int, world_size: int) -> list[list[float]]:
    for stage in (0, 1, 2, 3):
        for accumulation in (1, 2):
            check_unused_params(rank, world_size, stage, accumulation)
        for dtype_name in ("fp16", "bf16"):
            check_memory_and_wire(rank, world_size, stage, dtype_name, "ringcomm")
        check_memory_and_wire(rank, world_size, stage, "bf16", "torch")
        if stage == 3:
            check_memory_and_wire(rank, world_size, stage, "bf16", "ringcomm", reuse=None)
    return [check_forced_overflow(rank, world_size, stage) for stage in (0, 1, 2, 3)] + \
        [check_forced_overflow(rank, world_size, 2, static=True)]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_memory_wire_and_loss_scale(world_size: int) -> None:
    results = run_ranks(accounting_worker, world_size, timeout=180)
    assert all(r == results[0] for r in results), f"ranks disagree on the loss scale: {results}"


def check_buckets_freed_during_backward(rank: int, world_size: int) -> None:
    """Stages 2-3: a bucket whose reduce-scatter finished is folded into its
    accumulator and freed while backward goes on, so the transient peak is a
    bucket or two, not the whole gradient. At world size 1 every collective is
    done when launched, which makes the peak exact."""
    for stage in (2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(6)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, *_ = zero.initialize(model=model, config=config(stage, "fp32"))
        x = torch.randn(4, 100)
        engine.backward(engine(x).square().mean())
        engine.step()
        sizes = [b.grads.nbytes for b in engine.parts.group.buckets]
        peak = engine.parts.group.scheduler.peak_transient_nbytes
        assert len(sizes) >= 4 and peak <= 2 * max(sizes) < sum(sizes), f"stage {stage}: peak {peak} B, {sizes}"


def test_buckets_freed_during_backward() -> None:
    run_ranks(check_buckets_freed_during_backward, 1)


# ---- the wire report against the bytes the transports move ([Note: wire model]) ----
HOSTS = {"torch_dist": ("a", "b"), "hierarchical": ("a", "a", "b", "b")}


def count_at_the_transports(moved: dict[str, int]) -> None:
    """Adds to `moved` the bytes this rank's transports send: a torch_dist ring's
    every pg.send (the cross-host level; the test's hosts put each ring
    neighbour on another host), and an shm call's staging ring volume in the
    dtype it is handed (the host level). Floating-point tensors only: the int64
    records of the hierarchical agreement step ([Note: call agreement]) are the
    transport's check of the call, which the wire model leaves out."""
    from ringcomm.plan.schedule import sent_numel
    from ringcomm.transport import shm
    from ringcomm.transport.link import P2PLink

    def counting_start(link, send, recv, *, op, step):
        moved["across"] += send.numel() * send.element_size() if send is not None and send.is_floating_point() else 0
        return start(link, send, recv, op=op, step=step)

    def counting_exchange(link, send, to, recv, source, *, op, step):
        moved["across"] += send.numel() * send.element_size() if send.is_floating_point() else 0
        return exchange(link, send, to, recv, source, op=op, step=step)

    def counting(kind, method, whole):
        def call(transport, *, output, input, **kwargs):
            tensor = whole(output, input)
            if tensor.is_floating_point():
                moved["inside"] += sent_numel(kind, tensor.numel(), transport.world_size) * tensor.element_size()
            return method(transport, output=output, input=input, **kwargs)
        return call

    start, exchange = P2PLink.start, P2PLink.exchange
    P2PLink.start, P2PLink.exchange = counting_start, counting_exchange
    for kind, whole in (("all_reduce", lambda o, i: i), ("reduce_scatter", lambda o, i: i),
                        ("all_gather", lambda o, i: o)):
        setattr(shm.ShmTransport, kind, counting(kind, getattr(shm.ShmTransport, kind), whole))


def wire_worker(rank: int, world_size: int, transport: str, tmp: str) -> list[str]:
    """Stages 0, 2 and 3 in fp32 and bf16, two steps, a checkpoint, a step: each
    step's wire report against what the transports moved in it."""
    os.environ.update(RINGCOMM_TRANSPORT=transport, RINGCOMM_HOST=HOSTS[transport][rank])
    moved = {"inside": 0, "across": 0}
    count_at_the_transports(moved)
    wrong = []
    for stage in (0, 2, 3):
        for dtype_name in ("fp32", "bf16"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine, *_ = zero.initialize(model=make_mlp(), config=config(stage, dtype_name))
            assert engine.parts.comm.group.transport.kind == transport, engine.parts.comm.group.transport
            for step in range(3):
                if step == 2:
                    engine.save_checkpoint(os.path.join(tmp, f"{stage}{dtype_name}"))
                moved.update(inside=0, across=0)
                train_step(engine, rank, step)
                report = engine.wire_report()
                # The gradient norm's all_reduce of one float64 is split unevenly by
                # the ring (0 or 8 bytes a phase on a rank), not as the model's N-th.
                if not (abs(report.inside_host_nbytes - moved["inside"]) <= 16
                        and abs(report.across_host_nbytes - moved["across"]) <= 16
                        and report.sent_nbytes == report.inside_host_nbytes + report.across_host_nbytes):
                    wrong.append(f"rank {rank} {transport} stage {stage} {dtype_name} step {step}: reported "
                                 f"{report}, the transports moved {moved}")
            engine.destroy()
    return wrong


@pytest.mark.parametrize("transport", ["torch_dist", "hierarchical"])
def test_the_wire_report_counts_what_the_transports_move(transport: str, tmp_path) -> None:
    results = run_ranks(wire_worker, len(HOSTS[transport]), transport, str(tmp_path), timeout=300)
    wrong = [line for lines in results for line in lines]
    assert not wrong, "\n".join(wrong)
