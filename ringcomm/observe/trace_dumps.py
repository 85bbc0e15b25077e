"""Reads a folder of flight recorder dumps for the analyzer (trace.py): checks
each file against the dump format, names every file it leaves out and why, and
keeps the dumps of different runs apart ([Note: run id] in recorder.py)."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from .recorder import FILE_PREFIX, VERSION

# What the analyzer reads of a dump, and the JSON type of each field; others are ignored.
_DUMP_FIELDS = {"version": str, "rank": int, "pid": int, "hostname": str, "reason": str, "time_ns": int,
                "groups": list}
_GROUP_FIELDS = {"group_id": int, "global_ranks": list, "transport": str, "entries": list}
_ENTRY_FIELDS = {"collective_seq_id": int, "profiling_name": str, "input_sizes": list, "output_sizes": list,
                 "input_dtypes": list, "state": str, "error": str}
_JSON_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean", type(None): "null"}
VERSIONS = ("ringcomm-trace-1", VERSION)  # -1 dumps carry no run id
NO_RUN_ID = "(none)"  # the run of -1 dumps


class MixedRunsError(ValueError):
    """A folder holds dumps of several runs and none was chosen, or not the one chosen."""


class Unreadable(NamedTuple):
    path: str
    reason: str


class Dump(NamedTuple):
    path: str
    data: dict


@dataclass(slots=True)
class Folder:
    """The dumps of one folder: the readable ones by run id and global rank, and
    the files left out, each with the reason."""

    directory: str
    runs: dict[str, dict[int, Dump]] = field(default_factory=dict)
    unreadable: list[Unreadable] = field(default_factory=list)

    def select(self, run_id: str | None = None) -> dict[int, dict]:
        """Global rank -> its dump, of `run_id`, or of the folder's one run."""
        if not self.runs:
            raise FileNotFoundError(self._nothing_readable())
        if run_id is None and len(self.runs) > 1:
            raise MixedRunsError(f"ringcomm.observe.trace: {self.directory} holds dumps of {len(self.runs)} runs, which are "
                                 f"never merged; pick one with --run RUN_ID:\n{self.describe_runs()}")
        if run_id is not None and run_id not in self.runs:
            raise MixedRunsError(f"ringcomm.observe.trace: {self.directory} holds no dump of run {run_id!r}; it holds:\n"
                                 f"{self.describe_runs()}")
        run = self.runs[next(iter(self.runs)) if run_id is None else run_id]
        return {rank: dump.data for rank, dump in sorted(run.items())}

    def describe_runs(self) -> str:
        """One line per run: its ranks, when its newest dump was written, its files."""
        lines = []
        for run_id, run in sorted(self.runs.items()):
            ranks = sorted(run)
            newest = _when(max(dump.data["time_ns"] for dump in run.values()))
            lines.append(f"  run {run_id} (rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}; newest dump "
                         f"{newest}): {', '.join(run[r].path for r in ranks)}")
        return "\n".join(lines)

    def _nothing_readable(self) -> str:
        if self.unreadable:
            return (f"ringcomm.observe.trace: none of the {len(self.unreadable)} dumps in {self.directory} is readable:\n"
                    + "\n".join(f"  {path}: {reason}" for path, reason in self.unreadable))
        runs = _folders_with_dumps(self.directory)
        hint = f"; its folders {', '.join(runs)} hold dumps (the default RINGCOMM_TRACE_DIR has one per run)" \
            if runs else ""
        return f"ringcomm.observe.trace: no {FILE_PREFIX}*.json files in {self.directory}{hint}"


def _when(time_ns: int) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time_ns / 1e9))
    except (OverflowError, OSError, ValueError):  # a time no clock shows
        return f"time_ns {time_ns}"


def load(directory: str, run_id: str | None = None) -> dict[int, dict]:
    """Global rank -> its dump, of the one run in `directory` (or of `run_id`);
    files that are not readable dumps are left out (scan() names them)."""
    return scan(directory).select(run_id)


