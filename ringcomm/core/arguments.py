"""Checks of caller arguments and RINGCOMM_* variables before C++ sees them:
pybind11 refuses a float or an int beyond its C type with a dump of every
overload, and C++ may try to allocate whatever it is given. Each error names
the argument or variable, its value and what is allowed. Standard library only."""
from __future__ import annotations

import math
import numbers
import os

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def check_int_type(where: str, name: str, value: object) -> None:
    """`value` is an int, and not a bool (True would pass as 1); else a TypeError
    naming `name` and `where`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name}={value!r} must be an int, got {type(value).__name__}")


def check_int(where: str, name: str, value: object, low: int, high: int) -> None:
    """`value` is an int (not a bool) in [low, high]; else TypeError / ValueError
    naming `name` and `where`."""
    check_int_type(where, name, value)
    if not low <= value <= high:
        raise ValueError(f"{where}: {name}={value} is out of range: expected an int in [{low}, {high}]")


def check_number(where: str, name: str, value: object, low: float, high: float) -> None:
    """`value` is a real number (not a bool) in [low, high], so never NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name}={value!r} must be a number, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{where}: {name}={value} is out of range: expected a number in [{low}, {high}]")


def int_from_env(variable: str, default: int, low: int, high: int) -> int:
    """The integer in environment variable `variable` (`default` when unset or
    empty), which must lie in [low, high]."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = int(text, 10)
    except ValueError:
        raise ValueError(f"ringcomm: {variable}={text!r} is not an integer; expected one in [{low}, {high}]") from None
    if not low <= value <= high:
        raise ValueError(f"ringcomm: {variable}={text!r} is out of range: expected an integer in [{low}, {high}]")
    return value


def seconds_from_env(variable: str, default: float) -> float:
    """The positive, finite number of seconds in environment variable `variable`
    (`default` when unset or empty)."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"ringcomm: {variable}={text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"ringcomm: {variable}={text!r} must be a finite number of seconds > 0")
    return value


def flag_from_env(variable: str, default: bool) -> bool:
    """Environment variable `variable` as "1" (on) or "0" (off); `default` when
    unset or empty. Anything else ("false", "no") is refused rather than guessed."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"ringcomm: {variable}={text!r} must be 1 (on) or 0 (off)")
    return text == "1"
