"""A representative part of PyTorch's own distributed test suite on the
"ringcomm" backend (tests/torch_suite.py): every selected test passes, or is an
expected failure with its reason. benchmarks/torch_suite.py runs all of it, on
gloo and ringcomm side by side. The suite has no CPU reduce-scatter test;
tests/test_backend.py has them."""
from __future__ import annotations

import pytest

from torch_suite import EXPECTED_FAILURES, Outcome, Status, error_line, expected_failure, run_suite

COLLECTIVES = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_max", "test_all_reduce_product",
    "test_all_reduce_full_group_sum", "test_all_reduce_sum_complex", "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_full_group_max", "test_sparse_all_reduce_sum",
    "test_all_gather", "test_all_gather_full_group", "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty", "test_broadcast", "test_broadcast_full_group",
    "test_reduce_sum", "test_gather", "test_scatter",
]
DDP = [
    "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
    "test_accumulate_gradients_no_sync", "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_ddp_create_graph", "test_static_graph_api_cpu", "test_ddp_logging_data_cpu",
    "test_grads_same_across_ranks_with_no_sync",
]
GROUPS = ["test_backend_under_test", "test_get_backend", "test_destroy_group", "test_get_rank_size_group",
          "test_all_gather_object_subgroup"]
BARRIER_AND_ASYNC = ["test_barrier", "test_barrier_full_group", "test_get_future", "test_isend", "test_irecv",
                     "test_batch_isend_irecv_gloo"]
SELECTION = COLLECTIVES + DDP + GROUPS + BARRIER_AND_ASYNC
POINT_TO_POINT = ["test_send_recv", "test_send_recv_any_source", "test_send_recv_with_tag", "test_isend", "test_irecv",
                  "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags"]
POINT_TO_POINT_PROFILED = [f"{name}_{profiler}" for name in ("test_send_recv", "test_send_recv_any_source",
                                                             "test_send_recv_with_tag", "test_isend")
                           for profiler in ("autograd_profiler", "torch_profiler")]


# Async calls (DDP's, async_op=True) inline with 2 ranks and on the comm thread
# with 3, on any machine: "auto" would pick by the usable cores (that choice:
# tests/test_backend.py::test_auto_async_mode_follows_the_usable_cores).
@pytest.mark.parametrize("world_size, async_mode", [pytest.param(2, "inline", marks=pytest.mark.slow), pytest.param(3, "thread", marks=pytest.mark.slow)])
def test_suite_selection_passes_on_ringcomm(world_size: int, async_mode: str, monkeypatch) -> None:
    monkeypatch.setenv("RINGCOMM_ASYNC", async_mode)
    selection = SELECTION + sorted(EXPECTED_FAILURES)
    run = run_suite("ringcomm", world_size, tests=selection)
    case = f"world_size {world_size}, RINGCOMM_ASYNC={async_mode}"
    assert sorted(run.outcomes) == sorted(selection), f"{case}: not run: {set(selection) - set(run.outcomes)}"
    wrong = {name: f"{o.status.value}: {o.message}" for name, o in run.outcomes.items() if not as_expected(name, o)}
    assert not wrong, f"{case}: {wrong}"


@pytest.mark.slow
def test_point_to_point_profiler_events() -> None:
    """The suite's point-to-point tests on the shm channels, also those that check
    the `ringcomm:send` / `ringcomm:recv` / `ringcomm:recvAnySource` profiler events."""
    selection = POINT_TO_POINT + POINT_TO_POINT_PROFILED
    run = run_suite("ringcomm", 2, tests=selection, profiler_events=True)
    assert sorted(run.outcomes) == sorted(selection), f"not run: {set(selection) - set(run.outcomes)}"
    wrong = {name: f"{o.status.value}: {o.message}" for name, o in run.outcomes.items() if o.status is not Status.PASSED}
    assert not wrong, wrong


def as_expected(name: str, outcome: Outcome) -> bool:
    """Passes, or fails as EXPECTED_FAILURES says; some of those run at world
    size 8 only and skip below it."""
    if name not in EXPECTED_FAILURES:
        return outcome.status is Status.PASSED
    return outcome.status is Status.SKIPPED or expected_failure(name, outcome) is not None


def test_error_line_names_the_first_failed_rank_error() -> None:
    report = "\n".join([
        "E   RuntimeError: Process 1 exited with error code 10 and exception:",
        "E   Traceback (most recent call last):",
        'E     File "x.py", line 3, in f',
        "E   RuntimeError: barrier: timed out after 1 s",
        "E   ",
        "E   During handling of the above exception, another exception occurred:",
        "E   ",
        "E   Traceback (most recent call last):",
        "E   AssertionError: ' timeout ' does not match 'barrier: timed out after 1 s'",
        "E   Process 0 exited with error code 10 and exception:",
        "E   ValueError: rank 0",
    ])
    assert error_line(report, "RuntimeError: Process 1 exited") == (
        "AssertionError: ' timeout ' does not match 'barrier: timed out after 1 s'")
    assert error_line("", "RuntimeError: Process 0 terminated or timed out after 120 seconds\nmore") == (
        "RuntimeError: Process 0 terminated or timed out after 120 seconds")
