"""What each optimizer step trains on and how fast: the seeded data order, each rank's micro-batches, the
learning-rate schedule and the optimizer (trained parameters only, never the target's)."""

from __future__ import annotations

import math

import torch
from torch import nn


def lr_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based): linear warmup, then the schedule."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_micro_batches(rows: list[int], lengths: list[int], micro: int, rank: int, world: int) -> list[list[int]]:
    """This rank's micro-batches of one global batch: length-sorted, dealt round-robin across ranks."""
    order = sorted(range(len(rows)), key=lambda i: (lengths[i], rows[i]))
    ranked = [rows[i] for i in order]
    chunks = [ranked[i:i + micro] for i in range(0, len(ranked), micro)]
    return chunks[rank::world]


def build_optimizer(recipe, drafter: nn.Module, target) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    params = [p for p in drafter.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"drafter {type(drafter).__name__} has no trainable parameters")
    frozen = {id(p) for p in target.model.parameters()}
    leaked = [n for n, p in drafter.named_parameters() if p.requires_grad and id(p) in frozen]
    # The target is a frozen feature extractor: a shared tensor in the optimizer would train it.
    assert not leaked, f"target parameters would be trained through the drafter: {leaked}"
    t = recipe.training
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms and biases: no weight decay
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=tuple(t.adam_betas), eps=1e-8)
    return opt, params
