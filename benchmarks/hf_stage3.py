"""Stage 3 against stage 2 and against its peers on Hugging Face models: zero
(stages 2 and 3), DeepSpeed (CPU accelerator, stages 2 and 3) and FSDP2
(`fully_shard` per decoder block, then the root) on gloo and on the "ringcomm"
backend; GPT-2 and Llama, fp32 and bf16, 2 ranks, the same model, data and
optimizer for every engine.

    python benchmarks/hf_stage3.py                         # every engine, model and dtype, 3 rounds
    python benchmarks/hf_stage3.py --models gpt2 --dtypes fp32 --engines zero2,zero3,fsdp2-ringcomm

Every engine runs as its users run it: zero and DeepSpeed with the config's
defaults beyond the stage, precision, accumulation and clipping (the same JSON
for both); FSDP2 with its defaults (reshard after forward, a reduce-scatter per
micro batch) and, in bf16, bf16 parameters and reductions over fp32 shards.
A step is `--accum` micro batches (forward + backward) and the optimizer step
(AdamW, clipping 1.0). Each (engine, model, dtype) is one launch of fresh
ranks; a round launches every one in turn, the order rotating per round, so a
busy machine slows all alike. A cell is the median step of steps
`--skip`+1 .. `--steps` per launch, then the median [min-max] over rounds;
peak RSS is the larger rank's VmHWM. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import launch  # noqa: E402

ENGINES = ("zero2", "zero3", "ds2", "ds3", "fsdp2-gloo", "fsdp2-ringcomm")
MODELS = ("gpt2", "llama")
DTYPES = ("fp32", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2, help="micro batch per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=3, help="first steps not timed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="bench-results/hf_stage3.json")
    return p.parse_args(argv)


def make_model(args, name: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    h = args.hidden
    if name == "gpt2":
        config = GPT2Config(n_layer=args.layers, n_embd=h, n_head=max(1, h // 64), n_positions=args.seq,
                            vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)
    config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=h, intermediate_size=int(h * 8 / 3) // 8 * 8,
                         num_attention_heads=max(1, h // 64), num_key_value_heads=max(1, h // 64),
                         max_position_embeddings=args.seq, vocab_size=args.vocab, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def ds_config(args, stage: int, dtype: str) -> dict:
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum,
            "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}}


def batch(args, step: int, micro: int):
    import torch
    import torch.distributed as dist
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + dist.get_rank())
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def engine_steps(args, engine_name: str, model_name: str, dtype: str):
    """A function running optimizer step i, returning its mean loss."""
    import torch
    model = make_model(args, model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = ds_config(args, int(engine_name[-1]), dtype)
    if engine_name.startswith("ds"):
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    else:
        import zero
        engine, *_ = zero.initialize(model=model, optimizer=optimizer, config=config)

    def step(i: int) -> float:
        losses = []
        for micro in range(args.accum):
            ids = batch(args, i, micro)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return sum(losses) / len(losses)
    return step


def fsdp2_steps(args, model_name: str, dtype: str):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = make_model(args, model_name)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
        if dtype == "bf16" else MixedPrecisionPolicy()
    blocks = model.transformer.h if model_name == "gpt2" else model.model.layers
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> float:
        losses = []
        for micro in range(args.accum):
            ids = batch(args, i, micro)
            loss = model(input_ids=ids, labels=ids).loss
            (loss / args.accum).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return sum(losses) / len(losses)
    return step


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    engine, model_name, dtype = args.case
    step = fsdp2_steps(args, model_name, dtype) if engine.startswith("fsdp2") else \
        engine_steps(args, engine, model_name, dtype)
    times, losses = [], []
    for i in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - start)
    rss = torch.tensor([peak_rss_mib()])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"step_s": statistics.median(times[args.skip:]), "peak_rss_mib": rss.item(),
                       "losses": losses}, f)


def run_case(args, case: tuple[str, str, str]) -> dict | str:
    engine = case[0]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        args.case, args.out = case, out
        code = launch(worker, args, nproc=args.nproc, timeout_s=120, deadline_s=900,
                      backend="ringcomm" if engine == "fsdp2-ringcomm" else "gloo")
        measured = os.path.getsize(out) > 0
        if code != 0 and not measured:
            return f"exit {code}"
        with open(out) as f:
            result = json.load(f)
        if code != 0:  # FSDP2 on gloo: "terminate called without an active exception" at exit, now and then
            result["note"] = f"a rank exited with an error after the measurement (exit {code})"
        return result
    finally:
        os.unlink(out)


def summary(runs: list) -> dict:
    ok = [r for r in runs if isinstance(r, dict)]
    if not ok:
        return {"error": next((r for r in runs if isinstance(r, str)), "no run")}
    steps = [r["step_s"] * 1e3 for r in ok]
    rss = [r["peak_rss_mib"] for r in ok]
    return {"step_ms": statistics.median(steps), "step_ms_range": [min(steps), max(steps)],
            "peak_rss_mib": statistics.median(rss), "peak_rss_range": [min(rss), max(rss)],
            "losses": ok[0]["losses"], "runs": len(ok),
            "notes": "; ".join(sorted({r["note"] for r in ok if "note" in r}))}


def table(results: dict, engines: list[str]) -> str:
    lines = [f"{'model':<6} {'dtype':<5} {'engine':<15} {'step ms':>22} {'peak RSS MiB':>22}"]
    for (model, dtype), row in results.items():
        for engine in engines:
            cell = row.get(engine)
            if cell is None:
                continue
            if "error" in cell:
                lines.append(f"{model:<6} {dtype:<5} {engine:<15} {cell['error']}")
                continue
            lo, hi = cell["step_ms_range"]
            rlo, rhi = cell["peak_rss_range"]
            lines.append(f"{model:<6} {dtype:<5} {engine:<15} {cell['step_ms']:8.1f} [{lo:6.1f}-{hi:6.1f}] "
                         f"{cell['peak_rss_mib']:8.0f} [{rlo:5.0f}-{rhi:5.0f}]"
                         + (f"  ({cell['notes']})" if cell.get("notes") else ""))
        for name, num, den in (("zero3 / zero2", "zero3", "zero2"), ("zero3 / fsdp2-ringcomm", "zero3", "fsdp2-ringcomm"),
                               ("zero3 / ds3", "zero3", "ds3")):
            a, b = row.get(num, {}), row.get(den, {})
            if "step_ms" in a and "step_ms" in b:
                lines.append(f"{model:<6} {dtype:<5} {name:<24} {a['step_ms'] / b['step_ms']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"hf_stage3: unknown engines {unknown}; choose from {','.join(ENGINES)}")
    cases = [(e, m, d) for m in args.models.split(",") for d in args.dtypes.split(",") for e in engines]
    with open("/proc/loadavg") as f:
        print(f"hf_stage3: {args.nproc} ranks, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
              f"micro batch {args.batch}x{args.seq}, accumulation {args.accum}, median of steps "
              f"{args.skip + 1}-{args.steps}, {args.rounds} rounds; load {f.read().split()[:3]}", flush=True)
    runs: dict = {case: [] for case in cases}
    for r in range(args.rounds):
        shift = r % len(engines)
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                for engine in engines[shift:] + engines[:shift]:
                    runs[(engine, model, dtype)].append(run_case(args, (engine, model, dtype)))
                    last = runs[(engine, model, dtype)][-1]
                    shown = f"{last['step_s'] * 1e3:.1f} ms {last.get('note', '')}" if isinstance(last, dict) else last
                    print(f"  round {r + 1}: {model} {dtype} {engine}: {shown}", flush=True)
    results: dict = {}
    for (engine, model, dtype), case_runs in runs.items():
        results.setdefault((model, dtype), {})[engine] = summary(case_runs)
    print(table(results, engines), flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("case", "out")},
                   "results": {f"{m}/{d}": row for (m, d), row in results.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
