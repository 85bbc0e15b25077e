"""DeepSpeed's logging in zero: the same 2-rank training script (tests/dropin_script.py)
on DeepSpeed and on zero with comms_logger, csv_monitor, tensorboard,
steps_per_print and wall_clock_breakdown on. Both log the same ops in
log_summary(); the monitors' files and tags are DeepSpeed's and hold the
training loss and lr of every step (read back, TensorBoard through its own
event reader). A monitor or flight recorder that cannot write is the same
ValueError at zero.initialize on every rank, naming the key and the path."""
from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import time

import pytest
from harness import run_ranks
from test_zero_dropin import load_script, needs_deepspeed

NUM_STEPS = 3


def monitored_config(script, stage: int, dtype: str, root: str) -> dict:
    return dict(script.config(stage, dtype),
                comms_logger={"enabled": True, "prof_all": True},
                csv_monitor={"enabled": True, "output_path": os.path.join(root, "csv"), "job_name": "job"},
                tensorboard={"enabled": True, "output_path": os.path.join(root, "tb"), "job_name": "job"},
                steps_per_print=1, wall_clock_breakdown=True)


def logged_ops(engine: str, deepspeed) -> dict[str, dict[int, int]]:
    """op -> message bytes -> count, from the engine's comms logger."""
    if engine == "zero":
        from zero.monitor.comms import LOGGER
        records = LOGGER.records
    else:
        records = deepspeed.comm.comms_logger.comms_dict
    return {name: {size: vals[0] for size, vals in sizes.items()} for name, sizes in records.items()}


def monitor_worker(rank: int, world_size: int, engine: str, root: str) -> dict:
    import warnings

    import torch

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    warnings.simplefilter("ignore")
    script = load_script(engine)
    script.deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = script.GPT()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ds_engine, *_ = script.deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=monitored_config(script, 3, "fp32", root))
        out = {"loss": [], "lr": []}
        for step in range(NUM_STEPS):
            losses = []
            for micro in range(script.ACCUMULATION):
                loss = ds_engine(*script.batch(step, micro, rank))
                ds_engine.backward(loss)
                ds_engine.step()
                losses.append(loss.item())
            out["loss"].append(sum(losses) / len(losses))
            out["lr"].append(ds_engine.get_lr()[0])
        ops = logged_ops(engine, script.deepspeed)
        script.deepspeed.comm.log_summary(show_straggler=True)
    out.update(ops=ops, printed=printed.getvalue(), samples=ds_engine.global_samples)
    return out


def read_csv(path: str) -> list[tuple[int, float]]:
    with open(path) as src:
        rows = list(csv.reader(src))
    return [(int(step), float(value)) for step, value in rows[1:]]


