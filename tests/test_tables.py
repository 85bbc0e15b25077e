"""The tables and helpers Python and C++ share have one home each, and the
other side agrees with it: dtype, reduce-op and call-kind codes (ringcomm/core/ops.py
against csrc/cpu/common.h, csrc/cpu/shm.h, csrc/cuda/reduce.cu), chunk bounds
(ringcomm.plan.schedule against csrc/cpu/shm_plan.h), a process's state
(csrc/cpu/process.h, through ringcomm.core.host), the ring volume
(ringcomm.plan.schedule) and the stage table (zero.sharding.policy); the pure
planning modules import nothing but the standard library and each other."""
from __future__ import annotations

import ast
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringcomm import _C
from ringcomm.core import host
from ringcomm.plan import schedule
from ringcomm.core.ops import DTYPE_CODES, OP_KINDS, ReduceOp
from ringcomm.transport import agreement
from zero.estimate import memory_model as mm
from zero.sharding.policy import STAGES, ShardingPolicy

ROOT = Path(__file__).resolve().parents[1]


def cpp_enum(path: Path, name: str) -> dict[str, int]:
    """`enum [class] name [: type] { kFooBar = 0, ... }` as {"foo_bar": 0, ...}."""
    match = re.search(rf"enum\s+(?:class\s+)?{name}\s*(?::\s*\w+\s*)?\{{([^}}]*)\}}", path.read_text())
    assert match, f"{path}: no enum {name}"
    out = {}
    for entry in match.group(1).split(","):
        key, _, value = entry.strip().partition("=")
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key.strip().removeprefix("k")).lower()
        out[snake] = int(value)
    return out


@pytest.mark.parametrize("path", ["csrc/cpu/common.h", "csrc/cuda/reduce.cu"])
def test_dtype_and_reduce_op_codes_agree(path: str) -> None:
    dtypes = {name.replace("b_float", "bfloat"): code for name, code in cpp_enum(ROOT / path, "DType").items()}
    assert dtypes == {str(dtype).removeprefix("torch."): code for dtype, code in DTYPE_CODES.items()}
    assert cpp_enum(ROOT / path, "RedOp") == {op.name.lower(): op.value for op in ReduceOp}


def test_call_kinds_agree() -> None:
    assert cpp_enum(ROOT / "csrc/cpu/shm.h", "OpKind") == OP_KINDS


def test_call_key_lengths_agree() -> None:
    assert _C.CALL_KEY_LEN == agreement.KEY_LEN
    assert len(agreement.CallKey("all_gather", 1).values()) == agreement.KEY_LEN


def test_chunk_bounds_agree() -> None:
    rng = random.Random(0)
    cases = [(0, 1), (0, 5), (1, 4), (7, 7), (8, 3)] + [(rng.randrange(1 << 40), rng.randrange(1, 200))
                                                       for _ in range(200)]
    for numel, parts in cases:
        spans = schedule.chunk_bounds(numel, parts)
        assert [_C._balanced_chunk(numel, parts, i) for i in range(parts)] == [(s.begin, s.numel) for s in spans]
        assert spans[-1].end == numel and max(s.numel for s in spans) - min(s.numel for s in spans) <= 1


def test_process_states() -> None:
    """Running, stopped, a zombie (exited, not reaped) and a reaped pid."""
    assert host.process_state(os.getpid()) == "running"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_for(lambda: host.process_state(child.pid) == "stopped"), host.process_state(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        assert wait_for(lambda: host.process_state(child.pid) == "running"), host.process_state(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        assert wait_for(lambda: host.process_state(child.pid) == "exited"), "a zombie is not exited"
    finally:
        child.kill()
        child.wait()
    assert host.process_state(child.pid) == "exited"
    assert [host.process_state(pid) for pid in (0, -1, 1 << 40)] == ["running"] * 3  # not pids: not judged


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_usable_cores_follow_the_affinity_mask() -> None:
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert host.usable_cores() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert host.usable_cores() == len(before)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8])
def test_ring_volume(world_size: int) -> None:
    """Each rank sends (n-1)/n of the tensor per ring phase; all_reduce is two phases."""
    numel, n = 1200, world_size
    per_phase = numel * (n - 1) // n if n > 1 else 0
    assert [schedule.sent_numel(op, numel, n) for op in ("reduce_scatter", "all_gather", "all_reduce")] == \
        [per_phase, per_phase, 2 * per_phase]
    assert schedule.sent_numel("broadcast", numel, n) == (numel if n > 1 else 0)
    assert schedule.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert schedule.bus_factor("all_gather", n) == schedule.bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    with pytest.raises(ValueError, match="alltoall"):
        schedule.sent_numel("alltoall", numel, 4)


