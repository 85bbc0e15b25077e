"""zero/host_adam.py (csrc/cpu/kernels/adam.cpp) against torch's own Adam/AdamW:
odd sizes, both decay modes, bf16/fp16/no copy-out, 1 and 2 threads. The
copies the step writes for a snapshot, and their word sums
(csrc/cpu/checksum.h) against the sums' definition in numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import zero_reference  # noqa: F401  (puts the repo root on sys.path)
from checksum_reference import word_sum as numpy_word_sum
from zero.checkpoint.tensorfile import add_word_sums, word_sum
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


def test_word_sums_match_their_definition_add_up_and_see_damage() -> None:
    g = np.random.default_rng(7)
    for nbytes, first in ((0, 0), (1, 0), (7, 3), (4096, 0), (100_003, 12_345), (1 << 20, (1 << 31) + 5)):
        data = g.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        got = word_sum(memoryview(data), first)
        assert got == numpy_word_sum(data, first), f"{nbytes} bytes from word {first}"
        cut = nbytes // 8 * 4  # a word boundary: the pieces' sums add up to the whole's
        assert add_word_sums(word_sum(memoryview(data[:cut]), first),
                             word_sum(memoryview(data[cut:]), first + cut // 4)) == got, f"{nbytes} bytes split"
        if nbytes >= 8:
            for damaged in (bytearray(data), bytearray(data)):
                damaged[g.integers(nbytes)] ^= 1 << int(g.integers(8))
                assert word_sum(memoryview(damaged), first) != got, f"{nbytes} bytes: a flipped bit unseen"
            swapped = bytearray(data)
            swapped[0:4], swapped[4:8] = data[4:8], data[0:4]
            assert data[0:4] == data[4:8] or word_sum(memoryview(swapped), first) != got, "two words swapped unseen"


@pytest.mark.parametrize("num_copies", [1, 2])
def test_step_copies_hold_the_updated_values_and_their_word_sums(num_copies) -> None:
    """The step's copies (at addresses not 32-byte aligned, as in a shard file)
    equal the master and moments after the step, bit for bit, and the sums it
    returns are theirs; the values themselves are those of a step without copies."""
    threads = torch.get_num_threads()
    for numel, num_threads in ((1, 1), (131, 2), (8192 * 3 + 5, 2), (100_003, 1)):
        torch.set_num_threads(num_threads)
        case = f"numel {numel}, {num_threads} threads, {num_copies} copies"
        g = torch.Generator().manual_seed(numel)
        initial = torch.randn(numel, generator=g)
        params = [initial.clone().requires_grad_() for _ in range(2)]
        opts = [torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in params]
        arena = torch.zeros(num_copies * 3 * numel * 4 + 64, dtype=torch.uint8)
        views = [arena[4 + 4 * numel * i:4 + 4 * numel * (i + 1)].view(torch.float32) for i in range(num_copies * 3)]
        for step in range(2):
            grad = torch.randn(numel, generator=g)
            for p in params:
                p.grad = grad.clone()
            ours = params[0]
            copies = host_adam.StepCopies({(ours.data_ptr(), numel): [v.data_ptr() for v in views]})
            host_adam.adam_step(opts[0], 0.5, {}, copies)
            host_adam.adam_step(opts[1], 0.5, {})
            values, plain = ([p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]
                             for p, opt in zip(params, opts))
            for kind, value, other in zip(host_adam.KINDS, values, plain):
                assert torch.equal(value, other), f"{case}: {kind} differs from the step without copies"
            for i, view in enumerate(views):
                kind = host_adam.KINDS[i % 3]
                assert torch.equal(view, values[i % 3]), f"{case} step {step}: copy {i // 3} of {kind}"
            want = [numpy_word_sum(v.numpy().tobytes()) for v in values]
            assert copies.sums[(ours.data_ptr(), numel)] == want, f"{case} step {step}: word sums"
    torch.set_num_threads(threads)


def test_a_step_copy_may_be_the_moments_themselves() -> None:
    """A snapshot whose file holds the optimizer's moments passes their own
    addresses: the step updates them in place, streams the other copy, and
    returns the same word sums; a target that overlaps a state otherwise is refused."""
    numel, g = 8192 * 2 + 37, torch.Generator().manual_seed(7)
    initial, grads = torch.randn(numel, generator=g), [torch.randn(numel, generator=g) for _ in range(2)]
    params = [initial.clone().requires_grad_() for _ in range(2)]
    opts = [torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in params]
    other = [torch.zeros(numel) for _ in range(3)]
    ours = params[0]
    for grad in grads:
        for p in params:
            p.grad = grad.clone()
        state = opts[0].state[ours]
        home = [ours.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr()] if state else None
        copies = host_adam.StepCopies({(ours.data_ptr(), numel): (home or [t.data_ptr() for t in other])
                                       + [t.data_ptr() for t in other]})
        host_adam.adam_step(opts[0], 0.5, {}, copies)
        host_adam.adam_step(opts[1], 0.5, {})
        values = [p.detach(), opts[0].state[ours]["exp_avg"], opts[0].state[ours]["exp_avg_sq"]]
        plain = [params[1].detach(), opts[1].state[params[1]]["exp_avg"], opts[1].state[params[1]]["exp_avg_sq"]]
        for kind, value, want, copy in zip(host_adam.KINDS, values, plain, other):
            assert torch.equal(value, want), f"{kind}: the step with itself as a copy differs"
            assert torch.equal(copy, want), f"{kind}: the streamed copy differs"
        assert copies.sums[(ours.data_ptr(), numel)] == [numpy_word_sum(v.numpy().tobytes()) for v in plain]
    p = params[0]
    p.grad = grads[0].clone()
    exp_avg = opts[0].state[p]["exp_avg"]
    shifted = [p.data_ptr(), exp_avg.data_ptr() + 64, opts[0].state[p]["exp_avg_sq"].data_ptr()]
    with pytest.raises(ValueError, match="overlaps the state it copies"):
        host_adam.adam_step(opts[0], 0.5, {}, host_adam.StepCopies({(p.data_ptr(), numel): shifted}))
