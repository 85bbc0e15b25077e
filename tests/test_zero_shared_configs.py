"""The users' DeepSpeed configs (../shared/configs) load unchanged and train,
on 2 ranks and in a single process that never called init_process_group."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import torch

from harness import run_ranks
from zero_reference import TinyTransformer, loss_fn, make_batch

import zero

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "configs")  # the users' files, next to the checkout
CONFIG_DIR = SHARED if os.path.isdir(SHARED) else os.path.join(ROOT, "tests", "data")  # byte-identical copies
CONFIGS = [os.path.join(CONFIG_DIR, name) for name in ("ds_zero2_config.json", "ds_zero3_config.json")]


def train_with(path: str, rank: int, world_size: int, backend: str | None = None) -> list[float]:
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, _, _ = zero.initialize(model=model, optimizer=optimizer, config=path,
                                                  args={"per_device_train_batch_size": 2, "fp16": True}, comm_backend=backend)
    notes = " ".join(str(w.message) for w in caught)
    assert "offload" not in notes, f"rank {rank}: start-up notes {notes!r}"
    report = engine.memory_report()  # offload_optimizer cpu honoured: the states are on host
    assert report.host_nbytes > 0 and report.host_nbytes >= report.optimizer_nbytes, f"rank {rank}: {report}"
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.gradient_accumulation_steps() == 1
    assert engine.parts.dtype == torch.float16, "fp16 'auto'/true: the model runs in fp16"
    losses = []
    for step in range(3):
        x, y = make_batch("transformer", 2 * world_size, step)
        loss = loss_fn("transformer", engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert engine.global_steps == 3 and all(math.isfinite(v) for v in losses), f"rank {rank}: {losses}"
    return losses


def shared_configs_worker(rank: int, world_size: int) -> None:
    for path in CONFIGS:
        for backend in ("ringcomm", "torch"):
            train_with(path, rank, world_size, backend)


def test_shared_configs_train_on_two_ranks() -> None:
    run_ranks(shared_configs_worker, 2, timeout=120)


def test_single_process_without_init_process_group() -> None:
    code = ("import sys; sys.path[:0] = [{root!r}, {tests!r}]\n"
            "import torch.distributed as dist, test_zero_shared_configs as t\n"
            "assert not dist.is_initialized()\n"
            "print(t.train_with({path!r}, 0, 1))\n").format(root=ROOT, tests=os.path.join(ROOT, "tests"),
                                                            path=CONFIGS[1])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
