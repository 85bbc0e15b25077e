"""Profiler events ([Note: profiler events]): a Chrome trace of a DDP step on
backend "ringcomm", of ringcomm's own calls (inline and async) and of a ZeRO
stage-3 step shows one `ringcomm:<op>` event per collective, with its input
shapes and dtype; with no profiler the lean paths run as before."""
from __future__ import annotations

import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
from harness import run_ranks

import ringcomm


def trace_events(prof: torch.profiler.profile) -> list[dict]:
    """The `ringcomm:` events of an exported Chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as src:
            events = json.load(src)["traceEvents"]
    return [e for e in events if e.get("name", "").startswith("ringcomm:")]


def profiled(fn) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return trace_events(prof)


def summary(events: list[dict]) -> list[tuple[str, list, str]]:
    return [(e["name"], e["args"].get("Input Dims"), e["args"].get("dtype")) for e in events]


def ddp_worker(rank: int, world_size: int) -> dict:
    group = dist.new_group(backend="ringcomm")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))

    def step() -> None:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        ddp(torch.randn(4, 6)).sum().backward()
        dist.all_gather_into_tensor(torch.empty(2 * 3), torch.ones(3), group=group)
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * 2), group=group)
        dist.barrier(group=group)
        dist.reduce(torch.ones(2, 3), 0, group=group)  # forwarded to the internal gloo, recorded as ringcomm's
        dist.gather(torch.ones(4), [torch.empty(4) for _ in range(2)] if rank == 0 else None, 0, group=group)

    events = summary(profiled(step))
    plain = [name for name, *_ in summary(profiled(lambda: None))]
    return {"events": events, "idle": plain}


def test_ddp_step_on_the_backend_records_every_collective() -> None:
    for rank, result in enumerate(run_ranks(ddp_worker, 2, timeout=120)):
        names = [name for name, *_ in result["events"]]
        assert "ringcomm:broadcast" in names, f"rank {rank}: DDP's parameter broadcast missing from {names}"
        reduces = [e for e in result["events"] if e[0] == "ringcomm:all_reduce"]
        # DDP's one bucket: the flat gradients of 6*5+5+5*3+3 = 53 parameters, fp32
        assert reduces == [("ringcomm:all_reduce", [[53]], "float32")], f"rank {rank}: {result['events']}"
        assert ("ringcomm:all_gather_into_tensor", [[3]], "float32") in result["events"], f"rank {rank}"
        assert ("ringcomm:reduce_scatter_tensor", [[4]], "float32") in result["events"], f"rank {rank}"
        assert "ringcomm:barrier" in names, f"rank {rank}: {names}"
        assert ("ringcomm:reduce", [[2, 3]], "float32") in result["events"], f"rank {rank}: {result['events']}"
        assert ("ringcomm:gather", [[4]], "float32") in result["events"], f"rank {rank}: {result['events']}"
        assert result["idle"] == [], f"rank {rank}: events without calls: {result['idle']}"


def api_worker(rank: int, world_size: int) -> list:
    group = ringcomm.new_group()

    def calls() -> None:
        ringcomm.all_reduce(torch.ones(7), group=group)  # the lean path steps aside
        ringcomm.reduce_scatter(torch.empty(3, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16),
                                group=group)
        ringcomm.all_gather(torch.empty(10), torch.ones(5), group=group)
        ringcomm.broadcast(torch.ones(2, 2), 0, group=group)
        ringcomm.all_reduce(torch.ones(11), group=group, async_op=True).wait()  # ends on the comm thread

    events = profiled(calls)
    threads = {e["name"] + str(e["args"].get("Input Dims")): e["tid"] for e in events}
    group.close()
    return [summary(events), threads]


def test_public_api_records_inline_and_async_calls() -> None:
    for rank, (events, _threads) in enumerate(run_ranks(api_worker, 2, timeout=120)):
        assert events == [("ringcomm:all_reduce", [[7]], "float32"),
                          ("ringcomm:reduce_scatter", [[6]], "bfloat16"),
                          ("ringcomm:all_gather", [[5]], "float32"),
                          ("ringcomm:broadcast", [[2, 2]], "float32"),
                          ("ringcomm:all_reduce", [[11]], "float32")], f"rank {rank}: {events}"


def zero_worker(rank: int, world_size: int) -> list:
    from test_zero_reshard import KIND, train
    from zero_reference import engine_config, make_model

    import zero

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero.initialize(model=make_model(KIND), config=engine_config(3, "fp32", 1, world_size))
    return summary(profiled(lambda: train(engine, rank, world_size, range(1))))


def test_zero_stage3_step_records_gathers_and_reductions() -> None:
    for rank, events in enumerate(run_ranks(zero_worker, 2, timeout=120)):
        names = {name for name, *_ in events}
        assert {"ringcomm:all_gather", "ringcomm:reduce_scatter"} <= names, f"rank {rank}: {events}"
        assert all(dims and all(dims) and dtype for _, dims, dtype in events), f"rank {rank}: sizes missing: {events}"
