"""Every transport class implements every member of the Transport protocol
(ringcomm.transport.base), so callers use each capability directly instead of
probing for it with getattr; where a transport lacks one, it says so (None, "").
Checked on the classes, without processes: their attributes, the attributes
their methods set on self, and the keyword names of the protocol's methods."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest

from ringcomm.transport.base import Transport

# Transport modules import torch.distributed and the extension; walking the rooms
# finds every class named *Transport, so a new one is checked without listing it.
ROOMS = ("transport", "algorithms")


def transport_classes() -> list[type]:
    found = {}
    for room in ROOMS:
        package = importlib.import_module(f"ringcomm.{room}")
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"ringcomm.{room}.{info.name}")
            for name, value in vars(module).items():
                if inspect.isclass(value) and name.endswith("Transport") and value.__module__ == module.__name__ \
                        and value is not Transport:
                    found[f"{value.__module__}.{name}"] = value
    return [found[name] for name in sorted(found)]


def protocol_members() -> set[str]:
    members = set(Transport.__annotations__)
    members |= {name for name in vars(Transport) if not name.startswith("_")}
    return members


def attributes(cls: type) -> set[str]:
    """The class's attributes, inherited ones included, and the names its methods assign on self."""
    names = set(dir(cls))
    for klass in cls.__mro__[:-1]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
                        names.add(item.attr)
    return names


def test_the_transports_are_found() -> None:
    names = {cls.__name__ for cls in transport_classes()}
    assert {"ShmTransport", "TorchDistTransport", "HierarchicalTransport"} <= names, names


@pytest.mark.parametrize("cls", transport_classes(), ids=lambda cls: cls.__name__)
def test_every_transport_implements_the_protocol(cls: type) -> None:
    missing = protocol_members() - attributes(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)} of the Transport protocol"
    for name in protocol_members():
        declared = vars(Transport).get(name)
        if not inspect.isfunction(declared):
            continue
        implemented = getattr(cls, name)
        assert callable(implemented), f"{cls.__name__}.{name} is not a method"
        want = set(inspect.signature(declared).parameters)
        got = set(inspect.signature(implemented).parameters)
        assert want <= got, f"{cls.__name__}.{name}{inspect.signature(implemented)} lacks {sorted(want - got)}"


def test_the_protocol_declares_what_callers_use() -> None:
    """The capabilities the callers read (the lean handle, the levels, the allocator, ...) are protocol members."""
    assert {"describe", "handle", "levels", "broken", "peer_aborted", "p2p", "kind", "allocate", "timeout_s",
            "mismatch_error", "supports", "close", "abort"} <= protocol_members()


class Bare:
    """A transport that lacks most of the protocol."""

    kind = "bare"

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1


def test_a_missing_member_is_caught() -> None:
    """The check above fails for a transport that lacks a member."""
    assert {"kind", "rank", "world_size"} <= attributes(Bare)
    assert protocol_members() - attributes(Bare) >= {"handle", "levels", "describe", "broken", "peer_aborted"}
