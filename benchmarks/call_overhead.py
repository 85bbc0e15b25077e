"""Per-call cost of the paths to ringcomm, layer by layer: raw C++ call,
transport call, ringcomm.* (the lean path), dist.* on the "ringcomm" backend,
the floor of any Python backend (a ProcessGroup subclass returning a finished
Work), gloo, and the single-process pieces in between (Work, Future, checks,
Group.run).

    python benchmarks/call_overhead.py [--world-size 2] [--reps 7] [--target-ms 40] [--max-nbytes 1048576]
                                       [--json bench-results/call_overhead.json]

--world-size 1 times the software layers alone (the one-rank transport only
copies); with 2 ranks on a busy 2-core machine a waiting rank's peer is often
descheduled and the collective rows measure that, not the call path.

Spawns 2 local ranks (benchmarks/launch.py; default group on gloo). Every row
is the median (and min) over --reps of the mean us/call of a timed loop whose length all
ranks agree on (rank 0 calibrates it to about --target-ms). Prints a table and
/proc/loadavg; writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

from launch import launch  # benchmarks/ is on sys.path: this file runs as a script
from peers_setup import floor_backend

SIZES = {"all_reduce": (8, 4096, 65536, 1 << 20), "all_gather": (8, 4096), "reduce_scatter": (8, 4096)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7, help="timed loops per row (the median is reported)")
    parser.add_argument("--target-ms", type=float, default=40.0, help="about how long one timed loop runs")
    parser.add_argument("--max-nbytes", type=int, default=1 << 20, help="skip larger messages (a quicker run)")
    parser.add_argument("--json", default="bench-results/call_overhead.json")
    parser.add_argument("--observe", action="store_true",
                        help="only the cost of observing: 8 B all_reduce with the flight recorder on and off, "
                             "and under the profiler, interleaved round by round")
    return parser.parse_args(argv)


def agreed_iterations(fn: Callable[[], object], target_s: float) -> int:
    """Iterations for one loop of about target_s, the same on every rank (collective rows must match)."""
    import torch
    import torch.distributed as dist

    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(20):
        fn()
    per_call = (time.perf_counter() - start) / 20
    count = torch.tensor([max(20, min(50_000, int(target_s / max(per_call, 1e-9))))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # default group: gloo
    return int(count)


def time_row(fn: Callable[[], object], reps: int, target_s: float) -> tuple[float, float]:
    """(median, min) over reps of the mean us per call; ranks start each loop
    together. The min is the steadier figure on a shared machine."""
    import torch.distributed as dist

    iterations = agreed_iterations(fn, target_s)
    means = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        means.append((time.perf_counter() - start) / iterations * 1e6)
    return statistics.median(means), min(means)


def fake_backend():
    """torch's C++ FakeProcessGroup (no-op collectives): what the dispatch from
    dist.* to any C++ c10d backend costs, for comparison with the Python floor."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers backend "fake")

    return dist.new_group(backend="fake")


def collective_rows(pg, floor, fake, gloo, rank: int, world_size: int) -> list[tuple[str, int, str, Callable]]:
    """(op, nbytes, path, fn) for every timed two-rank row."""
    import torch
    import torch.distributed as dist

    import ringcomm
    from ringcomm.core.ops import DTYPE_CODES, ReduceOp

    group, transport = pg._group, pg._group.transport
    comm = getattr(transport, "_comm", None)
    timeout_s = transport.timeout_s
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows = []
    for nbytes in SIZES["all_reduce"]:
        t = torch.ones(nbytes // 4)
        ptr, numel, code = t.data_ptr(), t.numel(), DTYPE_CODES[t.dtype]
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        rows += [("all_reduce", nbytes, "C++ (_C.ShmComm)",
                  lambda p=ptr, n=numel, c=code: comm.all_reduce(p, p, n, c, 0, timeout_s)),
                 ("all_reduce", nbytes, "transport", lambda t=t: transport.all_reduce(output=t, input=t, op=ReduceOp.SUM)),
                 ("all_reduce", nbytes, "ringcomm.all_reduce", lambda t=t: ringcomm.all_reduce(t, group=group)),
                 ("all_reduce", nbytes, "pg.allreduce().wait()", lambda t=t, o=opts: pg.allreduce([t], o).wait()),
                 ("all_reduce", nbytes, "dist ringcomm", lambda t=t: dist.all_reduce(t, group=pg)),
                 ("all_reduce", nbytes, "dist ringcomm async .wait()",
                  lambda t=t: dist.all_reduce(t, group=pg, async_op=True).wait()),
                 ("all_reduce", nbytes, "dist floor (no-op Python pg)", lambda t=t: dist.all_reduce(t, group=floor)),
                 ("all_reduce", nbytes, "dist no-op C++ backend (fake)", lambda t=t: dist.all_reduce(t, group=fake)),
                 ("all_reduce", nbytes, "dist gloo", lambda t=t: dist.all_reduce(t, group=gloo))]
    for op, call in (("all_gather", gather), ("reduce_scatter", scatter)):
        for nbytes in SIZES[op]:
            big, small = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world_size)
            out, inp = (big, small) if op == "all_gather" else (small, big)
            direct = ((lambda i=inp, o=out: transport.all_gather(output=o, input=i)) if op == "all_gather" else
                      (lambda i=inp, o=out: transport.reduce_scatter(output=o, input=i, op=ReduceOp.SUM)))
            public = getattr(ringcomm, op)
            rows += [(op, nbytes, "transport", direct),
                     (op, nbytes, f"ringcomm.{op}", lambda o=out, i=inp, f=public: f(o, i, group=group)),
                     (op, nbytes, "dist ringcomm", lambda o=out, i=inp, c=call: c(o, i, group=pg)),
                     (op, nbytes, "dist floor (no-op Python pg)", lambda o=out, i=inp, c=call: c(o, i, group=floor)),
                     (op, nbytes, "dist no-op C++ backend (fake)", lambda o=out, i=inp, c=call: c(o, i, group=fake)),
                     (op, nbytes, "dist gloo", lambda o=out, i=inp, c=call: c(o, i, group=gloo))]
    return rows


