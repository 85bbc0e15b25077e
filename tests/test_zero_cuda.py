"""The ZeRO engine on CUDA: stages 0-3 (fp32, bf16) train like the CPU reference
of zero_reference.py with the model on a GPU, and what the engine keeps and
makes in a step (parameters, gradients, buckets, fp32 masters, optimizer
states) stays on the model's device. Skipped without CUDA devices.

At world size 1 zero/sharding/seam.py runs no collective whatever comm_backend says,
so the one-GPU test checks placement and arithmetic; the two-GPU test runs
the engine's collectives through NCCL ("torch") and through ringcomm."""
from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness import run_ranks
from test_zero_parity import compare_with_reference
from zero_reference import CLIP, DTYPES, MICRO, STEPS, engine_config, loss_fn, make_batch, make_model, reference_train

import zero

KINDS = ("mlp", "transformer")
STAGES = (0, 1, 2, 3)
CUDA_DTYPES = ("fp32", "bf16")
ACCUMULATIONS = (1, 3)
# the default process group each comm backend runs on: the engine's "torch"
# collectives need NCCL for CUDA tensors; "ringcomm" runs on ringcomm's own
# torch.distributed backend, which forwards CUDA tensors to NCCL
PROCESS_GROUP = {"torch": "nccl", "ringcomm": "ringcomm"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA devices (the engine runs collectives at world size > 1 only)")


class OffDevice(TorchDispatchMode):
    """Records every op that returns a tensor of more than one element off
    `device`: on a CUDA model, a parameter, gradient, bucket or optimizer state
    on the host. One-element tensors (a norm, a loss scale, AdamW's step count)
    may live anywhere."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device != self.device and tensor.numel() > 1:
                self.ops.append(f"{func}: {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")
        return out


def use_process_group(backend: str, rank: int, world_size: int, init_file: str) -> None:
    """Replaces the harness's gloo group by one on `backend`."""
    dist.destroy_process_group()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))


def check_on_device(engine: zero.ZeroEngine, device: torch.device, case: str) -> None:
    """Parameters, their gradients, the optimizer's parameters (fp32 masters)
    and its states are on `device`."""
    tensors = {f"parameter {name}": p for name, p in engine.named_parameters()}
    tensors.update({f"gradient of {name}": p.grad for name, p in engine.named_parameters() if p.grad is not None})
    for g, group in enumerate(engine.optimizer.param_groups):
        tensors.update({f"optimizer param_groups[{g}] parameter {i}": p for i, p in enumerate(group["params"])})
    for i, state in enumerate(engine.optimizer.state.values()):
        tensors.update({f"optimizer state {i} {key}": t for key, t in state.items()
                        if isinstance(t, torch.Tensor) and t.numel() > 1})
    wrong = [f"{what} on {t.device}" for what, t in tensors.items() if t.device != device]
    assert not wrong, f"{case}: not on {device}: {wrong[:5]}{' ...' if len(wrong) > 5 else ''}"


def train_on_device(rank: int, world_size: int, device: torch.device, kind: str, stage: int, dtype_name: str,
                    accumulation: int, backend: str, case: str) -> tuple[list[float], list[torch.Tensor]]:
    """The parity test's training loop with the model and batches on `device`;
    returns the mean losses and the fp32 masters (on the CPU)."""
    config = engine_config(stage, dtype_name, accumulation, world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = zero.initialize(model=make_model(kind).to(device), comm_backend=backend, config=config)
    check_on_device(engine, device, f"{case}, after initialize")
    losses, norms, off_device = [], [], OffDevice(device)
    for step in range(STEPS):
        x, y = (t.to(device) for t in make_batch(kind, MICRO * accumulation * world_size, step))
        total = torch.zeros((), device=device)
        for k in range(accumulation):
            lo = (k * world_size + rank) * MICRO
            with off_device:
                loss = loss_fn(kind, engine(x[lo:lo + MICRO]), y[lo:lo + MICRO])
                engine.backward(loss)
                engine.step()
            total += loss.detach().float()
        norms.append(engine.get_global_grad_norm())
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(float(total) / (accumulation * world_size))
    assert not off_device.ops, f"{case}: a training step made tensors off {device}: {off_device.ops[:5]}"
    check_on_device(engine, device, f"{case}, after training")
    assert engine.global_steps == STEPS and engine.skipped_steps == 0, f"{case}: {engine.skipped_steps=}"
    assert max(norms) > CLIP, f"{case}: clipping never acted, norms {norms}"
    return losses, [p.cpu() for p in engine.full_params_fp32()]


def cuda_parity_worker(rank: int, world_size: int, backend: str, init_file: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    use_process_group(PROCESS_GROUP[backend], rank, world_size, init_file)
    references: dict = {}
    for kind in KINDS:
        for dtype_name in CUDA_DTYPES:
            for accumulation in ACCUMULATIONS:
                key = (kind, dtype_name, MICRO * accumulation * world_size)
                if key not in references:  # on the CPU
                    references[key] = reference_train(kind, DTYPES[dtype_name], key[2])
                for stage in STAGES:
                    case = f"rank {rank}/{world_size} {device} {kind} stage {stage} {dtype_name} " \
                           f"accumulation {accumulation} {backend}"
                    losses, params = train_on_device(rank, world_size, device, kind, stage, dtype_name,
                                                     accumulation, backend, case)
                    compare_with_reference(case, kind, dtype_name, losses, params, references[key])


@needs_cuda
@pytest.mark.parametrize("backend", sorted(PROCESS_GROUP))
def test_cuda_parity_one_gpu(backend: str, tmp_path) -> None:
    run_ranks(cuda_parity_worker, 1, backend, str(tmp_path / "rendezvous"), timeout=120)


@needs_two_gpus
@pytest.mark.parametrize("backend", sorted(PROCESS_GROUP))
def test_cuda_parity_two_gpus(backend: str, tmp_path) -> None:
    run_ranks(cuda_parity_worker, 2, backend, str(tmp_path / "rendezvous"), timeout=120)
