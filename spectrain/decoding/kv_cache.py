"""Every edit of an HF ``DynamicCache`` goes through here: the target's cache in both decoding loops and the
draft models' own caches (EAGLE-3 heads keep plain ``(keys, values)`` tensors and use ``gather_slots``).

Why one place: a cache edit must skip layers that hold nothing yet (lazy or sliding layers) and must keep
``cumulative_length`` (newer transformers read it for the next position) equal to the keys' length; when
these rules were written out per call site they drifted.
"""

from __future__ import annotations

import torch


def layers(cache):
    """The layers that hold entries (uninitialised or empty layers are skipped)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None and layer.keys.numel():
            yield layer


def _set(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = keys.shape[-2]


def crop(cache, n: int) -> None:
    """Keep the first ``n`` positions of every row."""
    for layer in layers(cache):
        _set(layer, layer.keys[..., :n, :], layer.values[..., :n, :])


def keep_path(cache, keep_prefix: int, path: list[int]) -> None:
    """Keep the first ``keep_prefix`` entries (past + root) plus the accepted nodes' entries ``path``
    (indices into the nodes after the root): a crop for a chain, a gather for a tree."""
    if path == list(range(len(path))):
        crop(cache, keep_prefix + len(path))
        return
    idx = None
    for layer in layers(cache):
        if idx is None:
            idx = torch.tensor(list(range(keep_prefix)) + [keep_prefix + i for i in path], device=layer.keys.device)
        _set(layer, layer.keys.index_select(-2, idx), layer.values.index_select(-2, idx))


def select_rows(cache, slot_pos: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Keep batch rows ``keep`` (rows that stopped leave the batch); returns their ``slot_pos``."""
    idx = torch.tensor(keep, device=slot_pos.device)
    for layer in layers(cache):
        _set(layer, layer.keys.index_select(0, idx), layer.values.index_select(0, idx))
    return slot_pos.index_select(0, idx)


def compact_order(slot_pos: torch.Tensor, min_holes: int = 16) -> torch.Tensor | None:
    """Slot indices [B, n] that gather each row's valid slots in order (left padded with holes), or
    None while holes do not yet outnumber the valid slots (then compaction would not pay)."""
    valid = slot_pos >= 0
    n = int(valid.sum(1).max())
    S = slot_pos.shape[1]
    if S - n < max(n, min_holes):
        return None
    # stable: holes first (they become the left padding), then the valid slots in their original order
    return torch.argsort(valid.long() * S + torch.arange(S, device=slot_pos.device)[None], dim=1)[:, S - n:]


def gather_slots(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t [B, heads, S, dim] -> [B, heads, n, dim] at the slots `order` [B, n]."""
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))


def compact(cache, slot_pos: torch.Tensor) -> torch.Tensor:
    """Gather every row's valid slots to the right once holes outnumber them; returns the new ``slot_pos``."""
    order = compact_order(slot_pos)
    if order is None:
        return slot_pos
    for layer in layers(cache):
        _set(layer, gather_slots(layer.keys, order), gather_slots(layer.values, order))
    return slot_pos.gather(1, order)
