"""Builds ringcomm._C (csrc/cpu) with pybind11 alone: no torch at build time,
and ships the CUDA sources (csrc/cuda/*.cu) as package data: ringcomm/cuda/.

One build runs on every x86-64-v2 CPU: the library is compiled for that
baseline, and the kernels (csrc/cpu/kernels/) once more for each wider CPU
capability (AVX2, AVX-512, AVX-512 with BF16), among which the library chooses
when it runs ([Note: CPU capabilities] in csrc/cpu/cpu_capability.h). The
kernels are plain loops that the compiler vectorizes (AVX-512 intrinsics in the
AVX-512 builds), split over threads with OpenMP. RINGCOMM_MARCH (e.g. "native")
builds everything for that -march instead, with no run-time choice: a build
for one machine only.
"""
import glob
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
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


def openmp_flags() -> list[str]:
    """-fopenmp: the kernels split their work over torch's OpenMP threads (csrc/cpu/parallel.h);
    without it they run on one thread."""
    source = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    return ["-fopenmp"] if compiles(["-fopenmp"], source) else []


@dataclass(frozen=True)
class CpuVariant:
    """One build of csrc/cpu/kernels/: its namespace, the macro that tells the
    dispatcher it exists, and its compiler flags."""
    namespace: str
    macro: str
    flags: tuple[str, ...]


# Widest last: the link keeps the first of equal inline functions, so the narrowest copy wins.
# -mtune: GCC 12's generic tuning vectorizes the reduction loops into code that runs at 0.7x of
# a -march=native build on an AMD Zen 2 (38 against 54 GB/s, 256 KiB fp32 sums); Skylake's
# tuning, the common AVX2 core, matches native there. The AVX-512 builds take Ice Lake's.
X86_VARIANTS = (
    CpuVariant("cpu_avx2", "RINGCOMM_WITH_AVX2", ("-march=x86-64-v3", "-mtune=skylake")),
    CpuVariant("cpu_avx512", "RINGCOMM_WITH_AVX512", ("-march=x86-64-v4", "-mtune=icelake-server")),
    CpuVariant("cpu_avx512_bf16", "RINGCOMM_WITH_AVX512_BF16", ("-march=x86-64-v4", "-mavx512bf16",
                                                                 "-mtune=icelake-server")),
)
KERNEL_SOURCES = sorted(glob.glob("csrc/cpu/kernels/*.cpp"))


def baseline_and_variants() -> tuple[list[str], list[CpuVariant]]:
    """The flags of the baseline build (its -march first), and the wider builds of the kernels
    that this compiler makes."""
    march = os.environ.get("RINGCOMM_MARCH", "")
    if march:
        return ([f"-march={march}"] if compiles([f"-march={march}"]) else []), []
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [], []
    baseline = ["-march=x86-64-v2", "-mtune=generic"]
    if not compiles(baseline):
        return [], []
    return baseline, [v for v in X86_VARIANTS if compiles(list(v.flags))]


ParallelCompile("RINGCOMM_BUILD_JOBS").install()  # sources in parallel, on every core by default
openmp = openmp_flags()
baseline_flags, variants = baseline_and_variants()
build_march = baseline_flags[0].removeprefix("-march=") if baseline_flags else ""
extension = Pybind11Extension(
    "ringcomm._C",
    sorted(glob.glob("csrc/cpu/*.cpp")) + KERNEL_SOURCES,
    cxx_std=17,
    include_dirs=["csrc/cpu"],
    define_macros=[*((v.macro, "1") for v in variants), ("RINGCOMM_BUILD_MARCH", f'"{build_march}"')],
    # -ffp-contract=off: no build fuses a multiply and an add that another does not, so all give the same bits
    extra_compile_args=["-O3", "-fno-math-errno", "-ffp-contract=off", *openmp, *baseline_flags],
    extra_link_args=["-lrt", *openmp],
)


class build_ext_with_cpu_variants(build_ext):
    """Compiles csrc/cpu/kernels/ once more per wider CPU capability, each in its
    own namespace, and links those objects after the baseline's, narrowest first."""

    def build_extension(self, ext) -> None:
        objects = []
        for variant in variants:
            objects += self.compiler.compile(
                KERNEL_SOURCES, output_dir=os.path.join(self.build_temp, variant.namespace),
                macros=[*ext.define_macros, ("RINGCOMM_CPU_CAPABILITY", variant.namespace)],
                include_dirs=ext.include_dirs, extra_postargs=[*ext.extra_compile_args, *variant.flags],
                depends=ext.depends)
        ext.extra_objects = [*ext.extra_objects, *objects]
        super().build_extension(ext)


class build_py_with_cuda_sources(build_py):
    """Copies csrc/cuda/*.cu into the built package as ringcomm/cuda/*.cu, where
    ringcomm.kernels.cuda finds them through importlib.resources (an editable
    install reads them from csrc/cuda instead)."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "ringcomm", "cuda")
        self.mkpath(target)
        for source in sorted(glob.glob("csrc/cuda/*.cu")):
            self.copy_file(source, os.path.join(target, os.path.basename(source)))


setup(ext_modules=[extension], cmdclass={"build_ext": build_ext_with_cpu_variants, "build_py": build_py_with_cuda_sources})
