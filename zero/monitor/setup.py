"""zero's logging made at zero.initialize, before the comm and the buckets, with
the outcome agreed across ranks: see [Note: logging set-up]."""
from __future__ import annotations

import os

from ringcomm.observe import recorder

from ..checkpoint.barrier import failure, store_agree
from .config import MonitoringConfig
from .monitors import make_monitors, writable_folder
from .step_log import StepLog

SETUP_TIMEOUT_S = 600.0  # the longest a rank waits for the others' set-up (rank 0 may be starting wandb)

# [Note: logging set-up]
# What the logging writes is made where it is written, before training: the
# monitors (csv_monitor, tensorboard, wandb) on rank 0, which alone writes
# them, and the flight recorder's folder (RINGCOMM_TRACE_DIR, when set) on
# every rank, each of which dumps its own file there. A folder that cannot be
# made or written is a ValueError naming the key (or the variable), the path
# and the OS's reason. The ranks then agree through the checkpoints' store
# barrier (zero/checkpoint/barrier.py), so that a failure on one rank is the
# same error on every rank at zero.initialize, not rank 0's alone while the
# others go on to fail inside their first collective. The comms logger writes
# no file: its options are checked when the config is parsed, on every rank.


def check_trace_dir() -> None:
    """RINGCOMM_TRACE_DIR, when set and the flight recorder is on: made (0700,
    as a dump makes it) and writable, else ValueError naming the variable."""
    folder = os.environ.get("RINGCOMM_TRACE_DIR")
    if not folder or recorder.buffer_size() == 0:
        return
    try:
        writable_folder(folder, mode=0o700)
    except OSError as error:
        raise ValueError(f"ringcomm: RINGCOMM_TRACE_DIR={folder!r}: the flight recorder cannot write its dumps "
                         f"in {folder}: {error.strerror or error}") from error


def open_step_log(config: MonitoringConfig, rank: int) -> StepLog:
    """Collective: the step log with this rank's monitors, made on every rank
    or on none, the same error everywhere ([Note: logging set-up])."""
    what = "zero.initialize: the logging set-up"
    step_log, message, error = None, None, None
    try:
        check_trace_dir()
        step_log = StepLog(config, rank, make_monitors(config, rank))
    except Exception as caught:  # agreed on below
        message, error = f"{type(caught).__name__}: {caught}", caught
    failures = store_agree(what, SETUP_TIMEOUT_S, message)
    if failures:
        if step_log is not None:
            step_log.close()
        raise failure(what, failures) from error
    return step_log
