"""ZeRO++ in the engine (zero/sharding/zeropp.py): a GPT with tied embeddings
trained 120 steps at stage 3 on 4 ranks as 2 simulated hosts x 2, with qwZ,
qgZ and all three (hpZ alone: the first 30, bit for bit) against the
unquantized run of the same data; the
keys' errors; hpZ's memory; the bytes each rank sends."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks

VOCAB, BLOCK, EMBD, LAYERS, BATCH = 64, 16, 32, 1, 8
STEPS = 300  # stage 2's run, at LR
LR = 3e-3
# stage 3's four runs, at twice the rate: at 120 steps their final losses agree to 0.4% (100: 0.2%, 140: 0.3%);
# at LR they need 200 (0.6%; 2.8% at 120)
STAGE3_STEPS, STAGE3_LR = 120, 6e-3
HPZ_STEPS = 30  # hpZ alone trains bit for bit like plain stage 3: a prefix shows it (and the params there)
HOSTS = ("a", "a", "b", "b")
RUNS = {
    "plain": {},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": 2},
    "qgZ": {"zero_quantized_gradients": True},
    "all": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.attn = nn.Linear(EMBD, 3 * EMBD)
        self.proj, self.fc, self.out = nn.Linear(EMBD, EMBD), nn.Linear(EMBD, 4 * EMBD), nn.Linear(4 * EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, 4, c // 4).transpose(1, 2) for z in self.attn(self.ln_1(x)).split(EMBD, dim=2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(EMBD), nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.head.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable: each next token is a fixed permutation of the last, with 10% noise."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.empty(BATCH, BLOCK + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    for t in range(1, BLOCK + 1):
        noise = torch.randint(0, VOCAB, (BATCH,), generator=gen)
        tokens[:, t] = torch.where(torch.rand(BATCH, generator=gen) < 0.1, noise, perm[tokens[:, t - 1]])
    return tokens[:, :-1], tokens[:, 1:]


def config(lr: float = LR, **zeropp) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 100,
                                  **zeropp}}


def _train(rank: int, world_size: int, steps: int) -> dict:
    import zero

    os.environ["RINGCOMM_HOST"] = HOSTS[rank]
    out = {}
    for name, keys in RUNS.items():
        torch.manual_seed(0)
        engine, *_ = zero.initialize(model=GPT(), config=config(STAGE3_LR, **keys))
        losses, sent = [], []
        for step in range(HPZ_STEPS if name == "hpZ" else steps):
            loss = engine(*batch(step, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            sent.append(engine.last_step_sent_nbytes)
            if name == "plain" and step + 1 == HPZ_STEPS:
                out["plain_prefix"] = [p.detach().numpy().copy() for p in engine.parts.group.full_masters()]
        report = engine.memory_report()
        out[name] = {"losses": losses, "sent": sent[-1], "across": engine.wire_report().across_host_nbytes, "secondary": report.secondary_params_nbytes,
                     "transport": engine.parts.comm.group.transport.kind,
                     "params": [p.detach().numpy().copy() for p in engine.parts.group.full_masters()]}
        engine.destroy()
    return out


@pytest.mark.slow
@pytest.mark.timeout(1000)  # 4 ranks x 510 steps (at 730: 242 s in a CI run with -n 4 on 2 cores); the ranks' own limit is 900 s
def test_zeropp_trains_like_stage3_on_two_hosts():
    results = run_ranks(_train, 4, STAGE3_STEPS, timeout=900)
    runs = results[0]
    assert runs["plain"]["transport"] == "hierarchical"
    plain = runs["plain"]["losses"]
    assert sum(plain[-10:]) / 10 < 0.5 * plain[0], plain[::30]  # it learns
    # hpZ alone moves the same values from elsewhere: the same training, bit for bit (HPZ_STEPS of it)
    assert runs["hpZ"]["losses"] == plain[:HPZ_STEPS]
    for got, want in zip(runs["hpZ"]["params"], runs["plain_prefix"], strict=True):
        assert (got == want).all()
    final = sum(plain[-20:]) / 20  # the final loss: the mean of the last 20 steps' batches
    for name in ("qwZ", "qgZ", "all"):
        losses = runs[name]["losses"]
        assert all(math.isfinite(x) for x in losses), name
        mine = sum(losses[-20:]) / 20
        assert abs(mine - final) <= 0.01 * final, (name, mine, final)
    assert runs["hpZ"]["secondary"] > 0 and runs["plain"]["secondary"] == 0
    # with all three, a step sends a fraction of plain stage 3's bytes (the wire test measures across hosts)
    assert runs["all"]["sent"] < 0.5 * runs["plain"]["sent"], (runs["all"]["sent"], runs["plain"]["sent"])
    # and what crosses hosts is under 0.3x (ideal 0.25x for bf16; here fp32 weights: qwZ sends 1/4 of them)
    assert runs["all"]["across"] <= 0.3 * runs["plain"]["across"], (runs["all"]["across"], runs["plain"]["across"])
    for rank_runs in results[1:]:  # every rank ends with the same parameters
        for got, want in zip(rank_runs["all"]["params"], runs["all"]["params"], strict=True):
            assert (got == want).all()


def _errors(rank: int, world_size: int, hosts: tuple[str, ...]) -> list[str]:
    import zero

    os.environ["RINGCOMM_HOST"] = hosts[rank]
    messages = []
    cases = [({"zero_hpz_partition_size": 3}, 3, None), ({"zero_hpz_partition_size": 2}, 3, None),
             ({"zero_quantized_weights": True}, 2, None), ({"zero_hpz_partition_size": 2}, 2, None),
             ({"zero_quantized_gradients": True}, 1, None), ({"zero_quantized_weights": "yes"}, 3, None),
             ({"zero_quantized_gradients": True}, 3, "torch")]
    for keys, stage, backend in cases:
        cfg = config(**keys)
        cfg["zero_optimization"]["stage"] = stage
        if backend:
            cfg["comm_backend"] = backend
        with pytest.raises(ValueError) as info:
            zero.initialize(model=GPT(), config=cfg)
        messages.append(str(info.value))
    return messages


def test_zeropp_keys_are_checked_against_stage_and_hosts():
    messages = run_ranks(_errors, 4, ("a", "b", "a", "b"), timeout=300)[0]
    assert "zero_hpz_partition_size=3 does not divide the world size 4" in messages[0]
    assert "span hosts ['a', 'b']" in messages[1]
    assert "zero_quantized_weights needs stage 3" in messages[2]
    assert "zero_hpz_partition_size needs stage 3" in messages[3]
    assert "zero_quantized_gradients needs stage 2 or 3" in messages[4]
    assert "zero_quantized_weights must be true or false" in messages[5]
    assert "need comm_backend 'ringcomm'" in messages[6]


def _stage2(rank: int, world_size: int) -> dict:
    import zero

    out = {}
    for name, keys in (("plain", {}), ("qgZ", {"zero_quantized_gradients": True})):
        torch.manual_seed(0)
        cfg = config(**keys)
        cfg["zero_optimization"]["stage"] = 2
        engine, *_ = zero.initialize(model=GPT(), config=cfg)
        losses = []
        for step in range(STEPS):
            loss = engine(*batch(step, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = {"losses": losses, "sent": engine.wire_report().sent_nbytes}
        engine.destroy()
    return out


def test_quantized_gradients_at_stage2():
    """qgZ also serves stage 2 (the same scheduler reduce-scatters its gradients): it trains as plain
    stage 2 does, 300 steps on 2 ranks of one host (one level of all-to-all), and sends fewer bytes."""
    runs = run_ranks(_stage2, 2, timeout=300)[0]
    plain, quantized = runs["plain"]["losses"], runs["qgZ"]["losses"]
    assert all(math.isfinite(x) for x in quantized)
    assert abs(sum(quantized[-20:]) - sum(plain[-20:])) <= 0.01 * sum(plain[-20:]), (quantized[-20:], plain[-20:])
    assert quantized[-1] < 0.9 * quantized[0]
    # half of stage 2's bytes are the updated parameters' all-gather (not quantized); the reduce-scatter's
    # half shrinks to about 1/8 (int4 rows of fp32 gradients): 0.5 + 0.5 / 8 = 0.56
    assert runs["qgZ"]["sent"] < 0.6 * runs["plain"]["sent"], (runs["qgZ"]["sent"], runs["plain"]["sent"])
