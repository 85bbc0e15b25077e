"""The house rules of shared/STYLE.md that a reader can check by counting: no
module of ringcomm/ or zero/ over 400 lines, no function over 60; every room of
both packages says in its docstring what it owns; and imports run one way: a
room imports only from rooms below it in ROOMS (the one place the order is
written), never up, so no two rooms import each other."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("ringcomm", "zero") for p in (ROOT / d).rglob("*.py"))
# Each package's rooms, lowest first. A module directly in the package (its
# face: __init__.py, zero's DeepSpeed-named modules) sits above every room.
ROOMS = {
    "ringcomm": ("plan", "core", "kernels", "observe", "transport", "algorithms", "comm", "buckets", "backend"),
    "zero": ("parsing", "optim", "checkpoint", "monitor", "sharding", "offload", "activation", "estimate", "runtime"),
}
PACKAGES = tuple(ROOMS)  # lowest first too: zero is built on ringcomm
EXTENSION = "ringcomm._C"  # the compiled module: below every room


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"{path.relative_to(ROOT)}: functions over 60 lines: {long}"


@pytest.mark.parametrize("room", [f"{package}/{room}" for package, rooms in ROOMS.items() for room in rooms])
def test_each_room_says_what_it_owns(room: str) -> None:
    package = ROOT / room
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    assert len(doc.split()) >= 15, f"{room}/__init__.py: a docstring of what the room owns, got {doc!r}"
    modules = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
    unnamed = {m for m in modules if f"{m}.py" not in doc}
    assert not unnamed, f"{room}: the docstring names no role for {sorted(unnamed)}"


def test_every_folder_is_a_listed_room() -> None:
    """A new folder is placed in the order before anything is written in it."""
    for package, rooms in ROOMS.items():
        folders = {p.name for p in (ROOT / package).iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        assert folders == set(rooms), f"{package}/: folders {sorted(folders)} vs ROOMS {sorted(rooms)}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, text: str, modules: set[str]) -> set[str]:
    """Every module the source `text` at `path` imports, at module level or
    inside functions, as absolute names: `from . import x` names module x (of
    `modules`), `from .x import Name` module x."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            named = {f"{base}.{alias.name}" for alias in node.names} & modules
            found |= named or {base}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _rank(module: str) -> tuple[int, int] | None:
    """(package, room) position of a module, lowest first; None for a face."""
    if module == EXTENSION:
        return (PACKAGES.index("ringcomm"), -1)
    parts = module.split(".")
    rooms = ROOMS[parts[0]]
    if len(parts) >= 2 and parts[1] in rooms:
        return (PACKAGES.index(parts[0]), rooms.index(parts[1]))
    return None


def import_violations(sources: dict[Path, str]) -> list[str]:
    """Each import, in `sources` (path -> text), that runs up the order or into its own
    package's face (a lower package's face is its public interface)."""
    known = {_module_name(p) for p in sources} | {EXTENSION}
    bad = []
    for path, text in sources.items():
        here = _rank(_module_name(path))
        if here is None:
            continue  # a face may import every room of its package and the packages below
        for target in sorted(imports_of(path, text, known) & known):
            there = _rank(target)
            face_here = there is None and target.split(".")[0] == path.relative_to(ROOT).parts[0]
            if face_here or (there is not None and there > here):
                bad.append(f"{path.relative_to(ROOT)} imports {target}")
    return bad


def test_imports_run_one_way() -> None:
    """No room imports a room above it (so no cycle between rooms), nor a face."""
    bad = import_violations({p: p.read_text() for p in SOURCES})
    assert not bad, "imports against ROOMS:\n" + "\n".join(bad)


@pytest.mark.parametrize("probe, text, caught", [
    ("ringcomm/plan/_probe.py", "def f():\n    from ..backend import process_group\n", "ringcomm.backend.process_group"),
    ("ringcomm/transport/_probe.py", "from .. import comm\n", "ringcomm.comm"),
    ("ringcomm/kernels/_probe.py", "import ringcomm\n", "ringcomm"),
    ("ringcomm/core/_probe.py", "import zero.runtime.engine\n", "zero.runtime.engine"),
])
def test_the_check_sees_imports_that_run_up(probe: str, text: str, caught: str) -> None:
    """The check above can fail: an upward import, also inside a function, a
    face, and ringcomm importing zero are each caught."""
    sources = {p: p.read_text() for p in SOURCES} | {ROOT / probe: text}
    assert f"{probe} imports {caught}" in import_violations(sources)


COMPAT = ROOT / "ringcomm" / "core" / "compat.py"  # the one module that may call torch's private APIs
TORCH_NAMES = {"torch", "dist", "nn", "F"}  # how the packages spell torch and its submodules


def private_torch_uses(path: Path, text: str) -> list[str]:
    """Each import or attribute of torch's whose name is private (one leading underscore)."""
    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = (node.module or "").split(".") + [alias.name for alias in node.names]
            found += [f"{path.name}:{node.lineno} from {node.module} import"] if any(map(private, names)) else []
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in TORCH_NAMES:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_torch_private_apis_have_one_home() -> None:
    """torch's private APIs are called from ringcomm/core/compat.py only, so a
    torch release that moves one breaks one module."""
    bad = [use for path in SOURCES if path != COMPAT for use in private_torch_uses(path, path.read_text())]
    assert not bad, "torch's private APIs outside core/compat.py:\n" + "\n".join(bad)
    probe = "import torch.utils._pytree\nfrom torch.distributed import distributed_c10d\nx = dist.distributed_c10d._get_default_store()\n"
    assert len(private_torch_uses(ROOT / "probe.py", probe)) == 2, "the check must see both private uses"
