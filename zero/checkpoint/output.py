"""Where the converters (to_fp32.py, to_deepspeed.py) may write; see
[Note: a converter's output]."""
from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

# [Note: a converter's output]
# A conversion never writes into its source: an output that is the checkpoint,
# lies inside it or contains it is refused, comparing resolved paths
# (os.path.realpath: symlinks followed, `..` removed), so that a link to the
# checkpoint is the checkpoint. The checkpoint is both the path given and the
# tag directory it resolves to (which may be a link elsewhere). An output that
# exists and is not empty is refused unless the caller asks (--overwrite,
# overwrite=True). The output is written under a temporary name beside it
# (to_fp32: a hidden sibling file; to_deepspeed: OUT/.TAG.partial) and renamed
# into place; a failure removes the temporary and any folder the conversion
# made, so it leaves no half output.


def described(path: str) -> str:
    """`path`, and where it leads when a link or `..` takes it elsewhere."""
    real = os.path.realpath(path)
    return path if real == os.path.abspath(path) else f"{path} (resolved: {real})"


def _within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def check_outside(what: str, output: str, sources: Sequence[str]) -> None:
    """ValueError when `output` is one of `sources`, lies inside one or contains
    one (resolved paths; [Note: a converter's output])."""
    real_output = os.path.realpath(output)
    for source in sources:
        real_source = os.path.realpath(source)
        if real_output == real_source:
            how = "is"
        elif _within(real_output, real_source):
            how = "is inside"
        elif _within(real_source, real_output):
            how = "contains"
        else:
            continue
        raise ValueError(f"{what}: the output {described(output)} {how} the checkpoint {described(source)}: "
                         f"a conversion never writes into its source; choose an output outside it")


def check_empty(what: str, path: str, *, folder: bool, overwrite: bool) -> None:
    """ValueError when `path` is of the wrong kind (a folder where a file goes,
    or the reverse) or, unless `overwrite`, exists and is not empty."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) != folder:
        raise ValueError(f"{what}: the output {path} is {'not ' if folder else ''}a folder; "
                         f"{'a folder' if folder else 'a file'} is written there")
    if folder:
        entries = sorted(os.listdir(path))
        holds = f"a folder holding {', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}"
    else:
        entries = os.path.getsize(path) if os.path.exists(path) else 1  # a link to nothing is not empty
        holds = f"a file of {entries} bytes"
    if entries and not overwrite:
        raise ValueError(f"{what}: the output {path} is not empty ({holds}); pass --overwrite "
                         f"(overwrite=True) to write over it")


def first_missing(path: str) -> str | None:
    """The outermost folder of `path` that does not exist yet (what os.makedirs
    would make, and a failed conversion removes), or None."""
    path, missing = os.path.abspath(path), None
    while not os.path.lexists(path):
        missing, path = path, os.path.dirname(path)
    return missing


def remove_made(made: str | None) -> None:
    """Removes the folder a failed conversion made (first_missing's answer)."""
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def partial_file(path: str) -> str:
    """A hidden sibling of `path`, unique to this process, to write it under."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.partial")
