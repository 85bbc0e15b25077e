"""The cases of bus_bw.py: buffers, the call per (op, backend, in-place),
the #wrong check against a closed form, timing, and the table's text."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import ringcomm
from ringcomm import _C
from ringcomm.plan.schedule import bus_factor

# torch 2.13 names, with the older ones as fallback.
GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
GLOO_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
RINGCOMM_OPS = {"sum": "sum", "prod": "product", "min": "min", "max": "max", "avg": "avg"}


class Runner:
    def __init__(self, args) -> None:
        from bus_bw import DTYPES

        self.args = args
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dtype = getattr(torch, DTYPES[args.datatype])
        self.group = None
        self.transport_kind = "-"
        if "ringcomm" in args.backends:
            self.group = ringcomm.new_group(transport=args.transport, timeout=args.timeout)
            self.transport_kind = self.group.transport.kind
        if "gloo" in args.backends and args.op == "avg":
            raise ValueError("bus_bw: gloo has no AVG reduction; use -o sum or --backends ringcomm")

    # -- data and the closed form ------------------------------------------------
    def pattern(self, rank: int, numel: int) -> torch.Tensor:
        """Rank r's input: (r + 1) * (1 + i % 13), exact in every dtype for these sizes."""
        return ((torch.arange(numel, dtype=torch.int64) % 13 + 1) * (rank + 1)).to(self.dtype)

    def expected_reduction(self, numel: int) -> torch.Tensor:
        k = (torch.arange(numel, dtype=torch.int64) % 13 + 1).to(torch.float64)
        n = self.world_size
        return {"sum": k * n * (n + 1) / 2, "prod": k ** n * math.factorial(n), "min": k, "max": k * n,
                "avg": k * (n + 1) / 2}[self.args.op]

    def count_wrong(self, actual: torch.Tensor, expected: torch.Tensor) -> int:
        actual = actual.to(torch.float64)
        if self.dtype.is_floating_point:
            # 16-bit types: gloo rounds each partial result, so allow a few 16-bit ulps.
            rtol = {torch.float16: 1e-2, torch.bfloat16: 3e-2}.get(self.dtype, 1e-6)
            wrong = (actual - expected).abs() > rtol * expected.abs()
        else:
            wrong = actual != expected.to(self.dtype).to(torch.float64)
        local = torch.tensor([int(wrong.sum())], dtype=torch.int64)
        dist.all_reduce(local)
        return int(local)

    # -- the calls -----------------------------------------------------------------
    def make_call(self, op: str, backend: str, in_place: bool, full: torch.Tensor, chunk: torch.Tensor,
                  full_out: torch.Tensor) -> tuple[Callable[[], None], Callable[[], torch.Tensor], Callable[[], None]]:
        """Returns (call, result, refill): the collective, where its result lands, and
        how to restore its inputs to the pattern."""
        own = slice(self.rank * chunk.numel(), (self.rank + 1) * chunk.numel())
        rc = dict(group=self.group)
        redop = RINGCOMM_OPS[self.args.op]
        gloo_op = GLOO_OPS.get(self.args.op)
        n = full.numel()

        def refill_full():
            full.copy_(self.pattern(self.rank, n))

        def refill_chunk():
            chunk.copy_(self.pattern(self.rank, chunk.numel()))
            full_out[own].copy_(chunk)

        if op == "all_reduce":
            target = full if in_place else full_out
            if backend == "ringcomm":
                call = (lambda: ringcomm.all_reduce(full, redop, **rc)) if in_place else \
                    (lambda: ringcomm.all_reduce(full, redop, output=full_out, **rc))
            else:
                call = (lambda: dist.all_reduce(full, gloo_op)) if in_place else \
                    (lambda: (full_out.copy_(full), dist.all_reduce(full_out, gloo_op)))
            return call, lambda: target, refill_full
        if op == "reduce_scatter":
            out = full[own] if in_place else chunk
            if backend == "ringcomm":
                call = lambda: ringcomm.reduce_scatter(out, full, redop, **rc)  # noqa: E731
            else:
                call = lambda: SCATTER(out, full, gloo_op)  # noqa: E731
            return call, lambda: out, refill_full
        src = full_out[own] if in_place else chunk
        if backend == "ringcomm":
            call = lambda: ringcomm.all_gather(full_out, src, **rc)  # noqa: E731
        else:
            call = lambda: GATHER(full_out, src)  # noqa: E731
        return call, lambda: full_out, refill_chunk

    def expected(self, op: str, numel: int) -> torch.Tensor:
        if op == "all_gather":
            chunk = numel // self.world_size
            return torch.cat([self.pattern(r, chunk).to(torch.float64) for r in range(self.world_size)])
        full = self.expected_reduction(numel)
        if op == "reduce_scatter":
            chunk = numel // self.world_size
            return full[self.rank * chunk:(self.rank + 1) * chunk]
        return full

    # -- measuring -------------------------------------------------------------------
    def time_call(self, call: Callable[[], None]) -> float:
        for _ in range(self.args.warmup_iters):
            call()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(self.args.iters):
            call()
        elapsed = torch.tensor([(time.perf_counter() - start) / self.args.iters], dtype=torch.float64)
        dist.all_reduce(elapsed, dist.ReduceOp.MAX)  # the slowest rank sets the pace
        return float(elapsed)

    def memcpy_rate(self, nbytes: int) -> float:
        """GB/s of one memcpy of nbytes on rank 0 while the other ranks wait."""
        rate = torch.zeros(1, dtype=torch.float64)
        if self.rank == 0:
            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            for _ in range(self.args.warmup_iters):
                _C.copy(dst.data_ptr(), src.data_ptr(), nbytes)
            iters = max(self.args.iters, 5)
            start = time.perf_counter()
            for _ in range(iters):
                _C.copy(dst.data_ptr(), src.data_ptr(), nbytes)
            rate[0] = nbytes / ((time.perf_counter() - start) / iters) / 1e9
        dist.broadcast(rate, 0)
        return float(rate)

    def buffer(self, backend: str, numel: int) -> torch.Tensor:
        """ringcomm's buffers come from ringcomm.empty (shared memory on the shm
        transport, as its flat buffers are) unless --alloc torch; gloo's from torch.empty."""
        if backend == "ringcomm" and self.args.alloc == "shm":
            return ringcomm.empty(numel, dtype=self.dtype, group=self.group)
        return torch.empty(numel, dtype=self.dtype)

    def measure_size(self, op: str, size: int, progress) -> list[dict]:
        esize = torch.empty(0, dtype=self.dtype).element_size()
        unit = 1 if op == "all_reduce" else self.world_size
        numel = max(unit, size // esize // unit * unit)
        memcpy = self.memcpy_rate(numel * esize)
        rows = []
        for backend in self.args.backends:
            full, full_out, chunk = (self.buffer(backend, n) for n in
                                     (numel, numel, numel // self.world_size if op != "all_reduce" else 0))
            columns = {}
            for in_place in (False, True):
                call, result, refill = self.make_call(op, backend, in_place, full, chunk, full_out)
                wrong = -1
                if self.args.check:
                    refill()
                    call()
                    wrong = self.count_wrong(result(), self.expected(op, numel))
                refill()
                seconds = self.time_call(call)
                algbw = numel * esize / seconds / 1e9
                columns["ip" if in_place else "oop"] = dict(time_us=seconds * 1e6, algbw=algbw,
                                                            busbw=algbw * bus_factor(op, self.world_size), wrong=wrong)
            rows.append(dict(op=op, backend=backend, size=numel * esize, count=numel, type=str(self.dtype)[6:],
                             redop=self.args.op, memcpy_gbps=memcpy, **columns))
            if progress is not None:
                progress.update()
        return rows


def format_header(op: str, args, runner: Runner) -> str:
    line = (f"#\n# {op}: {runner.world_size} ranks, {args.datatype}, op {args.op}, ringcomm transport "
            f"{runner.transport_kind} (buffers: {args.alloc if runner.transport_kind == 'shm' else 'torch'}), {args.iters} iters after {args.warmup_iters} warm-up\n#\n"
            f"# {'':>40}{'out-of-place':>36}{'in-place':>38}\n"
            f"# {'size':>11} {'count':>11} {'type':>8} {'redop':>5} {'backend':>9}"
            f" {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
            f" {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'memcpy':>7} {'ratio':>6}\n"
            f"# {'(B)':>11} {'(elements)':>11} {'':>8} {'':>5} {'':>9}"
            f" {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
            f" {'(GB/s)':>7} {'':>6}")
    return line


def format_row(row: dict, same_size: list[dict]) -> str:
    ratio = ""
    reference = [r for r in same_size if r["backend"] != "ringcomm"]
    if row["backend"] == "ringcomm" and reference:
        ratio = f"{row['oop']['busbw'] / max(reference[0]['oop']['busbw'], 1e-12):6.1f}x"
    cells = "".join(f" {c['time_us']:10.1f} {c['algbw']:7.2f} {c['busbw']:7.2f} {c['wrong']:6d}"
                    for c in (row["oop"], row["ip"]))
    return (f"  {row['size']:11d} {row['count']:11d} {row['type']:>8} {row['redop']:>5} {row['backend']:>9}"
            f"{cells} {row['memcpy_gbps']:7.2f} {ratio:>6}")


def summary_lines(op: str, rows: list[dict], backends: list[str]) -> list[str]:
    lines = []
    for backend in backends:
        mine = [r for r in rows if r["backend"] == backend]
        if mine:
            avg = sum(r["oop"]["busbw"] for r in mine) / len(mine)
            wrong = sum(max(r["oop"]["wrong"], 0) + max(r["ip"]["wrong"], 0) for r in mine)
            lines.append(f"# {op} {backend:>9}: Avg bus bandwidth {avg:8.3f} GB/s (out-of-place), "
                         f"#wrong {wrong}{' OK' if wrong == 0 else ' FAILED'}")
    return lines
