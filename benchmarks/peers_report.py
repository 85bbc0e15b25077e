"""What peers.py shows: per-cell medians and ranges, the ratio to the best
peer, the contention table, the JSON and the log-log plot (rank 0 only)."""
from __future__ import annotations

import json
import os
import statistics

from peers_cells import BEST_OF, DTYPE, PEERS, POINT_TO_POINT, numel_for

from ringcomm.plan.schedule import bus_factor

LABELS = {"rc_plain": "ringcomm plain", "rc_window": "ringcomm windows", "rc_dist": "ringcomm dist.*",
          "dist_floor": "dist.* floor (no-op pg)",
          "mpi": "Open MPI", "deepspeed": "DeepSpeed shm", "gloo": "gloo", "memcpy": "memcpy"}
TIME_MAX_NBYTES = 8  # sizes up to this show the time in us, not busbw


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def summarize(op: str, nbytes: int, cell: dict, world_size: int) -> dict:
    """time_us and busbw (GB/s; memcpy: S / time) as median, min, max over rounds;
    send_recv: the time of one message (half the round trip) and S / that time."""
    actual = numel_for(nbytes, world_size) * DTYPE.itemsize
    messages = 2 if op in POINT_TO_POINT else 1
    factor = 1.0 if op == "copy" or op in POINT_TO_POINT else bus_factor(op, world_size)
    times = [s * 1e6 / messages for s in cell["seconds"]]
    rates = [actual * factor * messages / s / 1e9 for s in cell["seconds"]]
    stat = lambda v: {"median": statistics.median(v), "min": min(v), "max": max(v)}  # noqa: E731
    return {"op": op, "nbytes": actual, "requested_nbytes": nbytes, "iters": cell["iters"], "wrong": cell["wrong"],
            "time_us": stat(times), "busbw": stat(rates), "seconds": cell["seconds"]}


def summaries(cells: dict, world_size: int) -> dict:
    return {key: summarize(key[0], key[1], cell, world_size) for key, cell in cells.items()}


def fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 0.1 \
        else f"{value:.2g}"


def metric(summary: dict, nbytes: int) -> tuple[str, float, bool]:
    """(name, median, higher is better) of the cell as the table shows it."""
    if nbytes <= TIME_MAX_NBYTES:
        return "time_us", summary["time_us"]["median"], False
    return "busbw", summary["busbw"]["median"], True


def cell_text(summary: dict | None, nbytes: int) -> str:
    if summary is None:
        return "-"
    if summary["wrong"] != 0:
        return f"WRONG ({summary['wrong']})"
    name, median, _ = metric(summary, nbytes)
    spread = summary[name]
    return f"{fmt(median)} [{fmt(spread['min'])}-{fmt(spread['max'])}]"


def ratio(stats: dict, op: str, nbytes: int, peer: str) -> tuple[float | None, str | None]:
    """(peer's median over the best verified peer's, which peer was best); > 1: peer is faster."""
    mine = stats.get((op, nbytes, peer))
    rivals = [(p, stats[(op, nbytes, p)]) for p in BEST_OF if (op, nbytes, p) in stats and stats[(op, nbytes, p)]["wrong"] == 0]
    if mine is None or mine["wrong"] != 0 or not rivals:
        return None, None
    _, value, higher = metric(mine, nbytes)
    best_peer, best = (max if higher else min)(((p, metric(s, nbytes)[1]) for p, s in rivals), key=lambda x: x[1])
    return (value / best if higher else best / value), best_peer


def over_floor(stats: dict, op: str, nbytes: int) -> float | None:
    """dist.* on ringcomm's time over the no-op backend's, both measured in this run
    (> 1: what ringcomm adds to torch's dispatch)."""
    mine, floor = stats.get((op, nbytes, "rc_dist")), stats.get((op, nbytes, "dist_floor"))
    if mine is None or floor is None or mine["wrong"] != 0:
        return None
    return mine["time_us"]["median"] / floor["time_us"]["median"]


