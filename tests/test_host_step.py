"""zero/host_adam.py (csrc/cpu/kernels/adam.cpp) against torch's own Adam/AdamW:
odd sizes, both decay modes, bf16/fp16/no copy-out, 1 and 2 threads."""
from __future__ import annotations

import pytest
import torch

import zero_reference  # noqa: F401  (puts the repo root on sys.path)
from zero.optim import host_adam


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_host_step_matches_torch(cls) -> None:
    threads = torch.get_num_threads()
    for numel, out_dtype, num_threads in ((0, None, 1), (1, torch.bfloat16, 2), (131, torch.float16, 2),
                                          (4099, torch.bfloat16, 1), (10_007, None, 2)):
        torch.set_num_threads(num_threads)
        case = f"{cls.__name__} numel {numel} {out_dtype} {num_threads} threads"
        g = torch.Generator().manual_seed(numel)
        initial = torch.randn(numel, generator=g)
        ours, ref = initial.clone().requires_grad_(), initial.clone().requires_grad_()
        opt = cls([ours], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
        ref_opt = cls([ref], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
        out = None if out_dtype is None else torch.empty(numel, dtype=out_dtype)
        for step in range(4):
            grad, coef = torch.randn(numel, generator=g) * 100, 0.01 * (step + 1)
            ours.grad, ref.grad = grad.clone(), grad * coef
            host_adam.adam_step(opt, coef, {} if out is None else {id(ours): out})
            ref_opt.step()
            # fp32 rounding of a reordered update: a few ulps of |p| per step
            torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: {m}")
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[ours][name], ref_opt.state[ref][name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{case} step {step}: {name}: {m}")
            if out is not None:
                assert torch.equal(out, ours.detach().to(out_dtype)), f"{case} step {step}: 16-bit copy differs"
        assert float(opt.state[ours]["step"]) == 4.0, case
    torch.set_num_threads(threads)
