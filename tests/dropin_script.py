"""A training script as a DeepSpeed user writes it: a small GPT with a tied
embedding, AdamW and WarmupLR from the config, accumulation 2, clipping 1.0.
tests/test_zero_dropin.py runs this text twice: as is, and with its first
import line changed to `import zero as deepspeed` (the only change).
`train`, `surface` and `engine_surfaces` return plain values to compare between
the two runs."""
import deepspeed

import argparse
import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 96, 16, 32, 4, 2
MICRO_BATCH, ACCUMULATION = 4, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.qkv, self.proj = nn.Linear(EMBD, 3 * EMBD), nn.Linear(EMBD, EMBD)
        self.fc, self.out = nn.Linear(EMBD, 4 * EMBD), nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def config(stage, dtype):
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 1.0, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 8}},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000, "allgather_bucket_size": 20000,
                              "stage3_param_persistence_threshold": 0},
    }


def batch(step, micro, rank):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    data = torch.randint(0, VOCAB, (MICRO_BATCH, BLOCK + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def train(stage, dtype, num_steps):
    """Losses, lrs and grad norms per optimizer step; the final parameters' sums."""
    torch.manual_seed(0)
    model = GPT()
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=config(stage, dtype))
    rank = deepspeed.comm.get_rank()
    out = train_steps(engine, range(num_steps), ACCUMULATION, rank)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        out["params"] = [p.detach().float().sum().item() for p in engine.module.parameters()]
    return out


def train_steps(engine, steps, accumulation, rank):
    """Losses, lrs and grad norms of the optimizer steps `steps`, `accumulation` micro-steps each."""
    out = {"loss": [], "lr": [], "grad_norm": []}
    for step in steps:
        for micro in range(accumulation):
            loss = engine(*batch(step, micro, rank))
            engine.backward(loss)
            engine.step()
        out["loss"].append(loss.item())
        out["lr"].append(engine.get_lr()[0])
        out["grad_norm"].append(float(engine.get_global_grad_norm()))
    return out


def shared_tempdir():
    root = tempfile.mkdtemp() if deepspeed.comm.get_rank() == 0 else None
    shared = [root]
    deepspeed.comm.broadcast_object_list(shared, 0)
    return shared[0]


def resume(stage, dtype, num_steps, more_steps):
    """Saved after num_steps optimizer steps of accumulation 2 (an odd number:
    2 * num_steps micro-steps, not a multiple of 4), resumed with accumulation
    4; losses, lrs and grad norms of the resumed steps."""
    rank, root = deepspeed.comm.get_rank(), shared_tempdir()
    for accumulation, steps in ((ACCUMULATION, range(num_steps)), (2 * ACCUMULATION, range(num_steps, num_steps + more_steps))):
        torch.manual_seed(0)
        model = GPT()
        settings = dict(config(stage, dtype), gradient_accumulation_steps=accumulation)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=settings)
        if accumulation != ACCUMULATION:
            engine.load_checkpoint(root)
        start = engine.global_steps  # where the run (or the resume) begins
        out = dict(train_steps(engine, steps, accumulation, rank), global_steps=start)
        if accumulation == ACCUMULATION:
            engine.save_checkpoint(root)
    deepspeed.comm.barrier()
    if rank == 0:
        shutil.rmtree(root)
    return out


def comm_calls():
    rank, world_size = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    out = {"rank": rank, "world_size": world_size, "local_rank": deepspeed.comm.get_local_rank(),
           "initialized": deepspeed.comm.is_initialized()}
    deepspeed.comm.barrier()
    x = torch.arange(4.0) + rank
    deepspeed.comm.all_reduce(x)
    y = torch.arange(4.0) * (rank + 1)
    deepspeed.comm.all_reduce(y, op=deepspeed.comm.ReduceOp.MAX)
    gathered = torch.empty(4 * world_size)
    deepspeed.comm.all_gather_into_tensor(gathered, torch.full((4,), float(rank)))
    scattered = torch.empty(2)
    deepspeed.comm.reduce_scatter_tensor(scattered, torch.arange(2.0 * world_size) + rank)
    b = torch.full((3,), float(rank))
    deepspeed.comm.broadcast(b, 1)
    out.update(all_reduce=x.tolist(), all_reduce_max=y.tolist(), all_gather=gathered.tolist(),
               reduce_scatter=scattered.tolist(), broadcast=b.tolist())
    return out


