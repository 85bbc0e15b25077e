"""Names of ringcomm's segments and windows in /dev/shm, and the sweep of those
whose set-up can no longer be running.

[Note: shm names] A name is in /dev/shm only while its group or window is set
up: the creator unlinks it within the set-up timeout of creating it (once every
rank mapped it, or on failure), and so does every rank that learned it and
failed. Only a name whose every rank died stays behind. So a name carries its
expiry, the wall-clock unix time after which no rank can still need it
(creation + set-up timeout + a margin), and the sweep removes expired names,
whoever made them. Pids would not do: /dev/shm may be shared by containers with
their own pid namespaces, where a live creator's pid means nothing here.
"""
from __future__ import annotations

import math
import os
import re
import secrets
import stat
import time

SHM_DIR = "/dev/shm"
NAME_PREFIX = "ringcomm-"
EXPIRY_MARGIN_S = 60.0  # clock steps and scheduling delays between creating a name and starting its timeout
_NAME = re.compile(re.escape(NAME_PREFIX) + r"exp(\d{1,12})-[0-9a-f]+")


def new_name(setup_timeout_s: float) -> str:
    """A fresh shm_open name for a segment whose set-up ends within `setup_timeout_s`."""
    expiry = math.ceil(time.time() + setup_timeout_s + EXPIRY_MARGIN_S)
    return f"/{NAME_PREFIX}exp{expiry}-{secrets.token_hex(8)}"


def expiry_of(filename: str) -> int | None:
    """The expiry (unix time) in a file name made by new_name; None for any other name."""
    match = _NAME.fullmatch(filename)
    return int(match.group(1)) if match else None


def remove_stale_segments(now: float | None = None) -> list[str]:
    """Unlink expired ringcomm names in /dev/shm: regular files of this user only.
    Never raises: anything it cannot parse, stat or remove is left alone."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return []
    removed = []
    for entry in entries:
        expiry = expiry_of(entry.name)
        if expiry is None or expiry >= now:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:
            continue
    return removed
