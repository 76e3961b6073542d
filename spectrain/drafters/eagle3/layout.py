"""EAGLE-3 head configuration, with no module in it: the draft vocabulary, the config derived from the target,
the four layer-layout flags, the aux-feature order every engine feeds fc, and the sliding-window key rule."""

from __future__ import annotations

import warnings

import torch
from transformers import LlamaConfig

from spectrain.registry import FeatureSpec


def build_draft_vocab(token_counts: torch.Tensor | None, draft_vocab_size: int,
                      vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent target ids (ties -> lower id), sorted -> (d2t, t2d)."""
    if draft_vocab_size > vocab_size:
        raise ValueError(f"drafter.eagle3.draft_vocab_size={draft_vocab_size} is larger than the target's "
                         f"vocabulary ({vocab_size}); use at most {vocab_size} (= the full vocabulary)")
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    if draft_vocab_size == vocab_size:
        ids = torch.arange(vocab_size)
    else:
        if token_counts is None:
            raise ValueError(f"a reduced draft vocab ({draft_vocab_size} < {vocab_size}) is built from token "
                             "frequencies under the loss mask; pass token_counts (data.token_frequencies)")
        if token_counts.numel() != vocab_size:
            raise ValueError(f"token_counts has {token_counts.numel()} entries, the target vocab {vocab_size}")
        order = torch.sort(token_counts.double().cpu(), descending=True, stable=True).indices
        ids = torch.sort(order[:draft_vocab_size]).values
    d2t = (ids - torch.arange(draft_vocab_size)).long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def config_from_target(target, eagle3_cfg, aux_layers: list[int], draft_vocab_size: int) -> dict:
    """The drafter's decoder-layer config, derived from the target's unless overridden."""
    tc = target.config
    heads = eagle3_cfg.num_attention_heads or tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    if eagle3_cfg.num_attention_heads or heads % kv_heads:
        kv_heads = heads  # an override drops the target's GQA grouping (it may not divide)
    hidden = target.hidden_size
    head_dim = getattr(tc, "head_dim", None) if not eagle3_cfg.num_attention_heads else None
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                     "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    return {
        "kind": "eagle3", "target": target.name_or_path, "aux_layers": list(aux_layers),
        "target_hidden_size": hidden, "target_vocab_size": target.vocab_size, "hidden_size": hidden,
        "draft_vocab_size": draft_vocab_size, "num_layers": eagle3_cfg.num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads,
        "intermediate_size": eagle3_cfg.intermediate_size or tc.intermediate_size,
        "rms_norm_eps": getattr(tc, "rms_norm_eps", 1e-6), "rope_parameters": dict(rope),
        "max_position_embeddings": getattr(tc, "max_position_embeddings", 4096), "hidden_act": "silu",
        "ttt_steps": eagle3_cfg.ttt_steps, "ttt_decay": eagle3_cfg.ttt_decay,
        "target_num_layers": target.num_layers, **{k: bool(getattr(eagle3_cfg, k)) for k in LAYOUT_FLAGS},
        **({"layer_types": ["sliding_attention"] * eagle3_cfg.num_layers, "sliding_window": eagle3_cfg.sliding_window}
           if eagle3_cfg.sliding_window else {}),
    }


LAYOUT_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def layout(cfg: dict) -> dict[str, bool]:
    """The four layer-layout flags of a head config (absent = false: heads saved before they existed)."""
    flags = {k: bool(cfg.get(k, False)) for k in LAYOUT_FLAGS}
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise ValueError("norm_before_fc and fc_norm are exclusive (one RMSNorm over the concatenated aux states, "
                         "or one per aux state): set at most one of them")
    return flags


def layer_config(cfg: dict) -> LlamaConfig:
    """A Llama config for the draft decoder layer (RoPE helper here; `transformer_layer_config` on export)."""
    return LlamaConfig(
        vocab_size=cfg["target_vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_layers"],
        intermediate_size=cfg["intermediate_size"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        rms_norm_eps=cfg["rms_norm_eps"], rope_parameters=dict(cfg["rope_parameters"]),
        max_position_embeddings=cfg["max_position_embeddings"], hidden_act="silu", tie_word_embeddings=False)


def sort_aux(cfg: dict, state: dict[str, torch.Tensor], what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Ascending aux ids, with fc's input blocks (and input_norm / fc_norm) permuted alongside: the same function,
    in the order every engine feeds fc. Warns when it had to move anything."""
    aux = list(cfg["aux_layers"])
    order = sorted(range(len(aux)), key=aux.__getitem__)
    if order == list(range(len(aux))):
        return cfg, state
    warnings.warn(f"{what}: aux layer ids {aux} are not ascending; fc's input blocks were reordered to "
                  f"{sorted(aux)} (the same function, in the order vLLM/SGLang/TensorRT-LLM feed fc)", stacklevel=3)
    state = dict(state)
    n = len(aux)
    for name in ("fc.weight", "input_norm.weight"):
        if name in state:
            blocks = state[name].chunk(n, -1)
            state[name] = torch.cat([blocks[i] for i in order], -1).contiguous()
    norms = {i: state.pop(f"fc_norm.{i}.weight") for i in range(n) if f"fc_norm.{i}.weight" in state}
    for new, old in enumerate(order):
        if old in norms:
            state[f"fc_norm.{new}.weight"] = norms[old]
    return {**cfg, "aux_layers": sorted(aux)}, state


def window_keep(anchors: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    """[m, n_keys]: committed key j is within ``window`` of the row's anchor position (j <= anchor is the mask's job)."""
    return (anchors[:, None] - torch.arange(n_keys, device=anchors.device)[None, :]) < window


# ---- the family record's hooks (spectrain/registry.py) -------------------------------------------------


def features_for(recipe, target) -> FeatureSpec:
    """The target features a recipe's EAGLE-3 head reads: its aux layers (the recipe's, else the EAGLE
    convention for this target) and the last hidden state (teacher logits)."""
    aux = target.validate_aux_layers(list(recipe.drafter.eagle3.aux_layers) or target.default_aux_layers())
    return FeatureSpec(tuple(aux), last_hidden=True)


def preflight(recipe, cfg, tok) -> None:
    """Before any compute: the draft vocabulary fits the target's, the aux layers exist in it."""
    e = recipe.drafter.eagle3
    if e.draft_vocab_size > cfg.vocab_size:
        raise ValueError(f"drafter.eagle3.draft_vocab_size={e.draft_vocab_size} exceeds the target vocab "
                         f"({cfg.vocab_size}); set it <= {cfg.vocab_size}")
    n = cfg.num_hidden_layers
    bad = [i for i in e.aux_layers if i >= n]
    if bad:
        raise ValueError(f"drafter.eagle3.aux_layers {bad} out of range: the target has {n} layers "
                         f"(ids are layer inputs, 0..{n - 1}; the final output is not an aux layer)")