def piece_rows(pg) -> list[tuple[str, int, str, Callable]]:
    """Single-process pieces of one backend call, timed on each rank alone."""
    import torch
    import torch.distributed as dist

    from ringcomm.backend import ops as backend_ops, work as backend_work
    from ringcomm.backend.work import accelerated_redop
    from ringcomm.core.ops import ReduceOp

    class PlainWork(dist.Work):
        pass

    t = torch.ones(2)
    tensors = [t]
    opts = dist.AllreduceOptions()
    opts.asyncOp = False

    def future_set_result():
        future = torch.futures.Future()
        future.set_result(tensors)

    def noop():
        pass

    if hasattr(backend_work, "finished_work"):  # this version: a Work without a Future
        def finished():
            return backend_work.finished_work(tensors)
    else:  # before: a Work with a completed Future
        def finished():
            return backend_work.BackendWork(None, tensors)

    return [("piece", 0, "dist.Work subclass ()", PlainWork),
            ("piece", 0, "torch.futures.Future() + set_result", future_set_result),
            ("piece", 0, "Work of a finished call", finished),
            ("piece", 0, "dist.AllreduceOptions() + 2 sets", lambda: (dist.AllreduceOptions(),)),
            ("piece", 0, "accelerated_redop(opts)", lambda: accelerated_redop(opts)),
            ("piece", 0, "pg._accelerates([t], strided=True)", lambda: pg._accelerates(tensors, strided=True)),
            ("piece", 0, "takes(t) (broadcast's lean check)",
             lambda: backend_work.takes(t, pg._supports) if hasattr(backend_work, "takes") else None),
            ("piece", 0, "C++ lean checks of a pair (sizes refused)", lean_pair_checks(pg)),
            ("piece", 0, "backend_ops.all_reduce closure",
             lambda: backend_ops.all_reduce(pg._group.transport, tensors, ReduceOp.SUM)
             if hasattr(backend_ops, "all_reduce") else None),
            ("piece", 0, "Group.run(no-op, inline)", lambda: pg._group.run("noop", noop, False)),
            ("piece", 0, "t.is_contiguous()+dtype+device checks",
             lambda: t.is_contiguous() and t.dtype is torch.float32 and t.device.type == "cpu"),
            ("piece", 0, "empty Python call", noop)]


def lean_pair_checks(pg) -> Callable[[], object]:
    """_C.reduce_scatter_tensors on a pair whose sizes do not match: every
    check of both tensors, then False before any collective."""
    import torch

    from ringcomm import _C

    handle, big, small = pg._group.lean_handle, torch.ones(3 * pg.size()), torch.ones(2)
    if not hasattr(_C, "reduce_scatter_tensors") or handle is None:
        return lambda: None
    return lambda: _C.reduce_scatter_tensors(handle, small, big, 0, 10.0)