def scan(directory: str) -> Folder:
    """Reads every dump file of `directory` (an OSError naming it when it is no folder)."""
    if not os.path.isdir(directory):
        raise (NotADirectoryError if os.path.exists(directory) else FileNotFoundError)(
            f"ringcomm.observe.trace: {directory} is not a folder")
    folder = Folder(directory)
    for path in _dump_paths(directory):
        try:
            data = read_dump(path)
        except ValueError as err:
            folder.unreadable.append(Unreadable(path, str(err)))
            continue
        run_id = data.get("run_id", NO_RUN_ID)
        first = folder.runs.setdefault(run_id, {}).get(data["rank"])
        if first is not None:
            folder.unreadable.append(Unreadable(path, f"a second dump of rank {data['rank']} of run {run_id} "
                                                      f"(the first: {first.path})"))
            continue
        folder.runs[run_id][data["rank"]] = Dump(path, data)
    return folder


def _dump_paths(directory: str) -> list[str]:
    with os.scandir(directory) as entries:
        return sorted(entry.path for entry in entries
                      if entry.name.startswith(FILE_PREFIX) and entry.name.endswith(".json") and entry.is_file())


def _folders_with_dumps(directory: str) -> list[str]:
    """The folders of `directory` that hold dump files (one per run under the default RINGCOMM_TRACE_DIR)."""
    found = []
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            try:
                if entry.is_dir() and _dump_paths(entry.path):
                    found.append(entry.name)
            except OSError:  # a folder this user may not read holds nothing to analyze
                continue
    return found


def read_dump(path: str) -> dict:
    """One rank's dump; a ValueError saying why `path` is not one."""
    try:
        with open(path, encoding="utf-8") as src:
            data = json.load(src)
    except OSError as err:
        raise ValueError(f"cannot be read ({err.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError("not text, so not a dump") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON, truncated or not a dump ({err.msg} at line {err.lineno} "
                         f"column {err.colno})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to be a dump") from None
    problem = _shape_error(data)
    if problem:
        raise ValueError(f"JSON of another shape than a flight recorder dump: {problem}")
    return data


def _shape_error(dump: object) -> str:
    """The first field of `dump` the analyzer cannot read ("" when none)."""
    problem = _fields_error(dump, _DUMP_FIELDS, "")
    if problem:
        return problem
    if dump["version"] not in VERSIONS:
        return f"version {dump['version']!r} is not one of {VERSIONS}"
    if dump["version"] != VERSIONS[0]:
        problem = _fields_error(dump, {"run_id": str}, "")
    for g, group in enumerate(dump["groups"]):
        where = f"groups[{g}]"
        problem = problem or _fields_error(group, _GROUP_FIELDS, where) \
            or _ints_error(group["global_ranks"], f"{where}.global_ranks", nonempty=True)
        for e, entry in enumerate(group["entries"] if not problem else []):
            problem = problem or _entry_error(entry, f"{where}.entries[{e}]")
    return problem


def _entry_error(entry: object, where: str) -> str:
    problem = _fields_error(entry, _ENTRY_FIELDS, where)
    for name in ("input_sizes", "output_sizes"):
        for i, sizes in enumerate(entry[name] if not problem else []):
            problem = problem or _ints_error(sizes, f"{where}.{name}[{i}]")
    if not problem and not all(isinstance(dtype, str) for dtype in entry["input_dtypes"]):
        problem = f"{where}.input_dtypes is not an array of strings"
    return problem


def _json_name(value: object) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _fields_error(obj: object, fields: dict[str, type], where: str) -> str:
    """`where`: the path of `obj` in the dump ("" for the dump itself)."""
    if not isinstance(obj, dict):
        return f"{where or 'the file'} is {_json_name(obj)}, not an object"
    for name, kind in fields.items():
        if name not in obj:
            return f"{where or 'the dump'} has no {name!r}"
        if not isinstance(obj[name], kind) or (kind is int and isinstance(obj[name], bool)):
            return f"{where + '.' if where else ''}{name} is {_json_name(obj[name])}, not {_JSON_NAMES[kind]}"
    return ""


def _ints_error(values: object, where: str, *, nonempty: bool = False) -> str:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return f"{where} is not an array of integers"
    return f"{where} is empty" if nonempty and not values else ""