@pytest.mark.parametrize("stage", STAGES)
def test_stage_table(stage: int) -> None:
    """One table of what each stage shards, and the memory model and the step's traffic read it."""
    policy = ShardingPolicy.for_stage(stage)
    assert (policy.shard_optimizer, policy.shard_grads, policy.shard_params, policy.stage) == \
        (stage >= 1, stage >= 2, stage >= 3, stage)
    assert mm.comm_elements(1e9, 8, stage) == pytest.approx((3 if stage == 3 else 2) * 1e9 * 7 / 8)
    states = mm.model_states(1e9, 8, stage)
    assert (states.params_nbytes < 2e9, states.grads_nbytes < 2e9, states.optimizer_nbytes < 12e9) == \
        (policy.shard_params, policy.shard_grads, policy.shard_optimizer)


# The planning modules and the ringcomm/zero modules each may load when imported
# by itself in a fresh interpreter (the packages and rooms it sits in included).
PURE = {
    "ringcomm.plan.schedule": {"ringcomm", "ringcomm.core", "ringcomm.core.on_import", "ringcomm.plan"},
    "ringcomm.plan.layout": {"ringcomm", "ringcomm.core", "ringcomm.core.on_import", "ringcomm.plan",
                             "ringcomm.plan.schedule"},
    "zero.sharding.policy": {"zero", "zero.sharding"},
    "zero.estimate.memory_model": {"ringcomm", "ringcomm.core", "ringcomm.core.on_import", "ringcomm.plan",
                                   "ringcomm.plan.schedule", "zero", "zero.estimate", "zero.sharding",
                                   "zero.sharding.policy"},
}
_LIST_MODULES = "import importlib, sys; importlib.import_module(sys.argv[1]); print(' '.join(sorted(sys.modules)))"


def modules_loaded_by(module: str) -> set[str]:
    """Every module a fresh interpreter holds after importing `module` alone."""
    run = subprocess.run([sys.executable, "-c", _LIST_MODULES, module], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    return set(run.stdout.split())


@pytest.mark.parametrize("module", sorted(PURE))
def test_pure_modules_load_only_the_stdlib(module: str) -> None:
    """Importing a planning module loads the standard library and the modules
    named in PURE, nothing else (no torch, no extension): checked on what a
    fresh interpreter loaded, not on the source text."""
    loaded = modules_loaded_by(module) - modules_loaded_by("sys")  # less what the interpreter's start loads
    ours = {name for name in loaded if name.split(".")[0] in ("ringcomm", "zero")}
    assert ours == PURE[module] | {module}, f"{module} loads {sorted(ours - PURE[module] - {module})}"
    other = {name.split(".")[0] for name in loaded - ours}
    assert other <= set(sys.stdlib_module_names) | {"__future__"}, \
        f"{module} loads {sorted(other - set(sys.stdlib_module_names))}"


def test_one_home_each() -> None:
    """The core count, the /proc reading of a process's state and the enum codes are written once."""
    sources = [p for d in ("ringcomm", "zero", "csrc") for p in (ROOT / d).rglob("*")
               if p.suffix in (".py", ".cpp", ".h", ".cu")]
    homes = {"sched_getaffinity": {"ringcomm/core/host.py"}, '"/proc/" + std::to_string(pid)': {"csrc/cpu/process.cpp"},
             "torch.bfloat16: 2": {"ringcomm/core/ops.py"}, '"all_gather": 3': {"ringcomm/core/ops.py"}}
    for needle, expected in homes.items():
        found = {str(p.relative_to(ROOT)) for p in sources if needle in p.read_text()}
        assert found == expected, f"{needle!r} is written in {sorted(found)}"
