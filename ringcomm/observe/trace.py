"""Reads every rank's flight recorder dump ([Note: flight recorder]) and says
where the ranks disagree: the last sequence number each rank completed, the
ranks behind (or without a dump), and calls that differ at one sequence number.

    python -m ringcomm.observe.trace DIR [--run RUN_ID]
    # DIR: RINGCOMM_TRACE_DIR of the job, else <tmp>/ringcomm-trace-<uid>/<run id>

A file that is not a readable dump is named with the reason and left out; the
others are analyzed. Dumps of different runs ([Note: run id]) are never merged:
the analyzer lists the runs and their files, and --run picks one. Exit status:
0 analyzed, 1 no readable dump, 2 several runs (or an unknown --run).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

from .recorder import FILE_PREFIX
from .trace_dumps import NO_RUN_ID, MixedRunsError, Unreadable, load, scan  # load: for callers of trace.load

# Names of one call on its two paths (lean and the backend's checked one).
_SAME_OP = {"ringcomm:all_gather_into_tensor": "ringcomm:all_gather",
            "ringcomm:reduce_scatter_tensor": "ringcomm:reduce_scatter"}


@dataclass(frozen=True, slots=True)
class Call:
    """What one rank called at one sequence number."""

    op: str
    input_sizes: tuple
    output_sizes: tuple
    dtype: str

    def __str__(self) -> str:
        return f"{self.op.removeprefix('ringcomm:')} in {list(map(list, self.input_sizes))} " \
               f"out {list(map(list, self.output_sizes))} {self.dtype}".rstrip()


@dataclass(slots=True)
class GroupReport:
    """One group across the ranks that dumped it."""

    group_id: int
    global_ranks: list[int]
    transport: str
    last_completed: dict[int, int] = field(default_factory=dict)  # global rank -> seq (0: none)
    pending: dict[int, list[str]] = field(default_factory=dict)   # global rank -> its unfinished calls
    behind: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)               # ranks of the group without a dump
    mismatches: list[str] = field(default_factory=list)


def _call(entry: dict) -> Call:
    dtype = entry["input_dtypes"][0] if entry["input_dtypes"] else ""
    return Call(_SAME_OP.get(entry["profiling_name"], entry["profiling_name"]),
                tuple(map(tuple, entry["input_sizes"])), tuple(map(tuple, entry["output_sizes"])), dtype)


def _describe(entry: dict) -> str:
    error = f": {entry['error'][:200]}" if entry["error"] else ""
    return f"seq {entry['collective_seq_id']} {_call(entry)} {entry['state']}{error}"


def analyze(dumps: dict[int, dict]) -> list[GroupReport]:
    """One report per group found in any dump; a group is its global ranks and
    its id ([Note: group ids] in recorder.py)."""
    groups: dict[tuple, dict[int, dict]] = {}  # (global ranks, group id) -> global rank -> its part of its dump
    for rank, dump in dumps.items():
        for group in dump["groups"]:
            groups.setdefault((tuple(group["global_ranks"]), group["group_id"]), {})[rank] = group
    return [_analyze_group(group_id, parts) for (_, group_id), parts in sorted(groups.items())]


def _analyze_group(group_id: int, parts: dict[int, dict]) -> GroupReport:
    first = next(iter(parts.values()))
    report = GroupReport(group_id, first["global_ranks"], first["transport"])
    report.missing = [r for r in first["global_ranks"] if r not in parts]
    calls: dict[int, dict[Call, list[int]]] = {}  # seq -> call -> ranks
    for rank, part in sorted(parts.items()):
        done = [e["collective_seq_id"] for e in part["entries"] if e["state"] == "completed"]
        report.last_completed[rank] = max(done, default=0)
        report.pending[rank] = [_describe(e) for e in part["entries"] if e["state"] != "completed"]
        for entry in part["entries"]:
            calls.setdefault(entry["collective_seq_id"], {}).setdefault(_call(entry), []).append(rank)
    ahead = max(report.last_completed.values())
    report.behind = sorted({r for r, seq in report.last_completed.items() if seq < ahead} | set(report.missing))
    for seq, variants in sorted(calls.items()):
        if len(variants) > 1:
            what = "; ".join(f"{call} on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
                             for call, ranks in sorted(variants.items(), key=lambda kv: -len(kv[1])))
            report.mismatches.append(f"seq {seq}: {what}")
    return report


def render(directory: str, dumps: dict[int, dict], reports: list[GroupReport], *, run_id: str = NO_RUN_ID,
           unreadable: list[Unreadable] = ()) -> str:
    lines = [f"ringcomm trace {directory}: run {run_id}, dumps from ranks {', '.join(map(str, sorted(dumps)))}"]
    if unreadable:
        lines.append(f"  {len(unreadable)} file{'s' * (len(unreadable) > 1)} left out, the analysis below is of the "
                     f"other dumps:")
        lines += [f"  left out {path}: {reason}" for path, reason in unreadable]
    unreadable_ranks = {_rank_of_file(path) for path, _ in unreadable}
    for rank, dump in sorted(dumps.items()):
        lines.append(f"  rank {rank} (pid {dump['pid']} on {dump['hostname']}): {dump['reason']}")
    for report in reports:
        ranks = report.global_ranks
        span = f"{ranks[0]}..{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ", ".join(map(str, ranks))
        lines.append(f"group {report.group_id} (global ranks {span}, {report.transport}):")
        lines.append("  last completed seq: " + ", ".join(f"rank {r}: {s}" for r, s in report.last_completed.items()))
        for rank, pending in report.pending.items():
            for text in pending:
                lines.append(f"  rank {rank}: {text}")
        for rank in report.missing:
            why = "its file was left out (above)" if rank in unreadable_ranks else \
                "no dump (stopped, stuck outside ringcomm, or dead)"
            lines.append(f"  rank {rank}: {why}")
        if report.behind:
            lines.append(f"  behind: rank{'s' * (len(report.behind) > 1)} {', '.join(map(str, report.behind))}")
        for mismatch in report.mismatches:
            lines.append(f"  MISMATCH {mismatch}")
        if not (report.behind or report.mismatches):
            lines.append("  all ranks agree")
    return "\n".join(lines)


def _rank_of_file(path: str) -> int | None:
    """The rank in a dump's file name (ringcomm_trace_rank_<rank>.json), if any."""
    digits = os.path.basename(path).removeprefix(FILE_PREFIX).removesuffix(".json")
    return int(digits) if digits.isdigit() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.observe.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the folder of the ranks' dumps (RINGCOMM_TRACE_DIR, else "
                                          "<tmp>/ringcomm-trace-<uid>/<run id>)")
    parser.add_argument("--run", metavar="RUN_ID", help="analyze this run's dumps when the folder holds several runs")
    args = parser.parse_args(argv)
    try:
        folder = scan(args.directory)
        dumps = folder.select(args.run)
    except MixedRunsError as err:
        print(err, file=sys.stderr)
        return 2
    except OSError as err:  # no folder, or nothing readable in it
        print(err, file=sys.stderr)
        return 1
    run_id = args.run or next(iter(folder.runs))
    print(render(args.directory, dumps, analyze(dumps), run_id=run_id, unreadable=folder.unreadable))
    return 0


if __name__ == "__main__":
    sys.exit(main())