def read_tensorboard(directory: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(directory)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, list[dict]]]:
    out = {}
    for engine in ("deepspeed", "zero"):
        root = str(tmp_path_factory.mktemp(engine))
        out[engine] = root, run_ranks(monitor_worker, 2, engine, root, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    return out


def busbw_column(printed: str) -> list[float]:
    """The busbw_avg (Gbps) of each row of log_summary's table (its rows are indented; 0B rows left out)."""
    table = [line.split() for line in printed.split("Breakdown")[0].splitlines()
             if line.startswith(" " * 20) and not line.strip().startswith("0B")]
    return [float(row[-1]) for row in table]


@needs_deepspeed
@pytest.mark.slow
def test_log_summary_lists_the_ops_deepspeed_lists(runs) -> None:
    ours, theirs = runs["zero"][1][0], runs["deepspeed"][1][0]
    # DeepSpeed's stage 3 reduces with reduce_scatter_tensor and gathers with all_gather_into_tensor as zero does;
    # its barrier and its own bookkeeping all_reduces (overflow checks, norms) are its engine's, not zero's.
    shared = {"all_gather_into_tensor", "reduce_scatter_tensor"}
    assert shared <= set(ours["ops"]) and shared <= set(theirs["ops"]), (ours["ops"], theirs["ops"])
    for engine, result in (("zero", ours), ("deepspeed", theirs)):
        assert "Comm. Op" in result["printed"] and "busbw_avg (Gbps)" in result["printed"], engine
        assert "Breakdown with straggler effect" in result["printed"], engine
    busbw = busbw_column(ours["printed"])
    # Gbps on one host: none negative or absurd, the bigger messages above zero (8 B rounds to 0.00). How far above
    # is the machine's load's (quiet 1.1, a busy CI run 0.06); latencies logged 1000x too long print 0.00.
    assert busbw and all(0 <= value < 1e4 for value in busbw) and max(busbw) > 0, ours["printed"]
    with open(os.path.join(runs["zero"][0], "summary.txt"), "w") as out:  # for a person to compare
        out.write(ours["printed"] + "\n---- deepspeed ----\n" + theirs["printed"])


@needs_deepspeed
@pytest.mark.slow
def test_monitors_write_deepspeeds_files_and_tags(runs) -> None:
    ours_root, ours = runs["zero"]
    theirs_root, _ = runs["deepspeed"]
    ours_files = set(os.listdir(os.path.join(ours_root, "csv", "job")))
    theirs_files = set(os.listdir(os.path.join(theirs_root, "csv", "job")))
    assert "Train_Samples_lr.csv" in theirs_files, theirs_files
    # zero's reductions overlap backward: it has no backward_inner / backward_allreduce times to report
    overlapped = {"Train_Samples_elapsed_time_ms_backward_inner.csv",
                  "Train_Samples_elapsed_time_ms_backward_allreduce.csv"}
    assert theirs_files - overlapped <= ours_files, (theirs_files, ours_files)
    assert "Train_Samples_elapsed_time_ms_forward.csv" in ours_files, ours_files
    rank0 = ours[0]
    samples = [(step + 1) * rank0["samples"] // NUM_STEPS for step in range(NUM_STEPS)]
    loss_rows = read_csv(os.path.join(ours_root, "csv", "job", "Train_Samples_train_loss.csv"))
    lr_rows = read_csv(os.path.join(ours_root, "csv", "job", "Train_Samples_lr.csv"))
    assert [s for s, _ in loss_rows] == samples and [s for s, _ in lr_rows] == samples, (loss_rows, lr_rows)
    assert [v for _, v in loss_rows] == pytest.approx(rank0["loss"], rel=1e-6), (loss_rows, rank0["loss"])
    assert [v for _, v in lr_rows] == pytest.approx(rank0["lr"], rel=1e-6), (lr_rows, rank0["lr"])
    board = read_tensorboard(os.path.join(ours_root, "tb", "job"))
    assert [v for _, v in board["Train/Samples/train_loss"]] == pytest.approx(rank0["loss"], rel=1e-6), board
    assert [s for s, _ in board["Train/Samples/lr"]] == samples, board
    assert [v for _, v in board["Train/Samples/lr"]] == pytest.approx(rank0["lr"], rel=1e-6), board
    assert "[Rank 0] step=3, skipped=0" in rank0["printed"], rank0["printed"]
    assert "time (ms) | forward:" in rank0["printed"], rank0["printed"]


def missing_tensorboard_worker(rank: int, world_size: int) -> str:
    import builtins

    from zero_reference import engine_config, make_model

    import zero

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("tensorboard") or name == "torch.utils.tensorboard":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    import importlib.util
    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "tensorboard" else find_spec(name, *a)
    builtins.__import__ = no_tensorboard
    config = dict(engine_config(1, "fp32", 1, world_size), tensorboard={"enabled": True, "output_path": "/tmp/x"})
    try:
        zero.initialize(model=make_model("mlp"), config=config)
    except RuntimeError as err:
        return str(err)
    finally:
        builtins.__import__, importlib.util.find_spec = real_import, find_spec
    return "no error"


def test_tensorboard_configured_but_missing_is_a_clear_error() -> None:
    for rank, message in enumerate(run_ranks(missing_tensorboard_worker, 2, timeout=60)):
        assert "tensorboard.enabled needs the tensorboard package" in message, f"rank {rank}: {message}"


UNWRITABLE_S = 10.0  # an error comes at once; a rank left waiting for another would wait the agreement's 600 s


def unwritable_cases(root: str) -> list[tuple[str, dict, dict, str, str]]:
    """(case, config sections, environment, the key named, the path named): paths
    that root cannot write either (the tests run as root, whom chmod does not stop)."""
    under_file = os.path.join(root, "a-file", "logs")  # root/a-file is a regular file
    return [
        ("csv under a file", {"csv_monitor": {"enabled": True, "output_path": under_file}}, {},
         "csv_monitor.output_path", under_file),
        ("csv in /proc/self", {"csv_monitor": {"enabled": True, "output_path": "/proc", "job_name": "self"}}, {},
         "csv_monitor.output_path", "/proc/self"),
        ("tensorboard in /sys", {"tensorboard": {"enabled": True, "output_path": "/sys/zero-monitor-test"}}, {},
         "tensorboard.output_path", "/sys/zero-monitor-test"),
        ("flight recorder under a file", {}, {"RINGCOMM_TRACE_DIR": under_file}, "RINGCOMM_TRACE_DIR", under_file),
    ]


def unwritable_worker(rank: int, world_size: int, root: str) -> list[str]:
    """Each case's zero.initialize: a ValueError on this rank, soon; returns the messages."""
    import warnings

    from zero_reference import engine_config, make_model

    import zero

    messages = []
    for case, sections, env, key, path in unwritable_cases(root):
        os.environ.update(env)
        start = time.monotonic()
        try:
            with warnings.catch_warnings(), pytest.raises(ValueError) as caught:
                warnings.simplefilter("ignore")
                zero.initialize(model=make_model("mlp"), config=dict(engine_config(1, "fp32", 1, world_size), **sections))
        finally:
            for name in env:
                del os.environ[name]
        message, elapsed = str(caught.value), time.monotonic() - start
        assert key in message and path in message and elapsed < UNWRITABLE_S, \
            f"rank {rank} {case}: {elapsed:.1f} s: {message}"
        messages.append(message)
    return messages


def test_unwritable_outputs_fail_initialize_on_every_rank(tmp_path) -> None:
    with open(tmp_path / "a-file", "w") as f:
        f.write("not a folder")
    results = run_ranks(unwritable_worker, 2, str(tmp_path), timeout=60)
    denied = ("Operation not permitted", "Read-only file system", "Permission denied")  # /sys, as mounted here
    reasons = [("Not a directory",), ("No such file or directory",), denied, ("Not a directory",)]
    for (case, *_), reason, messages in zip(unwritable_cases(str(tmp_path)), reasons, zip(*results), strict=True):
        assert messages[0] == messages[1] and any(r in messages[0] for r in reason), f"{case}: {messages}"


def test_logging_options_are_checked() -> None:
    from zero.monitor.config import parse

    for raw, named in (({"csv_monitor": {"output_path": 3}}, "csv_monitor.output_path"),
                       ({"tensorboard": {"job_name": None}}, "tensorboard.job_name"),
                       ({"wandb": {"project": ["p"]}}, "wandb.project"),
                       ({"wandb": {"team": 1}}, "wandb.team"),
                       ({"comms_logger": {"prof_ops": ["all_reduce", 3]}}, "comms_logger.prof_ops")):
        with pytest.raises(ValueError, match=re.escape(named)):
            parse(raw)
