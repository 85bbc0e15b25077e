"""ringcomm's package face (ringcomm/__init__.py): public names load their
module on first use, importing a plan loads no torch, and the backend
"ringcomm" is registered whichever of ringcomm and torch is imported first."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


REGISTERED = "'ringcomm' in torch.distributed.Backend.backend_list"


@pytest.mark.parametrize("order", ["ringcomm first", "torch first"])
def test_the_backend_registers_in_either_import_order(order: str) -> None:
    imports = "import ringcomm, sys; before = 'torch' in sys.modules; import torch.distributed" \
        if order == "ringcomm first" else "import torch.distributed, sys; before = True; import ringcomm"
    assert run_python(f"{imports}; import torch; print(before, {REGISTERED})") == \
        ("False True" if order == "ringcomm first" else "True True")


def test_torch_without_ringcomm_has_no_backend() -> None:
    """The check above can fail: torch alone knows no "ringcomm"."""
    assert run_python(f"import torch.distributed, torch; print({REGISTERED})") == "False"


def test_plans_load_no_torch() -> None:
    assert run_python("import sys, ringcomm.plan.schedule, ringcomm.plan.layout; print('torch' in sys.modules)") \
        == "False"


def test_every_public_name_resolves() -> None:
    """Each name in __all__ is where the face says, and unknown names raise AttributeError."""
    import ringcomm

    for name in ringcomm.__all__:
        assert getattr(ringcomm, name) is not None, name
    assert ringcomm.all_reduce.__module__ == "ringcomm.comm.collectives"
    assert ringcomm.process_group.__name__ == "ringcomm.backend.process_group"
    assert ringcomm.observe.__name__ == "ringcomm.observe"  # a room, by attribute, loaded on first use
    assert set(ringcomm.__all__) <= set(dir(ringcomm))
    with pytest.raises(AttributeError, match="no attribute 'all_reduse'"):
        ringcomm.all_reduse
