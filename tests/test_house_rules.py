"""The house rules of shared/STYLE.md that a reader can check by counting: no
module of ringcomm/ or zero/ over 400 lines, no function over 60, and every
room of zero/ says in its docstring what it owns."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("ringcomm", "zero") for p in (ROOT / d).rglob("*.py"))
ROOMS = ("parsing", "optim", "checkpoint", "monitor", "sharding", "offload", "activation", "estimate", "runtime")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"{path.relative_to(ROOT)}: functions over 60 lines: {long}"


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_says_what_it_owns(room: str) -> None:
    package = ROOT / "zero" / room
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    assert len(doc.split()) >= 15, f"zero/{room}/__init__.py: a docstring of what the room owns, got {doc!r}"
    modules = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
    unnamed = {m for m in modules if f"{m}.py" not in doc}
    assert not unnamed, f"zero/{room}: the docstring names no role for {sorted(unnamed)}"
