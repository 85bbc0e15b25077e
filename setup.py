"""Builds ringcomm._C (csrc/cpu/*.cpp) with pybind11 alone: no torch at build time,
and ships the CUDA sources (csrc/cuda/*.cu) as package data: ringcomm/cuda/.

The kernels are plain loops that the compiler vectorizes (AVX-512 intrinsics
where the target has them), split over threads with OpenMP. By default they are
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


def compiles(flags: list[str], source: str = "int main() { return 0; }\n") -> bool:
    """Whether the C++ compiler builds and links source with flags."""
    compiler = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.cpp")
        with open(path, "w") as f:
            f.write(source)
        result = subprocess.run([compiler, *flags, path, "-o", os.path.join(tmp, "probe")], capture_output=True)
    if result.returncode != 0:
        print(f"ringcomm: {' '.join(flags)} not supported by {compiler}; building without it", file=sys.stderr)
    return result.returncode == 0


def arch_flags() -> list[str]:
    march = os.environ.get("RINGCOMM_MARCH", "native")
    return [f"-march={march}"] if march and compiles([f"-march={march}"]) else []


def openmp_flags() -> list[str]:
    """-fopenmp: the kernels split their work over torch's OpenMP threads (csrc/cpu/parallel.h);
    without it they run on one thread."""
    source = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    return ["-fopenmp"] if compiles(["-fopenmp"], source) else []


openmp = openmp_flags()
extension = Pybind11Extension(
    "ringcomm._C",
    sorted(glob.glob("csrc/cpu/*.cpp")),
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", *openmp, *arch_flags()],
    extra_link_args=["-lrt", *openmp],
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
