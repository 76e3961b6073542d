"""Attention masks that spectrain builds itself (4-D, taken as-is by HF models): tree verification and
batched decoding with holes.

Sliding-window layers see only keys less than ``config.sliding_window`` positions behind the query,
measured in logical positions (a tree node's position is P + its depth; a batched row's slots carry
their own positions), which is what HF's own sliding mask does for a contiguous cache. When every
layer slides (Mistral, or ``layer_types`` all ``sliding_attention``) one windowed mask serves all
layers; when ``config.layer_types`` mixes sliding and full attention (Gemma 2/3, Qwen2/3 with
``max_window_layers``, GPT-OSS ...) the model gets ``{layer type: mask}``, which HF decoders with
layer types take as the per-layer masks as-is. Masks are bool (True = attend) for sdpa and additive
floats for eager (``as_attn_mask``)."""

from __future__ import annotations

import torch

KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


def tree_mask(target, parents: list[int], P: int, pos: torch.Tensor):
    """The attention mask of one tree verification pass ([1, 1, q, P + q] per layer type, see
    ``layer_masks``): every node sees the whole past, its ancestors and itself. ``pos``: the nodes'
    positions (P + depth)."""
    q = len(parents) + 1
    dev = pos.device
    tree = torch.zeros(q, q, dtype=torch.bool, device=dev)
    tree[0, 0] = True
    for i, par in enumerate(parents):
        tree[i + 1] = tree[par + 1]
        tree[i + 1, i + 1] = True
    allowed = torch.cat([torch.ones(q, P, dtype=torch.bool, device=dev), tree], dim=1)
    kpos = torch.cat([torch.arange(P, device=dev), pos])
    return layer_masks(target, allowed[None], pos[None], kpos[None])


def layer_masks(target, allowed: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor):
    """The ``attention_mask`` for a forward whose queries at positions ``qpos`` [B, q] attend to keys at
    positions ``kpos`` [B, K] where ``allowed`` [B, q, K] (bool, no window applied yet; holes already
    excluded). Returns one 4-D mask [B, 1, q, K] when every layer sees the same keys, else a dict
    ``{layer type: 4-D mask}`` (sliding layers windowed, full layers not)."""
    window = sliding_window(target.config)
    if window is None:
        return as_attn_mask(target, allowed[:, None])
    windowed = allowed & ((qpos[:, :, None] - kpos[:, None, :]) < window)
    types = set(getattr(target.config, "layer_types", None) or ["sliding_attention"])
    if types == {"sliding_attention"} or torch.equal(windowed, allowed):
        return as_attn_mask(target, windowed[:, None])  # uniform window, or nothing lies beyond it
    unknown = sorted(types - set(KNOWN_LAYER_TYPES))
    if unknown:
        raise ValueError(f"the target has layer types {unknown}, for which spectrain builds no attention mask (it "
                         f"builds {' and '.join(KNOWN_LAYER_TYPES)} masks); use chain drafts with batch_size=None")
    full, sliding = as_attn_mask(target, allowed[:, None]), as_attn_mask(target, windowed[:, None])
    return {t: sliding if t == "sliding_attention" else full for t in types}


def sliding_window(config) -> int | None:
    """The window of the model's sliding-attention layers, or None when no layer slides."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is None and getattr(config, "use_sliding_window", True) is False:
        return None
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


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


def batch_mask(target, slot_pos: torch.Tensor, qpos: torch.Tensor, anc: torch.Tensor, sizes: torch.Tensor):
    """[B, 1, q, S + q] (per layer type, see layer_masks): valid past slots, tree ancestors, itself.
    Padded nodes (index > the row's proposal size) see only themselves: finite, and never seen."""
    B, q = qpos.shape
    real = torch.arange(q, device=qpos.device)[None, :] <= sizes[:, None]  # [B, q]
    past = (slot_pos >= 0)[:, None, :] & real[:, :, None]  # [B, q, S]
    eye = torch.eye(q, dtype=torch.bool, device=qpos.device).expand(B, q, q)
    allowed = torch.cat([past, (anc & real[:, None, :]) | eye], -1)
    return layer_masks(target, allowed, qpos, torch.cat([slot_pos, qpos], 1))
