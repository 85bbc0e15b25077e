"""Builds ringcomm._C (csrc/cpu/*.cpp) with pybind11 alone: no torch at build time,
and ships the CUDA sources (csrc/cuda/*.cu) as package data: ringcomm/cuda/.

The kernels are plain loops that the compiler vectorizes. By default they are
built for this machine (-march=native, falling back to the compiler default
where that flag is unknown); set RINGCOMM_MARCH (e.g. "x86-64-v2") for a build
that must run on other CPUs.
"""
import glob
import os
import subprocess
import sys
import tempfile

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py


def arch_flags() -> list[str]:
    march = os.environ.get("RINGCOMM_MARCH", "native")
    flag = f"-march={march}" if march else ""
    if not flag:
        return []
    with tempfile.NamedTemporaryFile(suffix=".cpp", mode="w") as probe:
        probe.write("int main() { return 0; }\n")
        probe.flush()
        compiler = os.environ.get("CXX", "c++")
        result = subprocess.run([compiler, flag, "-x", "c++", "-fsyntax-only", probe.name], capture_output=True)
    if result.returncode != 0:
        print(f"ringcomm: {flag} not supported by {compiler}; building without it", file=sys.stderr)
        return []
    return [flag]


extension = Pybind11Extension(
    "ringcomm._C",
    sorted(glob.glob("csrc/cpu/*.cpp")),
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", *arch_flags()],
    extra_link_args=["-lrt"],
)

class build_py_with_cuda_sources(build_py):
    """Copies csrc/cuda/*.cu into the built package as ringcomm/cuda/*.cu, where
    ringcomm.cuda_kernels finds them through importlib.resources (an editable
    install reads them from csrc/cuda instead)."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "ringcomm", "cuda")
        self.mkpath(target)
        for source in sorted(glob.glob("csrc/cuda/*.cu")):
            self.copy_file(source, os.path.join(target, os.path.basename(source)))


setup(ext_modules=[extension], cmdclass={"build_ext": build_ext, "build_py": build_py_with_cuda_sources})
