"""What each rank of a simulated cluster runs (benchmarks/cluster.py launches it
under torchrun): `check` sweeps the collectives, the backend, the shared-memory
hygiene and training across hosts; `fail` and `flap` live through a network
failure. Each rank ends by printing one line `RESULT <json>`."""
from __future__ import annotations

import copy
import json
import os
import socket
import sys
import time
import warnings
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_collectives import DTYPES, SMALL_CMA, SMALL_TORCH_DIST, check_moves  # noqa: E402
from test_hierarchical import check_reductions, check_windows  # noqa: E402

import ringcomm  # noqa: E402
from ringcomm import ReduceOp  # noqa: E402

BACKEND_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
BACKEND_OPS = ("sum", "avg", "max", "min", "product")
BACKEND_NUMELS = (0, 1, 7, 1031)
# Against gloo in float64: ringcomm sums in float32 (16-bit floats widened,
# rounded once), in another order than the reference: a few ulps.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -7, 1e-3), torch.float16: (2 ** -10, 1e-3)}


def report(**result) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def mapped_shm_names() -> list[str]:
    """The /dev/shm segments this process maps (unlinked ones too)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split()[5] for line in f if len(line.split()) > 5 and "/dev/shm/ringcomm-" in line})


def check_collectives(rank: int, world_size: int, kind: str, description: str) -> dict:
    """ringcomm.* on the auto group vs gloo, every dtype and op, hierarchical
    calls in pieces of a few elements (pipelined; test_hierarchical.py covers
    whole calls); what its transport says."""
    from ringcomm.algorithms import pipeline

    pipeline.PIECE_NBYTES = 1024
    group = ringcomm.new_group(timeout=60, shm=SMALL_CMA, torch_dist=SMALL_TORCH_DIST)
    transport = group.transport
    assert transport.kind == kind, f"rank {rank} on {socket.gethostname()}: auto chose {group!r}, expected {kind}"
    assert description in transport.describe(), f"rank {rank}: {transport.describe()!r} lacks {description!r}"
    case = 0
    for dtype in DTYPES:
        for op in ReduceOp:
            case = check_reductions(group, rank, world_size, dtype, op, case)
        case = check_moves(group, rank, world_size, dtype, case, (0, 1, 7, 250), kind)
    check_windows(group, rank, world_size, case)
    local = getattr(transport, "local", None)
    shm = dict(host=socket.gethostname(), mapped=mapped_shm_names(), dev_shm=sorted(os.listdir("/dev/shm")),
               local_world_size=local.world_size if local else 0, local=local.describe() if local else "",
               describe=transport.describe())
    ringcomm.barrier(group=group)
    group.close()
    return shm


def gloo_reference(call: str, op: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """The call on the default (gloo) group, exact: float64/int64, AVG as SUM / n."""
    wide = input.to(torch.float64 if input.is_floating_point() else torch.int64, copy=True)
    redop = getattr(dist.ReduceOp, {"avg": "SUM", "product": "PRODUCT"}.get(op, op.upper()))
    if call == "all_reduce":
        dist.all_reduce(wide, redop)
    else:
        chunk = torch.empty(output.numel(), dtype=wide.dtype)
        dist.reduce_scatter_tensor(chunk, wide, redop)
        wide = chunk
    if op == "avg":
        n = dist.get_world_size()
        wide = wide / n if wide.is_floating_point() else torch.div(wide, n, rounding_mode="trunc")
    output.copy_(wide)


def backend_data(seed: int, rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    high = 3 if op == "product" else 1000
    return torch.randint(-high, high + 1, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def expect_close(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    if not got.is_floating_point() or "max" in case or "min" in case:
        assert torch.equal(got, want), f"{case}: {got} != {want}"
        return
    rtol, atol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, msg=lambda m: f"{case}: {m}")


def check_backend(rank: int, world_size: int, ours: dist.ProcessGroup) -> int:
    """dist.* on a group of backend "ringcomm" vs the default gloo group."""
    checked = 0
    for seed, (dtype, op, numel) in enumerate((d, o, n) for d in BACKEND_DTYPES for o in BACKEND_OPS
                                              for n in BACKEND_NUMELS):
        if op == "product" and dtype.is_floating_point and dtype != torch.float32:
            continue  # products of N(0, 1) values in 16 bits: rounding, not communication
        case = f"rank {rank} backend ringcomm {dtype} {op} numel={numel}"
        redop = getattr(dist.ReduceOp, op.upper())
        data = backend_data(seed, rank, numel * world_size, dtype, op)
        want = torch.empty_like(data)
        gloo_reference("all_reduce", op, want, data)
        for async_op in (False, True):
            got = data.clone()
            work = dist.all_reduce(got, redop, group=ours, async_op=async_op)
            work.wait() if async_op else None
            expect_close(got, want, f"all_reduce async={async_op} {case}")
        got, want_chunk = torch.full((numel,), 7, dtype=dtype), torch.empty(numel, dtype=dtype)
        gloo_reference("reduce_scatter", op, want_chunk, data)
        dist.reduce_scatter_tensor(got, data, redop, group=ours)
        expect_close(got, want_chunk, f"reduce_scatter_tensor {case}")
        mine = data[:numel].contiguous()
        want_all, got_all = torch.empty_like(data), torch.full_like(data, 7)
        dist.all_gather_into_tensor(want_all, mine)
        dist.all_gather_into_tensor(got_all, mine, group=ours)
        assert torch.equal(got_all, want_all), f"all_gather_into_tensor {case}"
        root = seed % world_size
        shared = data.clone()
        dist.broadcast(shared, root, group=ours)
        assert torch.equal(shared, backend_data(seed, root, numel * world_size, dtype, op)), f"broadcast {case}"
        checked += 5
    dist.barrier(group=ours)
    return checked


def check_ddp(rank: int, world_size: int, ours: dist.ProcessGroup) -> float:
    """torch DDP on backend "ringcomm" across hosts vs plain torch on one process
    with the global batch (DDP's mean of the ranks' mean losses)."""
    from test_backend_models import LR, NUM_STEPS, batch, small_model, train_ddp

    base = small_model()
    got = train_ddp(base, ours, rank, zero=False)
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(NUM_STEPS):
        pairs = [batch(step, r) for r in range(world_size)]
        inputs, targets = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        ((model(inputs) - targets) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    diff = max((g - w).abs().max().item() for g, w in zip(got, model.parameters()))
    assert LR > 0 and diff <= 1e-6, f"rank {rank}: DDP across hosts differs from one process by {diff}"  # fp32 order
    return diff


def check_zero(rank: int, world_size: int) -> int:
    """zero.initialize stage 3 on comm_backend ringcomm vs the single-process reference."""
    from test_zero_parity import check_case

    reference: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind, dtype_name in (("transformer", "fp32"), ("mlp", "bf16")):
            check_case(rank, world_size, kind, 3, dtype_name, 1, "ringcomm", reference)
    return len(reference)


def run_check(kind: str, description: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    started = time.monotonic()
    shm = check_collectives(rank, world_size, kind, description)
    ours = dist.new_group(backend="ringcomm")
    checked = check_backend(rank, world_size, ours)
    ddp = check_ddp(rank, world_size, ours)
    zero_cases = check_zero(rank, world_size)
    report(rank=rank, shm=shm, backend_checked=checked, ddp_diff=ddp, zero_cases=zero_cases,
           seconds=time.monotonic() - started)


def run_failure(mode: str, timeout_s: float, numel: int) -> None:
    """all_reduce in a loop until the failure arrives (`fail`), or until the
    launcher says the link is back (`flap`: then every result must be right)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = ringcomm.new_group(timeout=timeout_s)
    tensor = ringcomm.empty(numel + 1, group=group)  # the last element: whether a rank saw the stop file
    ringcomm.barrier(group=group)
    open(os.path.join(os.environ["RCC_OUT"], f"rank{rank}.ready"), "w").close()
    result: dict = dict(rank=rank, host=socket.gethostname(), kind=group.transport.kind, calls=0)
    expected = world_size * (world_size + 1) / 2
    stop = os.path.join(os.environ["RCC_OUT"], "stop")
    try:
        longest = 0.0
        while True:
            tensor.fill_(rank + 1)
            tensor[-1] = float(os.path.exists(stop))
            start = time.monotonic()
            ringcomm.all_reduce(tensor, group=group)
            longest = result["longest_call_s"] = max(longest, time.monotonic() - start)
            result["calls"] += 1
            assert bool((tensor[:-1] == expected).all()), f"rank {rank}: wrong result at call {result['calls']}"
            if tensor[-1] > 0:
                break
    except RuntimeError as err:
        result.update(raised_at=time.time(), error=str(err))
        try:
            ringcomm.all_reduce(torch.ones(10), group=group)
            result["refused"] = ""
        except RuntimeError as again:
            result["refused"] = str(again)
    closing = time.monotonic()
    group.close(timeout_s=timeout_s)
    result.update(close_s=time.monotonic() - closing, dev_shm=sorted(os.listdir("/dev/shm")))
    report(**result)
    sys.stdout.flush()
    os._exit(0)  # the default gloo group may sit across a dead link: leave without tearing it down