def observe_rows(world_size: int) -> list[tuple[str, int, str, Callable]]:
    """8 B all_reduce on groups made with the flight recorder on (the default)
    and off (RINGCOMM_TRACE_BUFFER_SIZE=0), through ringcomm.* and dist.*; the
    profiler's flag check alone; ringcomm.all_reduce under an active profiler."""
    import torch
    import torch.distributed as dist
    from torch.autograd import profiler

    import ringcomm

    groups = {}
    for state, size in (("on", None), ("off", "0")):
        if size is not None:
            os.environ["RINGCOMM_TRACE_BUFFER_SIZE"] = size
        groups[state] = (ringcomm.new_group(), dist.new_group(backend="ringcomm"))
        os.environ.pop("RINGCOMM_TRACE_BUFFER_SIZE", None)
    t = torch.ones(2)
    rows = []
    for state, (group, pg) in groups.items():
        rows += [("all_reduce", 8, f"ringcomm.all_reduce, recorder {state}",
                  lambda g=group: ringcomm.all_reduce(t, group=g)),
                 ("all_reduce", 8, f"dist ringcomm, recorder {state}", lambda p=pg: dist.all_reduce(t, group=p))]
    profiled = groups["on"][0]

    def under_profiler() -> None:
        ringcomm.all_reduce(t, group=profiled)

    rows += [("piece", 0, "profiler check (_is_profiler_enabled)", lambda: profiler._is_profiler_enabled),
             ("all_reduce", 8, "ringcomm.all_reduce under torch.profiler", under_profiler)]
    return rows


def time_interleaved(rows: list, reps: int, target_s: float) -> list[list[float]]:
    """Each row's mean us per call in each of `reps` rounds, the rows taking turns
    within a round (so that the machine's load shifts hit them alike)."""
    import torch
    import torch.distributed as dist

    iterations = [agreed_iterations(fn, target_s) for *_, fn in rows]
    means: list[list[float]] = [[] for _ in rows]
    for _ in range(reps):
        for index, (*_, fn) in enumerate(rows):
            profile = "under torch.profiler" in rows[index][2]
            context = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
            if context is not None:
                context.__enter__()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iterations[index]):
                fn()
            means[index].append((time.perf_counter() - start) / iterations[index] * 1e6)
            if context is not None:
                context.__exit__(None, None, None)
    return means


def observe_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = observe_rows(world_size)
    means = time_interleaved(rows, args.reps, args.target_ms / 1e3)
    if rank != 0:
        return
    print(f"{'op':>10} {'size':>6}  {'path':<42} {'median us':>10}  range")
    results = []
    for (op, nbytes, path, _), values in zip(rows, means):
        median = statistics.median(values)
        results.append({"op": op, "nbytes": nbytes, "path": path, "us_median": median, "us_all": values})
        print(f"{op:>10} {nbytes:>4} B  {path:<42} {median:10.3f}  [{min(values):.3f} .. {max(values):.3f}]")
    loadavg = open("/proc/loadavg").read().strip()
    print(f"# loadavg {loadavg}; ranks {world_size}; {args.reps} interleaved rounds")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"loadavg": loadavg, "world_size": world_size, "rows": results}, f, indent=1)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import ringcomm  # noqa: F401  (registers the backend)

    rank, world_size = dist.get_rank(), dist.get_world_size()
    pg = dist.new_group(backend="ringcomm")
    gloo = dist.new_group(backend="gloo")
    floor = floor_backend()
    fake = fake_backend()
    results = []
    if rank == 0:
        print(f"{'op':>14} {'size':>10}  {'path':<42} {'median us':>10} {'min us':>10}")
    rows = [row for row in collective_rows(pg, floor, fake, gloo, rank, world_size) if row[1] <= args.max_nbytes]
    for op, nbytes, path, fn in rows + piece_rows(pg):
        median, fastest = time_row(fn, args.reps, args.target_ms / 1e3)
        results.append({"op": op, "nbytes": nbytes, "path": path, "us_median": median, "us_min": fastest})
        if rank == 0:
            print(f"{op:>14} {nbytes:>8} B  {path:<42} {median:10.2f} {fastest:10.2f}", flush=True)
    if rank == 0:
        loadavg = open("/proc/loadavg").read().strip()
        print(f"# loadavg {loadavg}; cores {len(os.sched_getaffinity(0))}; ranks {world_size}; "
              f"RINGCOMM_ASYNC={os.environ.get('RINGCOMM_ASYNC', 'auto')}")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"loadavg": loadavg, "world_size": world_size, "args": vars(args), "rows": results}, f,
                          indent=1)
            print(f"# wrote {args.json}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch(observe_worker if args.observe else worker, args, nproc=args.world_size, timeout_s=60.0,
                  deadline_s=600.0)


if __name__ == "__main__":
    raise SystemExit(main())
