"""Checks every config section shares: a ValueError naming the key for a bad
value, and the one warning for a key zero does not know. Standard library only."""
from __future__ import annotations

import json
import math
import os
import warnings

AUTO = "auto"


def load(config: str | os.PathLike | dict) -> dict:
    """A DeepSpeed config as a dict: a copy of one, or a JSON file read."""
    if isinstance(config, dict):
        return dict(config)
    with open(config) as f:
        return json.load(f)


def warn_unknown(section: dict, known: set[str], where: str) -> None:
    """Warns once per key of `section` not in `known`; `where` prefixes the key ("fp16.")."""
    for key in section:
        if key not in known:
            warnings.warn(f"zero config: unknown key {where}{key!r} ignored", stacklevel=3)


def as_int(value: object, key: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < minimum:
        raise ValueError(f"zero config: {key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def as_float(value: object, key: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"zero config: {key} must be a number >= {minimum}, got {value!r}")
    return float(value)


def as_bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"zero config: {key} must be true or false, got {value!r}")
    return value


def get(section: dict, key: str, default: object, auto: object) -> object:
    """section[key], or `default` when absent, or `auto` when it says "auto"."""
    value = section.get(key, default)
    return auto if value == AUTO else value


def section_of(raw: dict, key: str) -> dict:
    """raw[key] (an empty dict when absent), refused unless it is an object."""
    section = raw.get(key, {})
    if not isinstance(section, dict):
        raise ValueError(f"zero config: {key} must be an object, got {section!r}")
    return section
