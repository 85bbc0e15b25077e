"""zero/'s rooms (their order, lowest first, is test_house_rules.py's ROOMS,
which checks that every import runs down it) import nothing eagerly in their
__init__.py, the package face is lazy (`python -m zero.estimate` runs
without ringcomm), and the files zero's text names exist."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from test_house_rules import ROOMS

ROOT = Path(__file__).resolve().parents[1]
ZERO = ROOT / "zero"
ROOM_ORDER = ROOMS["zero"]
DEEPSPEED_FILES = {"zero_to_fp32.py"}  # DeepSpeed's, named for comparison


def test_rooms_import_nothing_eagerly() -> None:
    for room in ROOM_ORDER:
        tree = ast.parse((ZERO / room / "__init__.py").read_text())
        eager = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                 and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
        assert not eager, f"zero/{room}/__init__.py imports at import time: {eager}"


def test_files_named_in_zero_exist() -> None:
    names = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "build" not in p.parts}
    missing = [(str(p.relative_to(ROOT)), m) for p in sorted(ZERO.rglob("*.py"))
               for m in sorted(set(re.findall(r"\b([A-Za-z_0-9]+\.py)\b", p.read_text())))
               if m not in names and m not in DEEPSPEED_FILES]
    assert not missing, f"(module, a file it names that does not exist): {missing}"


def test_one_home_for_the_unknown_key_warning() -> None:
    homes = [str(p.relative_to(ROOT)) for p in ZERO.rglob("*.py") if "unknown key" in p.read_text()]
    assert len(homes) == 1, f"the unknown-key warning is written in {homes}"


BLOCKED = textwrap.dedent("""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ringcomm._C":
                raise ImportError(f"{name} is blocked (no compiled extension here)")
            return None

    sys.meta_path.insert(0, Block())
    sys.argv = ["zero.estimate", "--params", "1e9", "--ranks", "8"]
    import runpy
    try:
        runpy.run_module("zero.estimate", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        assert not e.code, e.code
    import zero
    assert callable(zero.estimate.estimate) and "initialize" in dir(zero)
    print("LOADED", sorted(m for m in sys.modules if m.startswith("ringcomm")))
""")


def test_estimate_runs_without_the_compiled_extension() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKED], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("LOADED [") and "ringcomm._C" not in lines[-1], lines[-1]
    table = "\n".join(lines)
    # 1e9 parameters, 8 ranks, fp16/bf16 + Adam: stage 0 holds 16 B per parameter, stage 3 16/8 (GB = 1e9 B)
    assert "1e+09 parameters, 8 ranks" in table, table
    assert re.search(r"^\s*0 \|\s+16\.0 GB", table, re.M) and re.search(r"^\s*3 \|\s+2\.0 GB", table, re.M), table


def test_the_lazy_face_keeps_deepspeeds_names() -> None:
    import zero
    from zero.activation import checkpointing
    from zero.runtime import build, config, engine
    from zero.sharding import init, policy

    assert zero.comm.init_distributed is zero.init_distributed and callable(zero.comm.all_reduce)
    assert zero.zero.Init is zero.Init is init.Init and zero.zero.GatheredParameters is zero.GatheredParameters
    assert zero.checkpointing.checkpoint is checkpointing.checkpoint and zero.checkpointing.configure
    assert (zero.EngineConfig, zero.parse, zero.ZeroEngine, zero.ShardingPolicy) == (
        config.EngineConfig, config.parse, engine.ZeroEngine, policy.ShardingPolicy)
    assert callable(zero.initialize) and callable(zero.add_config_arguments) and callable(build.build_engine)
    assert set(zero.__all__) <= set(dir(zero)), sorted(set(zero.__all__) - set(dir(zero)))
    try:
        zero.no_such_name
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("zero.no_such_name did not raise AttributeError")
