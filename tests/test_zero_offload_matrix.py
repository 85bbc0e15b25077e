"""Every engine feature under every offload: at stages 1-3 with offload_optimizer
and offload_param none / cpu / nvme, a model built under zero.Init trains,
gathers (GatheredParameters with and without modifier_rank), saves a checkpoint
and resumes from it, converts it (zero.to_fp32), saves the 16-bit model and
reports its memory, each checked against the run without offload (built without
Init) of the same stage, and destroy() releases the swap files and I/O threads.

Invalid: offload_param (cpu or nvme) below stage 3, as in DeepSpeed: parameters
are sharded, hence offloadable, only at stage 3. Those combinations are refused
at initialize with a ValueError naming the key (checked here too).

Same numbers means bit-for-bit: on a CPU machine offload changes where the
masters and states live, not the math (every step is host_step's fused Adam on
the same fp32 values in the same order), so no tolerance is needed.
"""
from __future__ import annotations

import os
import tempfile
import threading

import pytest
import torch

from harness import run_ranks
from test_zero_offload import new_engine, run_steps

import zero
from zero.checkpoint import to_fp32

DEVICES = ("none", "cpu", "nvme")
MODIFIED = "head.bias"  # the parameter rank 0 sets through GatheredParameters(modifier_rank=0)
MODIFIED_VALUE = 0.25


def combinations() -> tuple[list[tuple[int, str, str]], list[tuple[int, str, str]]]:
    """(stage, offload_optimizer, offload_param): the valid ones and the refused ones."""
    valid, invalid = [], []
    for stage in (1, 2, 3):
        for optimizer in DEVICES:
            for param in DEVICES:
                (valid if param == "none" or stage == 3 else invalid).append((stage, optimizer, param))
    return valid, invalid


def whole_params(engine) -> list[torch.Tensor]:
    """The 16-bit parameters as GatheredParameters shows them; at stage 3 a
    change inside is dropped. Not checked: below stage 3 (the parameters are the
    module's own: the context does nothing) and persistent parameters (whole on
    every rank; a change stays local until the next step, as in DeepSpeed)."""
    params = list(engine.module.parameters())
    with zero.GatheredParameters(params):
        values = [p.detach().clone() for p in params]
        for p in params:
            if hasattr(p, "ds_bucket") and not p.ds_bucket[1].span.resident:
                p.data.add_(1.0)
    return values


def run(rank: int, world_size: int, root: str, case: tuple[int, str, str], init: bool) -> dict:
    """Every feature on one combination; returns what is compared with the run without offload."""
    stage, optimizer, param = case
    name = f"rank {rank}/{world_size} stage {stage} offload_optimizer {optimizer} offload_param {param}"
    nvme_path = os.path.join(root, f"nvme-rank{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    save_dir, out = os.path.join(root, f"ckpt-{stage}-{optimizer}-{param}"), {"name": name}
    engine = new_engine(stage, optimizer, world_size, nvme_path, param=param, init=init)
    out["losses"] = run_steps(engine, rank, world_size, range(2))
    out["gathered"] = whole_params(engine)
    assert all(torch.equal(a, b) for a, b in zip(whole_params(engine), out["gathered"])), \
        f"{name}: a change inside GatheredParameters without modifier_rank was kept"
    index = engine.parts.param_names.index(MODIFIED)
    with zero.GatheredParameters([engine.module.head.bias], modifier_rank=0):
        if rank == 0 and stage == 3:  # below stage 3 the parameters are not partitioned: the context does nothing
            engine.module.head.bias.data.fill_(MODIFIED_VALUE)
    assert all(b.full is None for b in engine.parts.group.buckets if not b.span.resident), f"{name}: not resharded"
    out["masters"] = engine.full_params_fp32()
    if stage == 3:  # reached the fp32 master on every rank (an independent reference: the value set)
        assert torch.equal(out["masters"][index], torch.full_like(out["masters"][index], MODIFIED_VALUE)), \
            f"{name}: {MODIFIED} master {out['masters'][index]}"
    out["memory"] = engine.memory_report()
    engine.save_checkpoint(save_dir)
    engine.save_16bit_model(save_dir, "model16.bin")
    out["losses"] += run_steps(engine, rank, world_size, range(2, 3))
    out["continued"] = engine.full_params_fp32()
    resumed = new_engine(stage, optimizer, world_size, nvme_path, param=param, init=init)
    resumed.load_checkpoint(save_dir)
    out["resumed_losses"] = run_steps(resumed, rank, world_size, range(2, 3))
    for i, (a, b) in enumerate(zip(resumed.full_params_fp32(), out["continued"], strict=True)):
        assert torch.equal(a, b), f"{name}: parameter {i}: one step after load_checkpoint != without the reload"
    assert out["resumed_losses"] == out["losses"][2:], f"{name}: {out['resumed_losses']} != {out['losses'][2:]}"
    if rank == 0:
        # beside the save_dir (never inside its source); a combination runs twice (init or not): overwrite
        out["fp32"] = torch.load(to_fp32.convert(save_dir, save_dir + "-fp32.bin", overwrite=True))
        for i, key in enumerate(engine.parts.param_names):
            assert torch.equal(out["fp32"][key], out["masters"][i]), f"{name}: to_fp32 {key} != the saved master"
        out["bit16"] = torch.load(os.path.join(save_dir, "model16.bin"))
    for each in (engine, resumed):
        each.destroy()
    assert not os.listdir(nvme_path), f"{name}: swap files left: {os.listdir(nvme_path)}"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("zero-nvme")], \
        f"{name}: I/O threads left after destroy(): {threading.enumerate()}"
    return out


