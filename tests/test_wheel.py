"""What works with `pip install -e` works from a wheel built from the sdist: the
sdist holds every source of csrc/, the wheel every package and the CUDA
sources, and installed in a fresh venv it runs from a folder outside the
checkout (imports, zero's command lines, a 2-rank all_reduce on the "ringcomm"
backend), and on older CPUs than this one, emulated by qemu-user
(tests/cpu_check.py: the slow tier)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

ALL_REDUCE = """
import os, torch, torch.distributed as dist, ringcomm
dist.init_process_group("ringcomm")
rank, world_size = dist.get_rank(), dist.get_world_size()
x = torch.full((1000,), rank + 1.0)
ringcomm.all_reduce(x)
y = torch.full((7,), rank + 1.0)
dist.all_reduce(y)
expected = world_size * (world_size + 1) / 2
assert torch.all(x == expected) and torch.all(y == expected), (rank, x[:3], y[:3])
ringcomm.destroy_default_group()
dist.destroy_process_group()
print(f"rank {rank}: all_reduce ok from {ringcomm.__file__}")
"""


def run(args: list, *, cwd: Path, timeout: float, env: dict | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout


def source_packages() -> set[str]:
    """Every package of the source tree, as a folder path with an __init__.py."""
    return {str(init.parent.relative_to(ROOT)) for top in ("ringcomm", "zero")
            for init in (ROOT / top).rglob("__init__.py") if "__pycache__" not in init.parts}


def clean_copy(target: Path) -> Path:
    """The checkout's files as git sees them (no build/ left by earlier builds,
    which setuptools would pack too)."""
    listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, timeout=60)
    for name in listed.splitlines():
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def test_every_folder_of_code_is_a_package_the_wheel_holds():
    """What the wheel will hold: every folder of ringcomm/ and zero/ with Python files has an
    __init__.py, and setuptools' discovery, with pyproject.toml's include, finds it (a new room
    without one would be left out of the wheel and work only from the source tree)."""
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = {name.replace(".", "/") for name in find_packages(str(ROOT), include=include)}
    with_code = {str(f.parent.relative_to(ROOT)) for top in ("ringcomm", "zero") for f in (ROOT / top).rglob("*.py")
                 if "__pycache__" not in f.parts}
    assert with_code <= found, f"folders of code the wheel would leave out: {sorted(with_code - found)}"


def built_sdist(source: Path, target: Path) -> Path:
    """The sdist of `source`, checked to hold every file of csrc/ that git tracks (a header or
    kernel left out builds from the checkout and fails from the sdist, as pip installs it)."""
    run([sys.executable, "setup.py", "-q", "sdist", "-d", target], cwd=source, timeout=300)
    (sdist,) = target.glob("ringcomm-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    tracked = set(run(["git", "ls-files", "csrc"], cwd=ROOT, timeout=60).split())
    assert tracked and tracked <= names, f"the sdist lacks {sorted(tracked - names)}"
    return sdist


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """The wheel built with the default settings from the sdist of a clean copy, unpacked into a
    fresh venv that sees torch and numpy (from this one) but not the checkout; its python."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    wheels = tmp_path / "wheels"
    sdist = built_sdist(clean_copy(tmp_path / "source"), tmp_path / "sdist")
    env = {k: v for k, v in os.environ.items() if k != "RINGCOMM_MARCH"}
    run([sys.executable, "-m", "pip", "wheel", sdist, "--no-deps", "-q", "-w", wheels], cwd=tmp_path, timeout=600,
        env=env)
    (wheel,) = wheels.glob("ringcomm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = {p for p in source_packages() if f"{p}/__init__.py" not in names}
    assert not missing, f"the wheel lacks packages {sorted(missing)}"
    cuda_sources = {f"ringcomm/cuda/{p.name}" for p in (ROOT / "csrc" / "cuda").glob("*.cu")}
    assert cuda_sources and cuda_sources <= names, f"the wheel lacks {sorted(cuda_sources - names)}"

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path,
                       timeout=60).strip())
    deps = {str(Path(m.__file__).resolve().parent.parent) for m in (torch, numpy)}
    (purelib / "deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    zipfile.ZipFile(wheel).extractall(purelib)  # a wheel without scripts or data installs as its files
    return python


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test to use installed_wheel builds it (its setup counts): ~4 minutes on a busy CI
def test_wheel_installs_and_runs_outside_the_checkout(installed_wheel, tmp_path):
    python = installed_wheel
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path,
                       timeout=60).strip())
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = run([python, "-c", "import torch, ringcomm, zero; "
                 "from ringcomm.kernels import cuda as cuda_kernels, cuda_quant, quant; "
                 "x = torch.linspace(-1, 1, 100); q = quant.quantize(x, bits=8, block=32); "
                 "y = quant.dequantize(*q, out=torch.empty(100), bits=8, block=32); "
                 "assert (y - x).abs().max() <= 1 / 254 + 1e-7, (y - x).abs().max(); "
                 "print(ringcomm.__file__, zero.__file__, cuda_kernels.SOURCE, cuda_quant.SOURCE, "
                 "cuda_kernels.SOURCE.is_file() and cuda_quant.SOURCE.is_file())"],
                cwd=work, timeout=120, env=env).split()
    assert all(path.startswith(str(purelib)) for path in where[:4]), f"not imported from the wheel: {where}"
    assert where[4] == "True", f"a CUDA source is missing: {where}"
    estimate = run([python, "-m", "zero.estimate", "--params", "1e9", "--ranks", "8"], cwd=work, timeout=120, env=env)
    assert "stage" in estimate.lower(), estimate
    assert "usage" in run([python, "-m", "zero.to_fp32", "--help"], cwd=work, timeout=120, env=env).lower()
    script = work / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    out = run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script], cwd=work,
              timeout=180, env=env)
    assert out.count("all_reduce ok") == 2 and str(purelib) in out, out


# CPUs older than this one, as qemu-user names them: AVX2 without AVX-512, and x86-64-v2 without AVX.
EMULATED_CPUS = {"Haswell": "avx2", "Nehalem": "default"}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the wheel's build, if first, and the emulated CPU's run (up to 900 s)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates x86-64 CPUs")
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None,
                    reason="qemu-x86_64 not installed (Debian's qemu-user; .ci/run installs it)")
@pytest.mark.parametrize("cpu", sorted(EMULATED_CPUS))
def test_wheel_computes_on_older_cpus(installed_wheel, tmp_path, cpu):
    """The wheel built on this machine runs its kernels bit-exactly on a CPU without AVX-512 and one
    without AVX: an extension compiled for this CPU alone dies there with SIGILL."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "RINGCOMM_CPU_CAPABILITY")}
    check = ROOT / "tests" / "cpu_check.py"
    result = subprocess.run(["qemu-x86_64", "-cpu", cpu, str(installed_wheel), str(check)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"-cpu {cpu}: exit {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    assert f"cpu check ok: capability={EMULATED_CPUS[cpu]} " in result.stdout, result.stdout
