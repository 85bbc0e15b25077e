"""Run under another CPU (`qemu-x86_64 -cpu MODEL python tests/cpu_check.py`):
ringcomm imports there, runs the build of its kernels that this CPU has, and
computes what the plain-torch references compute, bit for bit: reductions in
fp32/bf16/fp16, a quantization round trip, the Adam step's snapshot copies and
their word sums, and a 2-rank all_reduce over shared memory (the ranks are
forked, so they stay on the emulated CPU). Prints
`cpu check ok: capability=NAME supported=A,B` and exits 0, or raises."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checksum_reference  # noqa: E402
import quant_reference as ref  # noqa: E402

import ringcomm  # noqa: E402
from ringcomm.kernels import cpu as kernels, quant
from ringcomm.core.ops import ReduceOp

SIZES = (1, 17, 1000, 4099)  # a scalar tail, one vector and a tail, many blocks and a tail
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference_reduce(srcs: list[torch.Tensor], op: ReduceOp, divisor: int) -> torch.Tensor:
    """In order, in float32, rounded once (the kernels' contract)."""
    acc = srcs[0].float()
    for src in srcs[1:]:
        acc = torch.maximum(acc, src.float()) if op == ReduceOp.MAX else acc + src.float()
    return (acc / divisor if op == ReduceOp.AVG else acc).to(srcs[0].dtype)


def check_reductions(gen: torch.Generator) -> None:
    for dtype in DTYPES:
        for numel in SIZES:
            srcs = [(torch.randn(numel, generator=gen) * 100).to(dtype) for _ in range(3)]
            for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
                out = torch.empty(numel, dtype=dtype)
                kernels.reduce_into(out, srcs, op, divisor=3)
                expected = reference_reduce(srcs, op, 3)
                assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                   expected.view(torch.int16 if dtype != torch.float32 else torch.int32)), \
                    f"reduce {op.name} {dtype} {numel=}: {out[:4]} != {expected[:4]}"


def check_quantization(gen: torch.Generator) -> None:
    for dtype in DTYPES:
        for bits, block in ((8, 4096), (4, 1024), (8, 5)):
            x = (torch.randn(5001, generator=gen) * 3).to(dtype)
            data, scales = quant.quantize(x, bits=bits, block=block)
            ref_data, ref_scales = ref.quantize(x, bits=bits, block=block)
            assert torch.equal(data, ref_data) and torch.equal(scales, ref_scales), f"quantize {dtype} {bits=}"
            out = quant.dequantize(data, scales, out=torch.empty(5001, dtype=dtype), bits=bits, block=block)
            expected = ref.dequantize(ref_data, ref_scales, 5001, dtype, bits=bits, block=block)
            assert torch.equal(out.float(), expected.float()), f"dequantize {dtype} {bits=}"


def check_step_copies(gen: torch.Generator) -> None:
    """The fused Adam step's copies (at an address off the vector width) equal
    the values it updated, and its word sums are theirs."""
    from zero.optim import host_adam

    numel = 20_001  # blocks of the copy kernel and a tail
    param = torch.randn(numel, generator=gen).requires_grad_()
    optimizer = torch.optim.AdamW([param], lr=1e-2)
    arena = torch.zeros(3 * 4 * numel + 8, dtype=torch.uint8)
    views = [arena[4 + 4 * numel * i:4 + 4 * numel * (i + 1)].view(torch.float32) for i in range(3)]
    for _ in range(2):
        param.grad = torch.randn(numel, generator=gen)
        copies = host_adam.StepCopies({(param.data_ptr(), numel): [v.data_ptr() for v in views]})
        host_adam.adam_step(optimizer, 1.0, {}, copies)
        values = [param.detach(), optimizer.state[param]["exp_avg"], optimizer.state[param]["exp_avg_sq"]]
        assert all(torch.equal(v, c) for v, c in zip(values, views)), "adam_step: a copy differs from the values"
        want = [checksum_reference.word_sum(v.numpy().tobytes()) for v in values]
        assert copies.sums[(param.data_ptr(), numel)] == want, "adam_step: the word sums differ"


def all_reduce_rank(rank: int, init_file: str, queue) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))
        group = ringcomm.new_group(timeout=120)
        x = torch.full((100_003,), rank + 1.0)
        ringcomm.all_reduce(x, group=group)
        y = torch.randn(4099, generator=torch.Generator().manual_seed(rank)).bfloat16()
        ringcomm.all_reduce(y, group=group)
        parts = [torch.randn(4099, generator=torch.Generator().manual_seed(r)).bfloat16() for r in range(2)]
        expected = reference_reduce(parts, ReduceOp.SUM, 1)
        ok = bool((x == 3.0).all()) and torch.equal(y.view(torch.int16), expected.view(torch.int16))
        queue.put((rank, ok, group.transport.describe()))
        group.close()
        dist.destroy_process_group()
    except BaseException as error:  # report instead of hanging the parent
        queue.put((rank, False, repr(error)))


def check_all_reduce() -> None:
    context = mp.get_context("fork")
    queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="ringcomm-cpu-check-") as tmp:
        procs = [context.Process(target=all_reduce_rank, args=(r, os.path.join(tmp, "rdzv"), queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        results = [queue.get(timeout=300) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
    assert all(ok for _, ok, _ in results), f"2-rank all_reduce: {results}"


def main() -> None:
    torch.set_num_threads(1)  # no OpenMP pool before the fork: GNU OpenMP's threads do not survive one
    gen = torch.Generator().manual_seed(0)
    check_reductions(gen)
    check_quantization(gen)
    check_step_copies(gen)
    check_all_reduce()
    supported = ",".join(ringcomm.cpu_capabilities().supported)
    print(f"cpu check ok: capability={ringcomm.cpu_capability()} supported={supported}")


if __name__ == "__main__":
    main()