def compare(got: dict, expected: dict) -> None:
    name = got["name"]
    assert got["losses"] == expected["losses"], f"{name}: losses {got['losses']} != {expected['losses']}"
    for key in ("gathered", "masters", "continued"):
        for i, (a, b) in enumerate(zip(got[key], expected[key], strict=True)):
            assert torch.equal(a, b), f"{name}: {key}: parameter {i} differs from the run without offload"
    for key in ("fp32", "bit16"):
        if key in expected:
            assert got[key].keys() == expected[key].keys(), f"{name}: {key} keys"
            for k in expected[key]:
                assert torch.equal(got[key][k], expected[key][k]), f"{name}: {key} {k} differs"


def check_memory(case: tuple[int, str, str], got, expected, name: str) -> None:
    """Offload moves bytes between device, host and disk; the model states stay the same."""
    _, optimizer, param = case
    assert got.grads_nbytes == expected.grads_nbytes, f"{name}: {got} vs {expected}"
    # the peak of transient buckets depends on when each reduce-scatter finished (timing), not on offload
    assert (got.comm_buffer_nbytes > 0) == (expected.comm_buffer_nbytes > 0), f"{name}: {got} vs {expected}"
    if param == "nvme":  # the shards of non-resident buckets are in the swap file
        assert got.params_nbytes < expected.params_nbytes, f"{name}: {got} vs {expected}"
    else:
        assert got.params_nbytes == expected.params_nbytes, f"{name}: {got} vs {expected}"
    swapped_params = expected.params_nbytes - got.params_nbytes
    if optimizer == "nvme":  # master + both moments in the swap file (page-rounded), staging buffers on the host
        assert got.optimizer_nbytes == 0 and got.host_nbytes > 0, f"{name}: {got}"
        assert got.disk_nbytes >= expected.optimizer_nbytes + swapped_params, f"{name}: {got} vs {expected}"
    else:
        assert got.optimizer_nbytes == expected.optimizer_nbytes, f"{name}: {got} vs {expected}"
        assert got.disk_nbytes >= swapped_params and (got.disk_nbytes > 0) == (param == "nvme"), f"{name}: {got}"
    if optimizer == "cpu":  # a CPU machine: the states count as host memory, nothing is copied
        staging = got.host_nbytes - got.optimizer_nbytes  # offload_param nvme's read buffers
        assert got.optimizer_nbytes > 0 and (staging > 0 if param == "nvme" else staging == 0), f"{name}: {got}"
        assert got.device_nbytes == expected.device_nbytes - expected.optimizer_nbytes - swapped_params, f"{name}"
    if optimizer == "none":
        assert got.device_nbytes == expected.device_nbytes - swapped_params, f"{name}: {got} vs {expected}"
        assert (got.host_nbytes > 0) == (param == "nvme"), f"{name}: {got}"


def matrix_worker(rank: int, world_size: int, root: str) -> int:
    valid, invalid = combinations()
    expected = {stage: run(rank, world_size, root, (stage, "none", "none"), init=False) for stage in (1, 2, 3)}
    for case in valid:
        got = run(rank, world_size, root, case, init=True)
        compare(got, expected[case[0]])
        check_memory(case, got["memory"], expected[case[0]]["memory"], got["name"])
    for stage, optimizer, param in invalid:
        with pytest.raises(ValueError, match=rf"offload_param\.device '{param}' needs zero_optimization\.stage >= 3"):
            new_engine(stage, optimizer, world_size, root, param=param)
    return len(valid)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_offload_matrix(world_size: int) -> None:
    with tempfile.TemporaryDirectory(prefix="zero-matrix-") as root:
        assert run_ranks(matrix_worker, world_size, root, timeout=80) == [15] * world_size
