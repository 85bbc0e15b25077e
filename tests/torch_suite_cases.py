"""PyTorch's own distributed tests (DistributedTest._DistTestBase, shipped in the
torch wheel) as a pytest module, run by tests/torch_suite.py in a subprocess per
backend and world size; not collected by the plain test run.

[Note: gated as gloo, run on the backend under test]
The suite picks its tests by the env var BACKEND, mostly in decorators that it
evaluates at import. This module imports it with BACKEND=gloo, so the selection
is exactly gloo's, then sets the suite's BACKEND global to the backend under
test (TORCH_SUITE_BACKEND), which every process group the suite creates by name
reads at run time: the default group, the group of test_barrier_timeout_global,
and the name test_get_backend expects from dist.get_backend(). Subgroups made by
dist.new_group() inherit the default group's backend.
At run time the suite gates on the name in three ways: one helper picks its
model by `BACKEND == "gloo"` (run gated as gloo, below); profiler events named
"<backend>:<op>" are checked only for backends in its PROFILING_SUPPORTED_BACKENDS
lists, and DDP's gloo logging fields only for gloo. ringcomm is not in those
lists, so by default those tests check its results but not its events;
TORCH_SUITE_PROFILER_EVENTS=1 adds it, so they check its "ringcomm:<op>" events
too (and then a missing event fails the test before its results are checked).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

SUITE_GATING_BACKEND = "gloo"
BACKEND_UNDER_TEST = os.environ.get("TORCH_SUITE_BACKEND", "ringcomm")

os.environ["BACKEND"] = SUITE_GATING_BACKEND
os.environ.setdefault("WORLD_SIZE", "2")
# file:// as upstream's "gloo with init file" run (it enables the barrier timeout
# tests); run_suite passes one in its temporary directory.
os.environ.setdefault("INIT_METHOD", f"file://{tempfile.mkdtemp(prefix='torch-suite-')}/shared_init_file")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed import distributed_test as suite  # noqa: E402

from ringcomm.backend.process_group import ProcessGroupRingcomm

suite.BACKEND = BACKEND_UNDER_TEST
if os.environ.get("TORCH_SUITE_PROFILER_EVENTS") == "1":
    for profiled in (suite.PROFILING_SUPPORTED_BACKENDS, suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        if BACKEND_UNDER_TEST not in profiled:
            profiled.append(BACKEND_UNDER_TEST)


@contextmanager
def gated_as_gloo() -> Iterator[None]:
    """For suite helpers that pick their model by `BACKEND == "gloo"` at run time."""
    suite.BACKEND = SUITE_GATING_BACKEND
    try:
        yield
    finally:
        suite.BACKEND = BACKEND_UNDER_TEST
if os.environ.get("TORCH_SUITE_PROFILER_EVENTS") == "1":
    for profiled in (suite.PROFILING_SUPPORTED_BACKENDS, suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        if BACKEND_UNDER_TEST not in profiled:
            profiled.append(BACKEND_UNDER_TEST)


class TestTorchSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
    """The suite's tests; ranks are forked from this process (the suite's module
    is imported once), as upstream's former test_distributed_fork.py did."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def _test_accumulate_gradients_no_sync(self, *args, **kwargs):
        with gated_as_gloo():
            return super()._test_accumulate_gradients_no_sync(*args, **kwargs)

    def test_backend_under_test(self) -> None:
        """Not from the suite: its groups, the world and subgroups, are the backend under test."""
        subgroup = dist.new_group()
        for group in (dist.group.WORLD, subgroup):
            self.assertEqual(dist.get_backend(group), BACKEND_UNDER_TEST)
            self.assertEqual(isinstance(group, ProcessGroupRingcomm), BACKEND_UNDER_TEST == "ringcomm")
        tensor = torch.ones(3)
        dist.all_reduce(tensor, group=subgroup)
        self.assertEqual(tensor, torch.full((3,), float(dist.get_world_size())))
