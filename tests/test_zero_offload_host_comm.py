"""Offload's collectives on host tensors ([Note: host tensors] in
zero/sharding/seam.py), on CPU ranks: the engine's default comm is a stand-in
that refuses host tensors as NCCL does, with a gloo comm beside it. On a CPU
model every tensor is a host tensor, so every collective of the run (set-up,
gradient reduction, the norm, publishing, full_masters) must go through the
gloo one; tests/test_zero_offload_cuda.py checks the split on two GPUs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from test_zero_offload_copies import late_engine, train_step
from test_zero_parity import compare_with_reference
from zero_reference import DTYPES, MICRO, STEPS, reference_train

from zero.runtime import build
from zero.sharding.seam import TorchComm, needs_host_comm


def refuse(op: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "cpu":  # torch's error for a group without a CPU backend (NCCL)
        raise RuntimeError(f"{op}: No backend type associated with device type cpu")


class RefusesHostTensors(TorchComm):
    """The default group as NCCL is: a collective on a host tensor raises."""

    def _all_reduce(self, tensor, async_op):
        refuse("all_reduce", tensor)
        return super()._all_reduce(tensor, async_op)

    def _reduce_scatter(self, output, input, async_op):
        refuse("reduce_scatter", input)
        return super()._reduce_scatter(output, input, async_op)

    def _all_gather(self, output, input, async_op):
        refuse("all_gather", input)
        return super()._all_gather(output, input, async_op)

    def _broadcast(self, tensor, src):
        refuse("broadcast", tensor)
        super()._broadcast(tensor, src)


def routing_worker(rank: int, world_size: int, cases: list[tuple[str, int, str]]) -> None:
    def make_comm(backend: str, device: torch.device, **keys) -> TorchComm:
        comm = RefusesHostTensors(rank, world_size)
        comm.host = TorchComm(rank, world_size, dist.new_group(backend="gloo"))
        return comm

    build.make_comm = make_comm  # this process's engines only
    for kind, stage, dtype_name in cases:
        case = f"rank {rank}/{world_size} {kind} stage {stage} {dtype_name} offload cpu, default comm refuses host tensors"
        engine = late_engine(kind, stage, dtype_name, world_size)
        losses = [train_step(engine, kind, rank, world_size, step) for step in range(STEPS)]
        reference = reference_train(kind, DTYPES[dtype_name], MICRO * world_size)
        compare_with_reference(case, kind, dtype_name, losses, engine.full_params_fp32(), reference)
        engine.destroy()


@pytest.mark.parametrize("world_size", [2])
def test_host_tensors_take_the_host_comm(world_size: int) -> None:
    cases = [("mlp", 1, "fp32"), ("transformer", 3, "bf16")]
    run_ranks(routing_worker, world_size, cases, timeout=120)


CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("device, carried, host_tensors, expected", [
    (CUDA, [CUDA], True, True),  # NCCL: offload needs the gloo group
    (CUDA, [CUDA, CPU], True, False),  # gloo, ringcomm, "cpu:gloo,cuda:nccl" carry host tensors
    (CUDA, [CUDA], False, False),  # no offload: no host tensor is collected
    (CPU, [CPU], True, False),  # a host model: its comm carries host tensors
])
def test_needs_host_comm(device, carried, host_tensors: bool, expected: bool) -> None:
    assert needs_host_comm(device, carried, host_tensors=host_tensors) is expected, (device, carried, host_tensors)
