"""Models the benchmarks share."""
from __future__ import annotations


def mlp(layers: int, width: int, seed: int = 0):
    """`layers` x (Linear(width, width), ReLU), seeded: the same weights on every rank."""
    import torch

    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)
