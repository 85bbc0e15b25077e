"""torch.compile on the "ringcomm" backend: compiled DDP (dynamo's DDPOptimizer
splits the graph at the buckets), FSDP2 fully_shard + torch.compile, and the
functional collectives (torch.distributed._functional_collectives all_reduce,
all_gather_single and reduce_scatter_single, torch 2.13's names of the deprecated
all_gather_tensor and reduce_scatter_tensor) eager and inside a compiled function.
Each is checked against the same thing on gloo, and against eager where the
compiled code is the only difference. Compiled DDP calls the backend from C++
inside the compiled region (its bucket rebuild), which dynamo must not trace
([Note: ringcomm under dynamo] in ringcomm/backend/dynamo.py). One spawn of 2 ranks runs
every case: about 9 s with inductor's cache warm, 21 s cold, on 2 cores (slow tier).
A fast test checks that dynamo, loaded after ringcomm, skips it."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import run_ranks
from test_backend_models import count_transport_calls, reinit

NUM_STEPS = 3
LR = 1e-3


def small_model(width: int) -> nn.Module:
    """Width 384: 1.2 MB of parameters, 2 of DDP's 1 MiB buckets."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 4))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One random batch per rank, the same at every step, so that the loss falls."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def train(model: nn.Module, params: list[nn.Parameter], rank: int) -> list[float]:
    optimizer = torch.optim.Adam(params, lr=LR)
    losses = []
    inputs, targets = batch(rank)
    for _ in range(NUM_STEPS):
        loss = ((model(inputs) - targets) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_ddp(base: nn.Module, pg: dist.ProcessGroup, rank: int, compiled: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    # DDPOptimizer wants every bucket at least as large as DDP's first (1 MiB): with
    # 1 MiB buckets, the 1.2 MB model of width 384 makes 2 buckets, 2 compiled subgraphs.
    ddp = DistributedDataParallel(copy.deepcopy(base), process_group=pg, bucket_cap_mb=1)
    model = torch.compile(ddp) if compiled else ddp
    losses = train(model, list(ddp.parameters()), rank)
    return {"losses": losses, "params": [p.detach().clone() for p in ddp.parameters()]}


def blocks_model() -> nn.Module:
    """Two blocks and a head, as FSDP2 and compile are applied per transformer block."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()),
                         nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()), nn.Linear(32, 4))


def run_fsdp2(base: nn.Module, pg: dist.ProcessGroup, rank: int, compiled: bool) -> dict:
    """fully_shard per block and at the root; compiled: each block compiled first
    (torchtitan's order), so FSDP2's hooks run eagerly around compiled blocks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    mesh = DeviceMesh.from_group(pg, "cpu")
    for index in range(len(model) - 1):
        if compiled:
            model[index] = torch.compile(model[index])
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = train(model, list(model.parameters()), rank)
    return {"losses": losses, "params": [p.full_tensor().detach().clone() for p in model.parameters()]}


def functional(x: torch.Tensor, pg: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three functional collectives on `x`, and some arithmetic between them
    (so that a compiled graph has something to fuse around them)."""
    import torch.distributed._functional_collectives as funcol

    summed = funcol.all_reduce(x * 2, "sum", pg)
    gathered = funcol.all_gather_single(x + 1, 0, pg)
    scattered = funcol.reduce_scatter_single(gathered * 3, "sum", 0, pg)
    return summed - 1, gathered, scattered


def functional_cases(rank: int, world_size: int, gloo: dist.ProcessGroup, ours: dist.ProcessGroup) -> None:
    """Closed form, then random data against gloo, eager and compiled, at awkward sizes."""
    ones = torch.full((5,), float(rank + 1))
    summed, gathered, scattered = functional(ones, ours)
    n = world_size * (world_size + 1) / 2
    assert torch.equal(summed, torch.full((5,), 2 * n - 1)), f"rank {rank}: closed form all_reduce {summed}"
    assert gathered.tolist() == [r + 2.0 for r in range(world_size) for _ in range(5)], f"rank {rank}: {gathered}"
    # every rank gathered the same vector; chunk `rank` of it, times 3, summed over the ranks
    assert torch.equal(scattered, torch.full((5,), 3.0 * world_size * (rank + 2))), f"rank {rank}: {scattered}"
    compiled = torch.compile(functional, fullgraph=True)
    for rows in (1, 7):  # 7 rows: not a multiple of world_size in the all_reduce
        gen = torch.Generator().manual_seed(rows * 10 + rank)
        x = torch.randn(rows * world_size, 3, generator=gen)
        want = functional(x, gloo)
        for name, got in (("eager", functional(x, ours)), ("compiled", compiled(x, ours))):
            for what, g, w in zip(("all_reduce", "all_gather_single", "reduce_scatter_single"), got, want):
                # 2 ranks: a + b in either order is the same float, so equal to the bit;
                # the compiled arithmetic around the collectives may fuse: 1 ulp.
                torch.testing.assert_close(g, w, rtol=0 if name == "eager" else 1.2e-7, atol=0 if name == "eager" else 1e-6,
                                           msg=lambda m, c=f"{name} {what} rows={rows}": f"rank {rank}: {c}: {m}")


def compile_worker(rank: int, world_size: int, init_method: str) -> dict:
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no compile worker pool: the ranks share 2 cores
    reinit(rank, world_size, init_method, "ringcomm")
    gloo, ours = dist.new_group(backend="gloo"), dist.group.WORLD
    functional_cases(rank, world_size, gloo, ours)
    diffs = {}
    for name, run, base in (("ddp", run_ddp, small_model(384)), ("fsdp2", run_fsdp2, blocks_model())):
        eager_gloo = run(base, gloo, rank, compiled=False)
        torch._dynamo.reset()  # dynamo reuses graphs across modules of one structure: start afresh
        graphs = compiled_graphs()
        compiled_gloo = run(base, gloo, rank, compiled=True)  # the ringcomm run may reuse its graphs
        calls = count_transport_calls()
        compiled_ours = run(base, ours, rank, compiled=True)
        assert sum(calls.values()) >= NUM_STEPS, f"rank {rank}: compiled {name} made only {dict(calls)} ringcomm calls"
        assert compiled_graphs() > graphs, f"rank {rank}: torch.compile made no graph for {name}"
        assert eager_gloo["losses"][-1] < eager_gloo["losses"][0], f"rank {rank}: {name}: {eager_gloo['losses']}"
        diffs[name] = {
            "vs compiled gloo": max_diff(compiled_ours, compiled_gloo),
            "vs eager gloo": max_diff(compiled_ours, eager_gloo),
        }
    return diffs


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def max_diff(got: dict, want: dict) -> float:
    return max([abs(g - w) for g, w in zip(got["losses"], want["losses"])]
               + [(g - w).abs().max().item() for g, w in zip(got["params"], want["params"])])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compile_on_ringcomm(tmp_path) -> None:
    diffs = run_ranks(compile_worker, 2, f"file://{tmp_path}/rdv", timeout=380)
    for rank, rank_diffs in enumerate(diffs):
        for name, diff in rank_diffs.items():
            # Against compiled gloo: the same compiled code, and with 2 ranks the same
            # sums (a + b), so equal to the bit. Against eager gloo: 0 measured here;
            # inductor may fuse the elementwise ops into another rounding elsewhere,
            # an ulp per step that 3 Adam steps (lr 1e-3) keep below 1e-6.
            assert diff["vs compiled gloo"] == 0.0, f"rank {rank}: compiled {name}: {diff}"
            assert diff["vs eager gloo"] <= 1e-6, f"rank {rank}: compiled {name}: {diff}"


SKIP_CHECK = """
import sys, ringcomm, ringcomm.backend.process_group
assert "torch._dynamo" not in sys.modules, "import ringcomm loaded dynamo (seconds)"
import torch._dynamo.trace_rules as rules
result = rules.check_file(ringcomm.backend.process_group.__file__)
assert result.skipped, result
print("skipped:", result.reason)
"""


@pytest.mark.timeout(120)
def test_dynamo_skips_ringcomm_when_it_loads_later() -> None:
    """[Note: ringcomm under dynamo]: ringcomm does not import dynamo, and dynamo,
    loaded later, skips ringcomm's files."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SKIP_CHECK], env={**os.environ, "PYTHONPATH": repo},
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and "skipped:" in proc.stdout, f"{proc.stdout}\n{proc.stderr[-3000:]}"
