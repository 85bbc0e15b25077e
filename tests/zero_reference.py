"""Shared pieces of the zero tests: tiny models, data, and the single-process
reference trainer (plain torch on the whole global batch)."""
from __future__ import annotations

import copy
import math
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the zero package

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LR, CLIP, STEPS, MICRO = 1e-2, 0.3, 5, 2
SCALE_POWER = 8  # fp16 loss scale 256: no overflow in these runs, so no step is skipped


class Block(nn.Module):
    """A pre-norm transformer block that calls every Linear as a module (stage 3
    gathers per module)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.v, self.out = (nn.Linear(d, d) for _ in range(3))
        self.k = nn.Linear(d, d, bias=False)  # a key bias gets no gradient (softmax is shift-invariant)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.out((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


class TorchAttention(nn.Module):
    """torch's MultiheadAttention, which uses out_proj's weight without calling out_proj
    (no biases: a key bias gets no gradient)."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed, self.attn, self.head = nn.Embedding(vocab, d), nn.MultiheadAttention(d, 2, bias=False), nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(0, 1)
        return self.head(self.attn(x, x, x, need_weights=False)[0].transpose(0, 1))


def activation_peaks(model: nn.Module, tokens: torch.Tensor, loss) -> dict[bool, int]:
    """Peak bytes autograd holds in one forward and backward of copies of
    `model`, without (False) and with (True) every Block checkpointed."""
    from zero.activation import checkpointing

    peaks = {}
    for checkpointed in (False, True):
        checkpointing.reset()
        run = copy.deepcopy(model)
        if checkpointed:
            checkpointing.checkpoint_modules(run, Block)
        with checkpointing.measure() as stats:
            loss(run(tokens)).backward()
        peaks[checkpointed] = stats.peak_nbytes
    checkpointing.reset()
    return peaks


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 5))
    if kind == "torch_attention":
        return TorchAttention()
    model = TinyTransformer()
    if kind == "tied":  # the head reuses the embedding (GPT-2 style)
        model.head.weight = model.embed.weight
    return model


def make_batch(kind: str, numel: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(numel, 12, generator=g), torch.randn(numel, 5, generator=g)
    tokens = torch.randint(0, 32, (numel, 6), generator=g)
    return tokens, torch.randint(0, 32, (numel, 6), generator=g)


def loss_fn(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return nn.functional.mse_loss(out.float(), target)
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def reference_train(kind: str, dtype: torch.dtype, global_batch: int) -> tuple[list[float], list[torch.Tensor]]:
    """Mixed precision by hand: model in `dtype`, fp32 masters, AdamW, clipping."""
    model = copy.deepcopy(make_model(kind)).to(dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR)
    scale = 2.0 ** SCALE_POWER if dtype == torch.float16 else 1.0
    losses = []
    for step in range(STEPS):
        x, y = make_batch(kind, global_batch, step)
        x = x.to(dtype) if x.is_floating_point() else x
        loss = loss_fn(kind, model(x), y)
        grads = torch.autograd.grad(loss * scale, params)
        g32 = [g.float() / scale for g in grads]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in g32))
        coef = min(1.0, CLIP / (norm + 1e-6))
        for m, g in zip(masters, g32):
            m.grad = g * coef
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(float(loss.detach()))
    return losses, [m.detach() for m in masters]


def engine_config(stage: int, dtype_name: str, accumulation: int, world_size: int, **zero_options) -> dict:
    return {
        "train_batch_size": MICRO * accumulation * world_size,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "fp16": {"enabled": dtype_name == "fp16", "loss_scale": 0, "initial_scale_power": SCALE_POWER},
        "bf16": {"enabled": dtype_name == "bf16"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 20,
                              **zero_options},
    }
