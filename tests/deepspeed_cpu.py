"""DeepSpeed as the tests run it: the CPU accelerator, without the JIT build of
its shared-memory comm op, its CPU optimizer ops built without debug info, and
the one answer to which dtypes its engine accepts on this CPU. The comm op
serves only DeepSpeed's inference all-reduce (training never calls it) and
costs ~45 s of compiling on 2 cores; a build killed by a test's timeout leaves
torch's build lock behind, and every later DeepSpeed start waits on it
forever."""
from __future__ import annotations

import functools
import os
import sys

DTYPES = ("fp32", "bf16", "fp16")
EXTENSIONS_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ringcomm-tests", "torch_extensions")
# what torch's oneDNN needs of the CPU for each half type (its mkldnn_check_low_precision messages)
ONEDNN_NEEDS = {"fp16": "AVX512-FP16 or AVX-NE-CONVERT", "bf16": "AVX512BW/VL/DQ or AVX-NE-CONVERT"}


def import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # the tests' builds of DeepSpeed's CPU ops (FusedAdam, DeepSpeedCPUAdam): in a folder of their own (unless
    # TORCH_EXTENSIONS_DIR names one), compiled without -g: debug info is a quarter of each compile (45 -> 34
    # CPU-s per source, 4 sources) and changes no instruction. Every process that imports DeepSpeed here builds
    # with the same flags, so none rebuilds another's, nor a benchmark's in torch's default folder.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm.torch as a name is the torch package)
    from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if not getattr(CPUOpBuilder.cxx_args, "without_debug_info", False):
        cxx_args = CPUOpBuilder.cxx_args

        def without_debug_info(self) -> list[str]:
            return [arg for arg in cxx_args(self) if arg != "-g"]
        without_debug_info.without_debug_info = True
        CPUOpBuilder.cxx_args = without_debug_info
    return deepspeed


@functools.cache
def refusal(dtype: str) -> str | None:
    """Why DeepSpeed's engine refuses `dtype` on this CPU, or None where it accepts it.

    DeepSpeed decides: its engine's sanity check raises "Type fp16 is not supported
    on your device." where the accelerator's is_fp16_supported() (is_bf16_supported()
    for bf16) is false. The tests' ranks run DeepSpeed with DS_ACCELERATOR=cpu, so
    this asks the CPU accelerator itself, whatever this process's accelerator is.
    The reason adds torch's own answer for this CPU, the one DeepSpeed's CPU
    accelerator reads for fp16."""
    if dtype not in DTYPES:
        raise ValueError(f"refusal: dtype {dtype!r} is not one of {DTYPES}")
    if dtype == "fp32":  # the engine checks only the half types
        return None
    deepspeed = import_deepspeed()
    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    question = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}[dtype]
    if question():
        return None
    reason = f"DeepSpeed {deepspeed.__version__}'s CPU accelerator refuses {dtype} (is_{dtype}_supported() is false)"
    onednn = {"fp16": torch.ops.mkldnn._is_mkldnn_fp16_supported, "bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported}
    if not onednn[dtype]():
        reason += (f": torch.ops.mkldnn._is_mkldnn_{dtype}_supported() is False on this CPU "
                   f"(needs {ONEDNN_NEEDS[dtype]})")
    return reason


@functools.cache
def build_failure(builders: tuple[str, ...]) -> str | None:
    """Builds (or loads from torch's extension cache) DeepSpeed's CPU ops for
    `builders` ("FusedAdamBuilder": the optimizer DeepSpeed's Adam config builds,
    "CPUAdamBuilder": DeepSpeedCPUAdam's) in this process, once, before ranks start
    loading them at the same time; why they cannot be built, or None. A cold build
    takes about 85 s per op on 2 cores."""
    import_deepspeed()
    from deepspeed.ops.op_builder import cpu

    for name in builders:
        try:
            getattr(cpu, name)().load(verbose=False)
        except Exception as error:  # the op's JIT build: a compiler, ninja, the headers
            return f"DeepSpeed's {name} op cannot be built here: {type(error).__name__}: {error}"
    return None


def skip_unless_accepted(dtype: str) -> None:
    """Skips the calling test or fixture where DeepSpeed refuses `dtype` on this CPU."""
    import pytest

    reason = refusal(dtype)
    if reason is not None:
        pytest.skip(reason)
