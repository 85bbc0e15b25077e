"""One build for every x86-64 CPU ([Note: CPU capabilities] in
csrc/cpu/cpu_capability.h): the library reports the kernels it runs,
RINGCOMM_CPU_CAPABILITY forces a lower build (and names itself when wrong),
nothing outside the wider builds uses an instruction the baseline lacks, and
the kernel tests pass under every build this CPU runs (the slow tier; the
other CPUs themselves are emulated in tests/test_wheel.py)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ringcomm
from ringcomm import _C

import isa_check

ROOT = Path(__file__).resolve().parent.parent
CAPABILITIES = ("default", "avx2", "avx512", "avx512_bf16")  # narrowest first
KERNEL_TESTS = ("tests/test_kernels.py", "tests/test_quant.py", "tests/test_host_step.py")


def start_python(code: str, capability: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RINGCOMM_CPU_CAPABILITY"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if capability is not None:
        env["RINGCOMM_CPU_CAPABILITY"] = capability
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_python(code: str, capabilities: list[str | None], timeout: float = 120) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `code` under each RINGCOMM_CPU_CAPABILITY, all at once."""
    procs = [start_python(code, capability) for capability in capabilities]
    outputs = [proc.communicate(timeout=timeout) for proc in procs]
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]


def test_the_library_reports_the_build_it_runs():
    found = ringcomm.cpu_capabilities()
    assert found.built[0] == "default" and list(found.built) == [c for c in CAPABILITIES if c in found.built], found
    assert found.supported[0] == "default" and set(found.supported) <= set(found.built), found
    assert found.active == ringcomm.cpu_capability() == _C.cpu_capability(), found
    if os.environ.get("RINGCOMM_CPU_CAPABILITY") is None:
        assert found.active == found.supported[-1], f"not the best build this CPU runs: {found}"
    if platform.machine() == "x86_64" and not found.march:
        pytest.fail(f"an x86-64 build without a baseline -march: {found}")


def test_the_variable_forces_a_lower_build_and_names_itself():
    found = ringcomm.cpu_capabilities()
    wider = list(CAPABILITIES[len(found.supported):])  # than this CPU runs: its best, as ATEN_CPU_CAPABILITY
    cases = [*found.supported, *wider, "avx-512"]
    results = run_python("import ringcomm; print(ringcomm.cpu_capability())", cases)
    for capability, (code, out, err) in zip(cases[:-1], results):
        expected = capability if capability in found.supported else found.supported[-1]
        assert code == 0 and out.split()[-1] == expected, (capability, expected, out, err[-2000:])
    code, _, err = results[-1]
    assert code != 0 and "ValueError: RINGCOMM_CPU_CAPABILITY=avx-512: expected one of" in err, err[-2000:]


def test_the_isa_check_finds_wider_instructions():
    listing = [
        "0000000000001000 <ringcomm::reduce_n(void*, void const* const*, int, long, ringcomm::DType)>:",
        "    1000:\tmovdqu (%rdi),%xmm0",
        "    1004:\tvmovdqu (%rdi),%ymm0",
        "0000000000002000 <ringcomm::cpu_avx512::reduce_n(void*, void const* const*, int, long)>:",
        "    2000:\tvaddps %zmm1,%zmm0,%zmm0",
        "0000000000003000 <std::_Function_handler<void (int), ringcomm::cpu_avx2::(anonymous namespace)::f>::_M_invoke>:",
        "    3000:\tvpaddd %ymm1,%ymm0,%ymm0",
        "0000000000004000 <ringcomm::copy_bytes(void*, void const*, long)>:",
        "    4000:\tshlx   %rax,%rbx,%rcx",
        "    4004:\tkmovw  %k1,%eax",
        "0000000000005000 <ringcomm::parallel_run(int, int)>:",
        "    5000:\tpause",
    ]
    found = isa_check.offenders(listing)
    assert set(found) == {"ringcomm::reduce_n(void*, void const* const*, int, long, ringcomm::DType)",
                          "ringcomm::copy_bytes(void*, void const*, long)"}, found
    assert found["ringcomm::copy_bytes(void*, void const*, long)"] == ["shlx   %rax,%rbx,%rcx", "kmovw  %k1,%eax"]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the wider builds exist on x86-64 only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_no_code_outside_the_wider_builds_needs_more_than_the_baseline():
    found = ringcomm.cpu_capabilities()
    if found.march != "x86-64-v2":
        pytest.skip(f"built for -march={found.march} (RINGCOMM_MARCH), not the portable baseline")
    listing = isa_check.disassemble(_C.__file__)
    in_variants = sum(1 for line in listing if any(ns in line for ns in isa_check.VARIANT_NAMESPACES))
    assert in_variants > 0, "no function of the wider builds in the disassembly: were they linked?"
    offenders = isa_check.offenders(listing)
    assert not offenders, "\n".join(f"{f}: {i[:3]}" for f, i in list(offenders.items())[:20])


@pytest.mark.slow
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_kernel_tests_under_every_build_this_cpu_runs(capability):
    found = ringcomm.cpu_capabilities()
    if capability not in found.supported:
        pytest.skip(f"this CPU does not run the {capability} build (it runs {', '.join(found.supported)})")
    if capability == found.active:
        pytest.skip(f"{capability} is the build the rest of the suite runs")
    code = (f"import sys, pytest, ringcomm; assert ringcomm.cpu_capability() == {capability!r}; "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', *{KERNEL_TESTS!r}]))")
    [(returncode, out, _)] = run_python(code, [capability], timeout=600)
    assert returncode == 0, f"under RINGCOMM_CPU_CAPABILITY={capability}:\n{out[-6000:]}"
