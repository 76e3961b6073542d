"""Where a training batch's target features come from: the frozen target run inside the step (online),
or the offline cache written by ``spectrain prepare-features`` (spectrain.data.feature_cache.FeatureCache). Both
serve ``len``, ``lengths``, ``bind(feature_spec)`` and ``get(indices) -> (batch, feats)``."""

from __future__ import annotations

import torch

from spectrain.data.dataset import collate
from spectrain.data.feature_cache import FeatureCache
from spectrain.data.features import _pad_id
from spectrain.registry import FeatureSpec


class OnlineSource:
    """Tokenised rows + the frozen target: features are computed inside the step, without grad."""

    def __init__(self, rows, target, pad_id: int, device):
        self.rows, self.target, self.pad_id, self.device = rows, target, pad_id, device
        self.spec = FeatureSpec()
        lengths = getattr(rows, "lengths", None)
        self.lengths = lengths.tolist() if lengths is not None else [len(r["input_ids"]) for r in rows]

    def __len__(self) -> int:
        return len(self.rows)

    def bind(self, spec: FeatureSpec | dict) -> None:
        self.spec = FeatureSpec.of(spec)

    def token_rows(self, indices: list[int]) -> list[dict]:
        return [self.rows[i] for i in indices]

    def get(self, indices: list[int]) -> tuple[dict, dict]:
        batch = {k: v.to(self.device) for k, v in collate(self.token_rows(indices), self.pad_id).items()}
        return batch, target_features(self.target, batch, self.spec)


def target_features(target, batch: dict, spec: FeatureSpec | dict) -> dict:
    """The frozen target's features of a collated batch that a drafter's ``feature_spec`` asks for (no grad)."""
    spec = FeatureSpec.of(spec)
    out = target.forward(batch["input_ids"], batch["attention_mask"], aux_layers=list(spec.aux_layers),
                         want_last_hidden=spec.last_hidden, want_final_hidden=spec.final_hidden, want_logits=False)
    feats = {}
    if out.aux_hidden:
        feats["aux"] = torch.cat(out.aux_hidden, -1)
    if out.last_hidden is not None:
        feats["last_hidden"] = out.last_hidden
    if spec.final_hidden:
        feats["final_hidden"] = out.final_hidden
    return feats


def require_feature_cache(recipe) -> str:
    path = recipe.training.feature_cache
    if recipe.training.features == "offline" and not path:
        raise ValueError("training.features=offline needs training.feature_cache (the directory written by "
                         "`spectrain prepare-features RECIPE`)")
    return path


def make_sources(recipe, target, train_rows, heldout_rows, device):
    """(train, heldout) sources with the same interface: len, lengths, bind(spec), get(indices)."""
    if recipe.training.features == "offline":
        path = require_feature_cache(recipe)
        train = FeatureCache(path, target, recipe, "train", device=device)
        train.match(train_rows)
        held = None
        if "heldout" in train.manifest["splits"] and heldout_rows is not None and len(heldout_rows):
            held = FeatureCache(path, target, recipe, "heldout", device=device)
            held.match(heldout_rows)
        return train, held

    pad = _pad_id(target)
    held = OnlineSource(heldout_rows, target, pad, device) if heldout_rows is not None and len(heldout_rows) else None
    return OnlineSource(train_rows, target, pad, device), held
