"""Reads every rank's flight recorder dump ([Note: flight recorder]) and says
where the ranks disagree: the last sequence number each rank completed, the
ranks behind (or without a dump), and calls that differ at one sequence number.

    python -m ringcomm.trace DIR      # DIR: RINGCOMM_TRACE_DIR of the job
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass, field

from .recorder import FILE_PREFIX

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


def load(directory: str) -> dict[int, dict]:
    """Global rank -> its dump."""
    dumps = {}
    for path in sorted(glob.glob(os.path.join(directory, f"{FILE_PREFIX}*.json"))):
        with open(path) as src:
            dump = json.load(src)
        dumps[dump["rank"]] = dump
    if not dumps:
        raise FileNotFoundError(f"ringcomm.trace: no {FILE_PREFIX}*.json files in {directory}")
    return dumps


def _call(entry: dict) -> Call:
    dtype = entry["input_dtypes"][0] if entry["input_dtypes"] else ""
    return Call(_SAME_OP.get(entry["profiling_name"], entry["profiling_name"]),
                tuple(map(tuple, entry["input_sizes"])), tuple(map(tuple, entry["output_sizes"])), dtype)


def _describe(entry: dict) -> str:
    error = f": {entry['error'][:200]}" if entry["error"] else ""
    return f"seq {entry['collective_seq_id']} {_call(entry)} {entry['state']}{error}"


def analyze(dumps: dict[int, dict]) -> list[GroupReport]:
    """One report per group found in any dump."""
    groups: dict[int, dict[int, dict]] = {}  # group id -> global rank -> the group's part of its dump
    for rank, dump in dumps.items():
        for group in dump["groups"]:
            groups.setdefault(group["group_id"], {})[rank] = group
    return [_analyze_group(group_id, parts) for group_id, parts in sorted(groups.items())]


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


def render(directory: str, dumps: dict[int, dict], reports: list[GroupReport]) -> str:
    lines = [f"ringcomm trace {directory}: dumps from ranks {', '.join(map(str, sorted(dumps)))}"]
    for rank, dump in sorted(dumps.items()):
        lines.append(f"  rank {rank} (pid {dump['pid']} on {dump['hostname']}): {dump['reason']}")
    for report in reports:
        ranks = report.global_ranks
        lines.append(f"group {report.group_id} (global ranks {ranks[0]}..{ranks[-1]}, {report.transport}):")
        lines.append("  last completed seq: " + ", ".join(f"rank {r}: {s}" for r, s in report.last_completed.items()))
        for rank, pending in report.pending.items():
            for text in pending:
                lines.append(f"  rank {rank}: {text}")
        for rank in report.missing:
            lines.append(f"  rank {rank}: no dump (stopped, stuck outside ringcomm, or dead)")
        if report.behind:
            lines.append(f"  behind: rank{'s' * (len(report.behind) > 1)} {', '.join(map(str, report.behind))}")
        for mismatch in report.mismatches:
            lines.append(f"  MISMATCH {mismatch}")
        if not (report.behind or report.mismatches):
            lines.append("  all ranks agree")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcomm.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the folder of the ranks' dumps (RINGCOMM_TRACE_DIR)")
    args = parser.parse_args(argv)
    dumps = load(args.directory)
    print(render(args.directory, dumps, analyze(dumps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
