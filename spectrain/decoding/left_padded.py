"""Plain KV-cached decoding of a batch of prompts, left-padded: what `spectrain regenerate` (the target answers
the recipe's prompts) and on-policy training (the student samples continuations) both run. Position ids count
real tokens only, so every row sees exactly what it would alone; the caller's ``pick`` owns sampling and stops."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache


@torch.no_grad()
def left_padded_decode(forward: Callable, prompts: list[list[int]], pad_id: int, max_new: int, pick: Callable,
                       device) -> None:
    """Run ``forward(ids, attention_mask, position_ids, cache) -> last-position logits [B, V]`` over the prompts,
    then once per new token: ``pick(logits)`` returns the tokens to feed next ([B]) or None when every row is
    done. At most ``max_new`` forwards (the prefill included); the cache is the batch's own."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    am = torch.zeros((len(prompts), n), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, n - len(p):], am[r, n - len(p):] = torch.tensor(p), 1
    ids, am = ids.to(device), am.to(device)
    pos, cache = (am.cumsum(-1) - 1).clamp(min=0), DynamicCache()
    for i in range(max_new):
        feed = pick(forward(ids, am, pos, cache))
        if feed is None or i + 1 == max_new:
            return
        ids = torch.as_tensor(feed, device=device)[:, None]
        am = torch.cat([am, am.new_ones(len(prompts), 1)], 1)
        pos = pos[:, -1:] + 1
