"""The optimizer step on fp32 masters in host memory (the engine on CPU, and
ZeRO-Offload): Adam/AdamW run the fused kernel of csrc/cpu/kernels/adam.cpp, which
unscales and clips the gradient, updates master and both moments and writes
the 16-bit copy of the parameter in one pass over memory. torch's fused kernel
needs a second pass for the 16-bit copy (benchmarks/cpu_adam.py measures
both). The states keep torch's names and types (step, exp_avg, exp_avg_sq), so
optimizer.state_dict() and checkpoints are unchanged. The step can also
write the updated master and moments to copies (an in-memory snapshot's
slots) with their word sums: [Note: copies in the step] in adam.cpp.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ringcomm import _C
from ringcomm.core.ops import DTYPE_CODES, LOW_PRECISION

OUT_DTYPES = LOW_PRECISION  # the 16-bit parameter copies the fused step writes
KINDS = ("master", "exp_avg", "exp_avg_sq")  # what a copy holds, in the kernel's order


@dataclass
class StepCopies:
    """Where adam_step also writes parameters' updated values: by the
    parameter's (data_ptr, numel), an address for each of KINDS per copy
    (numel fp32 each). The step fills `sums` by the same key: the word sums of
    KINDS ([Note: word sums] in csrc/cpu/checksum.h)."""

    targets: dict[tuple[int, int], list[int]]
    sums: dict[tuple[int, int], list[int]] = field(default_factory=dict)


def applies(optimizer: torch.optim.Optimizer) -> bool:
    """Adam/AdamW (exactly: a subclass may change the update) without amsgrad or
    maximize, whose parameters are fp32 host tensors."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(
        not group.get("amsgrad") and not group.get("maximize") and
        all(p.device.type == "cpu" and p.dtype == torch.float32 for p in group["params"])
        for group in optimizer.param_groups)


def adam_step(optimizer: torch.optim.Optimizer, coef: float, outputs: dict[int, torch.Tensor],
              copies: StepCopies | None = None) -> None:
    """Steps every parameter with a gradient; its gradient is multiplied by
    `coef` inside the kernel. outputs: id(parameter) -> the 16-bit tensor that
    receives its updated value (parameters without one are not copied out);
    copies: where else the updated values go (parameters it lacks: nowhere)."""
    threads = torch.get_num_threads()
    adamw_default = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        adamw = bool(group.get("decoupled_weight_decay", adamw_default))
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            assert param.is_contiguous() and grad.is_contiguous() and grad.dtype == torch.float32
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            state["step"] += 1
            out = outputs.get(id(param))
            assert out is None or (out.is_contiguous() and out.numel() == param.numel())
            key = (param.data_ptr(), param.numel())
            to = copies.targets.get(key, []) if copies is not None else []
            sums = _C.adam_step(param.data_ptr(), grad.data_ptr(), state["exp_avg"].data_ptr(),
                                state["exp_avg_sq"].data_ptr(), 0 if out is None else out.data_ptr(),
                                DTYPE_CODES[out.dtype] if out is not None else 0, param.numel(), lr, beta1, beta2, eps,
                                weight_decay, int(state["step"]), coef, adamw, threads, to)
            if to:
                copies.sums[key] = sums
