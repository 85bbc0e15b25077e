"""Runs PyTorch's distributed test suite (tests/torch_suite_cases.py) on one
backend and world size in a pytest subprocess and reads each test's outcome from
its JUnit XML report; lists the tests expected to fail on ringcomm, with why."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_suite_cases.py")
CASE_CLASS = "TestTorchSuite"
BACKENDS = ("gloo", "ringcomm")
WORLD_SIZES = (2, 3)
TEST_TIMEOUT_S = 120  # per test, all ranks; the slowest suite test takes ~3 s here


class Status(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Status
    message: str = ""  # a failure's first error line, or why the test skipped


@dataclass(frozen=True, slots=True)
class SuiteRun:
    backend: str
    world_size: int
    outcomes: dict[str, Outcome]  # test name -> outcome
    wall_s: float

    def names(self, status: Status) -> list[str]:
        return sorted(name for name, outcome in self.outcomes.items() if outcome.status is status)


# [Note: expected failures]
# Tests of the suite that pass on gloo and fail on ringcomm, each for a reason
# that is a documented difference of the backend, not a bug.
# test_monitored_barrier_failure_order, test_monitored_barrier_wait_all_ranks and
# test_barrier_timeout_group run at world size 8 and up only (-w 8).
@dataclass(frozen=True, slots=True)
class ExpectedFailure:
    error: str  # a part of the error line the test fails with on ringcomm
    reason: str


_MONITORED_BARRIER = ExpectedFailure(
    "monitored_barrier is only implemented for GLOO backend",
    "dist.monitored_barrier() accepts only groups whose backend is named 'gloo'; group.monitored_barrier() "
    "on a ringcomm group runs on its internal gloo (test_monitored_barrier_gloo_rank_0_timeout passes)")
# Under TORCH_SUITE_PROFILER_EVENTS=1 (the suite checks "ringcomm:<op>" events):
# none; point-to-point records ringcomm:send / ringcomm:recv / ringcomm:recvAnySource
# (tests/test_torch_suite.py::test_point_to_point_profiler_events).
PROFILER_EXPECTED_FAILURES: dict[str, ExpectedFailure] = {}
EXPECTED_FAILURES: dict[str, ExpectedFailure] = {
    "test_monitored_barrier_gloo": _MONITORED_BARRIER,
    "test_monitored_barrier_gloo_subgroup": _MONITORED_BARRIER,
    "test_monitored_barrier_failure_order": _MONITORED_BARRIER,
    "test_monitored_barrier_wait_all_ranks": _MONITORED_BARRIER,
}


def expected_failure(name: str, outcome: Outcome) -> ExpectedFailure | None:
    """The entry of EXPECTED_FAILURES that explains this outcome, if one does."""
    expected = EXPECTED_FAILURES.get(name) or PROFILER_EXPECTED_FAILURES.get(name)
    if expected is None or outcome.status is not Status.FAILED or expected.error not in outcome.message:
        return None
    return expected


def run_suite(backend: str, world_size: int, *, tests: Sequence[str] = (), keyword: str | None = None,
              test_timeout_s: int = TEST_TIMEOUT_S, profiler_events: bool = False) -> SuiteRun:
    """Runs the suite's tests named in `tests` (all when empty), narrowed by a
    pytest -k `keyword`, on `backend` with `world_size` ranks; `profiler_events`:
    the suite checks "<backend>:<op>" profiler events on ringcomm as on gloo."""
    if backend not in BACKENDS:
        raise ValueError(f"run_suite: backend {backend!r} is not one of {BACKENDS}")
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        report = os.path.join(tmp, "junit.xml")
        targets = [f"{CASES}::{CASE_CLASS}::{name}" for name in tests] or [CASES]
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={report}",
                   f"--timeout={test_timeout_s + 60}", *targets] + (["-k", keyword] if keyword else [])
        env = {**os.environ, "TORCH_SUITE_BACKEND": backend, "WORLD_SIZE": str(world_size),
               "INIT_METHOD": f"file://{os.path.join(tmp, 'shared_init_file')}",
               "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(test_timeout_s),
               "PYTORCH_PRINT_REPRO_ON_FAILURE": "0", "TORCH_SUITE_PROFILER_EVENTS": str(int(profiler_events))}
        start = time.monotonic()
        result = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
        wall_s = time.monotonic() - start
        if not os.path.exists(report):  # pytest could not collect or start
            raise RuntimeError(f"torch suite on {backend}, world_size {world_size}: pytest exited "
                               f"{result.returncode} without a report:\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
        return SuiteRun(backend, world_size, read_junit(report), wall_s)


def read_junit(path: str) -> dict[str, Outcome]:
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            outcomes[case.get("name")] = Outcome(Status.FAILED, error_line(failure.text or "", failure.get("message")))
        elif skipped is not None:
            outcomes[case.get("name")] = Outcome(Status.SKIPPED, skipped.get("message") or "")
        else:
            outcomes[case.get("name")] = Outcome(Status.PASSED)
    return outcomes


def error_line(text: str, fallback: str | None) -> str:
    """The error of the first rank that failed: the last exception line of its
    traceback (the suite raises one RuntimeError holding every failed rank's
    traceback), else the first line of the report's message."""
    lines = [_PYTEST_ERROR_PREFIX.sub("", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if _RANK_FAILED.match(line)]
    if starts:
        end = starts[1] if len(starts) > 1 else len(lines)
        errors = [line for line in lines[starts[0] + 1:end] if _EXCEPTION_LINE.match(line)]
        if errors:
            return errors[-1].strip()
    message = (fallback or text).strip()
    return message.splitlines()[0] if message else ""


_PYTEST_ERROR_PREFIX = re.compile(r"^E {1,11}")  # pytest marks each line of the error with "E" and indents it
_RANK_FAILED = re.compile(r"^(RuntimeError: )?Process \d+ exited with error code")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: |$)")
