"""Arguments and RINGCOMM_* variables that would reach C++ (or a system call)
unchecked are refused in Python with an error that names them, their value and
what is allowed, never with pybind11's overload dump, std::bad_alloc or EINVAL."""
from __future__ import annotations

import pytest

from ringcomm import recorder


def new_recorder() -> recorder.FlightRecorder | None:
    """What every new group does first: its flight recorder, from the RINGCOMM_TRACE_* variables."""
    return recorder.for_group(0, 1, (0,), "shm", 1.0, None)


@pytest.mark.parametrize("name,why", [("KILL", "SIGKILL cannot be caught"), ("SIGSTOP", "SIGSTOP cannot be caught"),
                                      ("NOPE", "not a signal name"), ("segv", "SIGSEGV is a fault signal")])
def test_trace_signal_that_cannot_trigger_a_dump(monkeypatch, name, why) -> None:
    monkeypatch.setenv("RINGCOMM_TRACE_SIGNAL", name)
    with pytest.raises(ValueError, match=f"RINGCOMM_TRACE_SIGNAL='{name}'.*{why}"):
        new_recorder()


@pytest.mark.parametrize("value", ["1000000000000", str(2**63), "-1", "1e12", "64.0", "abc"])
def test_trace_buffer_size_outside_its_range(monkeypatch, value) -> None:
    monkeypatch.setenv("RINGCOMM_TRACE_BUFFER_SIZE", value)
    with pytest.raises(ValueError, match=rf"RINGCOMM_TRACE_BUFFER_SIZE='{value}' .*\[0, 1000000\]"):
        new_recorder()


def test_trace_stacks_is_1_or_0(monkeypatch) -> None:
    monkeypatch.setenv("RINGCOMM_TRACE_STACKS", "true")
    with pytest.raises(ValueError, match="RINGCOMM_TRACE_STACKS='true' must be 1 .* or 0"):
        new_recorder()
