"""The DeepSpeed config sections of zero's logging, parsed and checked:
comms_logger, csv_monitor, tensorboard, wandb, wall_clock_breakdown and
steps_per_print, with DeepSpeed's defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..parsing.values import section_of, warn_unknown

COMMS_KEYS = {"enabled", "verbose", "prof_all", "prof_ops", "debug"}
MONITOR_KEYS = {"csv_monitor": {"enabled", "output_path", "job_name"},
                "tensorboard": {"enabled", "output_path", "job_name"},
                "wandb": {"enabled", "group", "team", "project"}}
DEFAULT_JOB_NAME = "DeepSpeedJobName"


@dataclass(frozen=True, slots=True)
class MonitorOptions:
    """One monitor: enabled, where (csv_monitor, tensorboard) or which project (wandb)."""

    enabled: bool = False
    output_path: str = ""  # csv_monitor / tensorboard: files go to output_path/job_name
    job_name: str = DEFAULT_JOB_NAME
    project: str = "deepspeed"  # wandb
    group: str | None = None
    team: str | None = None


@dataclass(frozen=True, slots=True)
class MonitoringConfig:
    comms_logger: dict = field(default_factory=dict)  # the section as given: CommsLogger.configure reads it
    csv_monitor: MonitorOptions = field(default_factory=MonitorOptions)
    tensorboard: MonitorOptions = field(default_factory=MonitorOptions)
    wandb: MonitorOptions = field(default_factory=MonitorOptions)
    wall_clock_breakdown: bool = False  # print forward / backward / step times every steps_per_print steps
    steps_per_print: int | None = None  # DeepSpeed's progress line every N steps (None: never)


def _section(raw: dict, key: str, known: set[str]) -> dict:
    section = section_of(raw, key)
    warn_unknown(section, known, f"{key}.")
    for flag in ("enabled", "verbose", "prof_all", "debug"):
        if flag in section and not isinstance(section[flag], bool):
            raise ValueError(f"zero config: {key}.{flag} must be true or false, got {section[flag]!r}")
    return section


def _monitor(raw: dict, key: str) -> MonitorOptions:
    section = _section(raw, key, MONITOR_KEYS[key])
    options = MonitorOptions(**{name: section[name] for name in MONITOR_KEYS[key] if name in section})
    for name in sorted(MONITOR_KEYS[key] - {"enabled"}):
        value, optional = getattr(options, name), name in ("group", "team")  # wandb's may be null
        if not isinstance(value, str) and not (optional and value is None):
            raise ValueError(f"zero config: {key}.{name} must be a string{' or null' if optional else ''}, "
                             f"got {value!r}")
    return options


def parse(raw: dict) -> MonitoringConfig:
    comms = _section(raw, "comms_logger", COMMS_KEYS)
    prof_ops = comms.get("prof_ops", [])
    if not isinstance(prof_ops, list) or not all(isinstance(op, str) for op in prof_ops):
        raise ValueError(f"zero config: comms_logger.prof_ops must be a list of op names, got {prof_ops!r}")
    breakdown = raw.get("wall_clock_breakdown", False)
    if not isinstance(breakdown, bool):
        raise ValueError(f"zero config: wall_clock_breakdown must be true or false, got {breakdown!r}")
    every = raw.get("steps_per_print")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"zero config: steps_per_print must be an integer >= 1, got {every!r}")
    return MonitoringConfig(comms_logger=dict(comms), csv_monitor=_monitor(raw, "csv_monitor"),
                            tensorboard=_monitor(raw, "tensorboard"), wandb=_monitor(raw, "wandb"),
                            wall_clock_breakdown=breakdown, steps_per_print=every)
