"""Attention masks that spectrain builds itself (4-D, taken as-is by HF models): tree verification and
batched decoding with holes. One bool mask (True = attend) serves every layer."""

from __future__ import annotations

import torch


def tree_mask(target, parents: list[int], P: int, pos: torch.Tensor) -> torch.Tensor:
    """[1, 1, q, P + q] mask: every node sees the whole past, its ancestors and itself."""
    q = len(parents) + 1
    dev = pos.device
    tree = torch.zeros(q, q, dtype=torch.bool, device=dev)
    tree[0, 0] = True
    for i, par in enumerate(parents):
        tree[i + 1] = tree[par + 1]
        tree[i + 1, i + 1] = True
    mask = torch.cat([torch.ones(q, P, dtype=torch.bool, device=dev), tree], dim=1)
    window = uniform_sliding_window(target.config, P + q)
    if window is not None:
        kpos = torch.cat([torch.arange(P, device=dev), pos])
        mask &= (pos[:, None] - kpos[None, :]) < window
    return as_attn_mask(target, mask[None, None])


def as_attn_mask(target, mask: torch.Tensor) -> torch.Tensor:
    """A 4-D bool mask (True = attend) in the form the target's attention implementation takes."""
    impl = getattr(target.config, "_attn_implementation", "sdpa")
    if impl == "sdpa" or impl is None:
        return mask
    if impl == "eager":  # eager adds the mask to the scores
        zero = torch.zeros((), dtype=target.dtype, device=mask.device)
        return torch.where(mask, zero, torch.finfo(target.dtype).min)
    raise ValueError(f"tree verification and batched decoding need a custom attention mask, which "
                     f"attn_implementation={impl!r} does not take; load the target with attn_implementation='sdpa' "
                     "(or use chain drafts with batch_size=None)")


def uniform_sliding_window(config, length: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or length <= window:
        return None
    types = getattr(config, "layer_types", None)
    if types is None and getattr(config, "use_sliding_window", True) is False:
        return None
    if types is not None and "sliding_attention" not in types:
        return None
    if types is not None and len(set(types)) > 1:
        raise ValueError("tree verification beyond the sliding window of a model that mixes sliding and full "
                         "attention layers is not supported (one custom mask serves all layers); use chain drafts")
    return int(window)
