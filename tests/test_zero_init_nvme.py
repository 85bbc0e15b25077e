"""zero.Init(remote_device="nvme"): each rank's shards live in files under the
config's offload_param.nvme_path (mapped, unlinked at once), not in the
process's memory; a model built so trains exactly as one built in memory, and
building it takes a fraction of the anonymous memory its partition would."""
from __future__ import annotations

import ctypes
import os
import tempfile
import warnings

import pytest
import torch
from torch import nn

from harness import run_ranks
from test_zero_offload import offload_sections, run_steps
from zero_reference import engine_config, make_model

import zero
from zero.sharding.init import gather


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def deleted_mappings(folder: str) -> int:
    """Mappings of this process of files once in `folder`, unlinked since."""
    with open("/proc/self/maps") as f:
        return sum(folder in line and line.rstrip().endswith("(deleted)") for line in f)


def build(config: dict, remote_device: str | None, make) -> nn.Module:
    """remote_device=None builds in memory: the config's offload_param.device would win, as in DeepSpeed."""
    if remote_device is None:
        config = {**config, "zero_optimization": {k: v for k, v in config["zero_optimization"].items()
                                                  if k != "offload_param"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zero.Init(config_dict_or_path=config, remote_device=remote_device):
            return make()


def init_nvme_worker(rank: int, world_size: int, root: str) -> None:
    nvme = os.path.join(root, f"nvme{rank}")
    config = engine_config(3, "bf16", 1, world_size, **offload_sections("nvme", 3, nvme))
    shard_folder = os.path.join(nvme, "zero_init")

    # Where the shards are: files under nvme_path, unlinked, the folder gone.
    on_disk = build(config, "nvme", lambda: make_model("transformer"))
    in_memory = build(config, None, lambda: make_model("transformer"))
    params = [p for p in on_disk.parameters() if p.ds_tensor.numel() > 0]
    assert deleted_mappings(shard_folder) == len(params), \
        f"rank {rank}: {deleted_mappings(shard_folder)} mapped shard files for {len(params)} parameters"
    assert not os.path.exists(shard_folder), f"rank {rank}: left in {shard_folder}: {os.listdir(shard_folder)}"
    with warnings.catch_warnings():  # no remote_device: the config's offload_param.device places the shards
        warnings.simplefilter("ignore")
        with zero.Init(config_dict_or_path=config):
            by_config = make_model("transformer")
    assert deleted_mappings(shard_folder) == 2 * len(params), f"rank {rank}: the config's device was not taken"
    del by_config
    for (name, mine), theirs in zip(on_disk.named_parameters(), in_memory.parameters()):
        assert mine.ds_tensor.dtype == torch.bfloat16 and torch.equal(mine.ds_tensor, theirs.ds_tensor), name
        assert torch.equal(gather(mine), gather(theirs)), f"rank {rank}: {name} gathers differently"

    # It trains as the model built in memory, bit for bit.
    results = []
    for model in (on_disk, in_memory):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, *_ = zero.initialize(model=model, config=config)
        results.append((run_steps(engine, rank, world_size, range(3)), engine.full_params_fp32()))
        engine.destroy()
    (losses, params_nvme), (losses_ref, params_ref) = results
    assert losses == losses_ref, f"rank {rank}: losses {losses} != {losses_ref}"
    assert all(torch.equal(a, b) for a, b in zip(params_nvme, params_ref)), f"rank {rank}: parameters differ"
    assert deleted_mappings(shard_folder) == 0, f"rank {rank}: shard files still mapped after the engine took them"

    # Building a 134 MB model (fp32): its 67 MB partition stays out of anonymous memory.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks go back at once
    fp32 = engine_config(3, "fp32", 1, world_size, **offload_sections("nvme", 3, nvme))
    partition_kib = 8 * 2048 * 2048 * 4 // world_size // 1024
    grown = {}
    for remote_device in ("nvme", None):
        before = status_kib("RssAnon")
        model = build(fp32, remote_device, lambda: nn.Sequential(*[nn.Linear(2048, 2048, bias=False)
                                                                     for _ in range(8)]))
        grown[remote_device] = status_kib("RssAnon") - before
        del model
    assert grown[None] > 0.9 * partition_kib, f"rank {rank}: in memory, the partition grew anon memory by " \
                                              f"{grown[None]} KiB of {partition_kib}: the measure is blind"
    assert grown["nvme"] < 0.25 * partition_kib, \
        f"rank {rank}: remote_device='nvme' grew anon memory by {grown['nvme']} KiB (partition {partition_kib} KiB)"


@pytest.mark.timeout(180)
def test_init_on_nvme() -> None:
    with tempfile.TemporaryDirectory(prefix="zero-init-nvme-") as root:
        run_ranks(init_nvme_worker, 2, root, timeout=160)


def test_init_on_nvme_needs_a_path() -> None:
    with pytest.raises(ValueError, match="offload_param.nvme_path"):
        zero.Init(config_dict_or_path=engine_config(3, "bf16", 1, 1), remote_device="nvme")
    with pytest.raises(ValueError, match="remote_device 'gpu'"):
        zero.Init(remote_device="gpu")