class Outcome(NamedTuple):
    results: dict[int, dict]  # rank -> its RESULT, for every rank that printed one
    outputs: dict[int, str]  # rank -> output, for every survivor
    returncodes: dict[int, int | None]
    injected_at: float  # wall clock
    survivors: list[int]
    shm_left: dict[int, list[str]]  # host -> ringcomm names in its /dev/shm once everything ended


def drive_failure(cluster, mode: str, *, timeout_s: float, numel: int = 1 << 20, host: int = 1,
                  down_s: float = 2.0) -> Outcome:
    """Runs `fail` (mode link_down, kill, stop) or `flap` (the link down for
    down_s, then up) on a cluster of hosts x 2 ranks; the failure hits `host`
    while every rank loops on all_reduce."""
    import signal

    scenario = "flap" if mode == "flap" else "fail"
    target = cluster.hosts[host]
    with cluster.launch([__file__, scenario, str(timeout_s), str(numel)], nproc_per_host=2,
                        timeout_s=3 * timeout_s + 90) as launched:
        ranks = range(launched.world_size)
        pids = launched.rank_pids(host)
        deadline = time.monotonic() + 90
        while not all(os.path.exists(os.path.join(launched.out, f"rank{r}.ready")) for r in ranks):
            if time.monotonic() > deadline or launched.done(ranks):
                break
            time.sleep(0.02)
        time.sleep(0.5)
        injected_at = time.time()
        if mode in ("link_down", "flap"):
            target.set_link(False)
        else:
            for pid in pids:
                os.kill(pid, signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        if mode == "flap":
            time.sleep(down_s)
            target.set_link(True)
            time.sleep(1.0)
            open(os.path.join(launched.out, "stop"), "w").close()
        survivors = [r for r in ranks if mode in ("link_down", "flap") or r // 2 != host]
        done = launched.wait(survivors)
        target.set_link(True)
    results = {}
    for r in done:
        line = next((x for x in r.output.splitlines() if x.startswith("RESULT ")), "")
        if line:
            results[r.rank] = json.loads(line[len("RESULT "):])
    shm_left = {h.index: [n for n in h.shm_entries() if n.startswith("ringcomm-")] for h in cluster.hosts}
    return Outcome(results, {r.rank: r.output for r in done if r.rank in survivors},
                   {r.rank: r.returncode for r in done}, injected_at, survivors, shm_left)


def problems(outcome: Outcome, mode: str, timeout_s: float, slack_s: float) -> list[str]:
    """What the survivors of a failure did wrong (nothing: []): each must raise a
    RuntimeError naming the op and a host within timeout_s + slack_s, then be
    refused with that error, close in time and leave /dev/shm empty; after a
    flap (the link back in time) every call must have completed."""
    found = [f"left in host {h}'s /dev/shm: {names}" for h, names in outcome.shm_left.items() if names]
    for rank in outcome.survivors:
        report = outcome.results.get(rank)
        if report is None:
            found.append(f"rank {rank} exit {outcome.returncodes.get(rank)}:\n{outcome.outputs.get(rank, '')[-3000:]}")
            continue
        error, detected = report.get("error", ""), report.get("raised_at", 0.0) - outcome.injected_at
        if mode == "flap":
            if error or report["longest_call_s"] < 1.0:
                found.append(f"rank {rank}: the flap was not lived through: {report}")
            continue
        if not ("all_reduce: rank " in error and "on host " in error):
            found.append(f"rank {rank}: the error names no op or host: {error}")
        if not 0 < detected <= timeout_s + slack_s:
            found.append(f"rank {rank} took {detected:.1f} s (limit {timeout_s} + {slack_s}): {error}")
        if "unusable after an earlier failure" not in report["refused"] or error[:200] not in report["refused"]:
            found.append(f"rank {rank} was not refused with the original error: {report['refused']}")
        if report["close_s"] > timeout_s + 1 or report["dev_shm"]:
            found.append(f"rank {rank}: close took {report['close_s']:.1f} s, /dev/shm {report['dev_shm']}")
    return found


def repeat(argv: list[str]) -> int:
    """python tests/cluster_worker.py [--repeat 10] [--timeout 10] [modes...]:
    each failure mode on fresh 2 x 2 clusters, with every survivor's detection time."""
    import argparse
    import statistics

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from cluster import Cluster

    p = argparse.ArgumentParser(description=repeat.__doc__)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--slack", type=float, default=3.5)
    p.add_argument("modes", nargs="*", default=["link_down", "kill", "stop", "flap"])
    args = p.parse_args(argv)
    failed = 0
    for mode in args.modes:
        times, passed = [], 0
        for index in range(args.repeat):
            with Cluster(2) as machines:
                outcome = drive_failure(machines, mode, timeout_s=args.timeout)
            found = problems(outcome, mode, args.timeout, args.slack)
            key, origin = ("longest_call_s", 0.0) if mode == "flap" else ("raised_at", outcome.injected_at)
            seen = {r: round(outcome.results[r][key] - origin, 2)
                    for r in outcome.survivors if key in outcome.results.get(r, {})}
            times.extend(seen.values())
            passed += not found
            what = "longest call (completed, right)" if mode == "flap" else "detected after"
            print(f"{mode} {index + 1}/{args.repeat}: {'ok' if not found else 'FAILED'} {what} {seen} s"
                  + "".join(f"\n    {line}" for line in found), flush=True)
        summary = (f"median {statistics.median(times):.2f} s, range {min(times):.2f}-{max(times):.2f} s"
                   if times else "-")
        what = "longest call" if mode == "flap" else "detection"
        print(f"== {mode}: {passed}/{args.repeat} held (timeout {args.timeout} s); {what} {summary}", flush=True)
        failed += passed < args.repeat
    return 1 if failed else 0


def main() -> None:
    if "RANK" not in os.environ:  # not under torchrun: the driver
        sys.exit(repeat(sys.argv[1:]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    scenario, *args = sys.argv[1:]
    if scenario == "check":
        run_check(*args)
    else:
        run_failure(scenario, float(args[0]), int(args[1]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