def main_table(args, peers_asked: list[str], stats: dict) -> list[str]:
    """The markdown table: one row per (op, size), one column per peer, then ratios."""
    columns = [p for p in PEERS if p in peers_asked]
    head = (["op / size"] + [LABELS[p] for p in columns] + ["plain / best", "dist.* / best"]
            + (["dist.* time / floor"] if "dist_floor" in columns else []) + ["best peer"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for op in args.ops:
        for nbytes in args.sizes:
            label = f"{op} {size_label(nbytes)}" + (" (us)" if nbytes <= TIME_MAX_NBYTES else "")
            cells = [cell_text(stats.get(("copy" if p == "memcpy" else op, nbytes, p)), nbytes) for p in columns]
            plain, best = ratio(stats, op, nbytes, "rc_plain")
            via_dist, _ = ratio(stats, op, nbytes, "rc_dist")
            floor = [over_floor(stats, op, nbytes)] if "dist_floor" in columns else []
            ratios = [f"{r:.2f}x" if r is not None else "-" for r in (plain, via_dist, *floor)]
            lines.append("| " + " | ".join([label, *cells, *ratios, LABELS.get(best, "-")]) + " |")
    return lines


def contention_table(args, quiet: dict, contended: dict) -> list[str]:
    """Per (op, size) and peer: quiet and contended medians, and contended / quiet
    busbw (at 8 B the times, as quiet / contended: < 1 means slower)."""
    peers = [p for p in ("rc_plain", "mpi") if any(key[2] == p for key in contended)]
    head = ["op / size"] + [f"{LABELS[p]} {what}" for p in peers for what in ("quiet", "contended", "ratio")]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for op in args.ops:
        for nbytes in args.sizes:
            row = [f"{op} {size_label(nbytes)}" + (" (us)" if nbytes <= TIME_MAX_NBYTES else "")]
            for peer in peers:
                q, c = quiet.get((op, nbytes, peer)), contended.get((op, nbytes, peer))
                if q is None or c is None:
                    row += ["-", "-", "-"]
                    continue
                _, qv, higher = metric(q, nbytes)
                _, cv, _ = metric(c, nbytes)
                row += [cell_text(q, nbytes), cell_text(c, nbytes), f"{(cv / qv if higher else qv / cv):.2f}x"]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def header_lines(args, header: dict, notes: dict[str, str]) -> list[str]:
    lines = [f"# peers: {header['world_size']} ranks, float32, host {header['host']}, {header['cpus']} cpus, "
             f"loadavg at start {header['loadavg_start']}, at end {header['loadavg_end']}",
             f"# versions: torch {header['torch']}, {header['open_mpi']}, mpi4py {header['mpi4py']}, "
             f"DeepSpeed {header['deepspeed']}",
             f"# {header['cpu']}",
             f"# launch: {header['launch']}",
             f"# ringcomm: {header['ringcomm_transport']}",
             f"# {args.rounds} interleaved rounds, {args.budget_s * 1e3:.0f} ms timed per cell and round; "
             "cells: median [min-max] over rounds; busbw GB/s (memcpy: S / time), at 8 B the time in us"]
    lines += [f"# {LABELS[p]}: '-' ({note})" for p, note in notes.items()]
    return lines


def report(args, header: dict, peers: list[str], notes: dict[str, str], quiet: dict, contended: dict | None,
           world_size: int) -> None:
    stats = summaries(quiet, world_size)
    contended_stats = summaries(contended, world_size) if contended is not None else None
    wrong = {k: s["wrong"] for k, s in [*stats.items(), *(contended_stats or {}).items()] if s["wrong"] != 0}
    print("\n".join(header_lines(args, header, notes) + [""] + main_table(args, args.peers, stats)))
    if contended_stats is not None:
        print(f"\n# under contention: {header['cpus']} busy processes (one per core), started per round\n")
        print("\n".join(contention_table(args, stats, contended_stats)))
    print(f"\n# results checked once per size and peer: {'all correct' if not wrong else f'WRONG in {sorted(wrong)}'}")
    write_json(args, header, peers, notes, stats, contended_stats)
    if args.plot:
        try:
            from peers_plot import plot
        except ImportError as error:  # matplotlib is in the bench and test extras only
            print(f"# no plot: {error}")
            return
        plot(args, header, stats, args.plot)
        print(f"# wrote {args.plot}")


def write_json(args, header: dict, peers: list[str], notes: dict, stats: dict, contended: dict | None) -> None:
    def rows(table: dict, phase: str) -> list[dict]:
        return [{"phase": phase, "peer": key[2], **summary} for key, summary in table.items()]

    ratios = []
    for op in args.ops:
        for nbytes in args.sizes:
            plain, best = ratio(stats, op, nbytes, "rc_plain")
            via_dist, _ = ratio(stats, op, nbytes, "rc_dist")
            ratios.append({"op": op, "requested_nbytes": nbytes, "best_peer": best, "plain": plain, "dist": via_dist,
                           "dist_over_floor": over_floor(stats, op, nbytes)})
    cells = rows(stats, "quiet") + rows(contended or {}, "contended")
    out = {"header": header, "args": {k: v for k, v in vars(args).items()},
           "peers": {p: {"on": p in peers, "note": notes.get(p, "")} for p in args.peers},
           "cells": cells, "ratios": ratios, "verified": all(c["wrong"] == 0 for c in cells)}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"# wrote {args.json}")