def arguments():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    return sorted(vars(args).items())


def init_and_gather():
    """A model built sharded, gathered, modified on one rank, then trained at stage 3."""
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config(3, "fp32")):
        model = GPT()
    out = {"shapes": [tuple(p.shape) for p in model.parameters()],
           "ds_shapes": [tuple(p.ds_shape) for p in model.parameters()]}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["built"] = [p.detach().sum().item() for p in model.parameters()]
    with deepspeed.zero.GatheredParameters(model.ln_f.weight, modifier_rank=1):
        if deepspeed.comm.get_rank() == 1:
            model.ln_f.weight.data.fill_(2.0)
    with deepspeed.zero.GatheredParameters(model.ln_f.weight):
        out["modified"] = model.ln_f.weight.detach().sum().item()
    with deepspeed.zero.GatheredParameters([model.ln_f.bias, model.wpe.weight], modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            model.ln_f.bias.data.fill_(0.5)
            model.wpe.weight.data.mul_(2.0)
    engine, *_ = deepspeed.initialize(model=model, config=config(3, "fp32"))
    losses = []
    for step in range(3):
        for micro in range(ACCUMULATION):
            loss = engine(*batch(step, micro, deepspeed.comm.get_rank()))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    out["losses"] = losses
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        out["trained"] = [p.detach().sum().item() for p in engine.module.parameters()]
    return out


def engine_surface(stage, dtype):
    torch.manual_seed(0)
    model = GPT()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage, dtype))
    out = {"device": str(engine.device), "local_rank": engine.local_rank, "global_rank": engine.global_rank,
           "world_size": engine.world_size, "stage": engine.zero_optimization_stage(),
           "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled()}
    try:
        with engine.no_sync():
            loss = engine(*batch(0, 0, engine.global_rank))
            engine.backward(loss)
            try:
                engine.step()
                out["step_inside_no_sync"] = "ran"
            except Exception:
                out["step_inside_no_sync"] = "refused"
        out["no_sync"] = "ran"
    except Exception:
        out["no_sync"] = "refused"
    for step in range(2):  # the gradient of a backward inside no_sync joins the first step's
        for micro in range(ACCUMULATION):
            engine.backward(engine(*batch(step, micro, engine.global_rank)))
            engine.step()
    out["global_samples"], out["global_steps"] = engine.global_samples, engine.global_steps
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        out["params"] = [p.detach().float().sum().item() for p in engine.module.parameters()]
    root = shared_tempdir()
    out["load_nothing"] = engine.load_checkpoint(os.path.join(root, "empty"))
    out["save"] = engine.save_checkpoint(root, client_state={"epoch": 3})
    for micro in range(ACCUMULATION):  # one more step, which each load below may or may not undo
        engine.backward(engine(*batch(2, micro, engine.global_rank)))
        engine.step()

    def loaded(result):
        path, client = result
        return (os.path.relpath(path, root).split(os.sep)[0], client.get("epoch"), engine.global_steps,
                engine.global_samples, engine.get_lr())
    out["load_module_only"] = loaded(engine.load_checkpoint(root, load_module_only=True))
    out["load_no_optimizer_no_scheduler"] = loaded(engine.load_checkpoint(
        root, load_optimizer_states=False, load_lr_scheduler_states=False))
    out["load"] = loaded(engine.load_checkpoint(root, tag="global_step2"))
    deepspeed.comm.barrier()
    if engine.global_rank == 0:
        shutil.rmtree(root)
    return out


ENGINE_DTYPES = {0: "fp32", 1: "fp32", 2: "bf16", 3: "fp32"}  # the engine's surface per stage, in this dtype


def surface():
    """The calls outside an engine."""
    return {"comm": comm_calls(), "arguments": arguments(), "init": init_and_gather()}


def engine_surfaces(dtype):
    """The engine's surface at each stage whose ENGINE_DTYPES is `dtype`."""
    return {stage: engine_surface(stage, dtype) for stage, engine_dtype in ENGINE_DTYPES.items()
            if engine_dtype == dtype}
