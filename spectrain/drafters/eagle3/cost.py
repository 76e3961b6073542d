"""What an EAGLE-3 head costs, as the family's record names it: to train (``train.cost``, the plan of
`spectrain check --plan`) and to run deployed (``decode.deploy_cost``, the roofline of `spectrain eval
--batch-size ...` and `spectrain crossover`). The shared shapes and cost records: spectrain/drafters/costs.py."""

from __future__ import annotations

from spectrain.drafters.costs import ModelCost, Shape, TrainingCost, config_dims, layer_params


def training_cost(recipe, t: Shape, student: Shape | None = None, seq: float = 0.0) -> TrainingCost:
    """fc + K TTT steps of the draft layers and the draft-vocab lm_head (the record's ``train.cost`` hook)."""
    e = recipe.drafter.eagle3
    layer = t.layer(2, e.intermediate_size, e.num_attention_heads)
    head, fc = e.draft_vocab_size * t.hidden, 3 * t.hidden * t.hidden
    p = fc + e.num_layers * layer + head
    k = e.ttt_steps
    flops = 6 * fc + k * (6 * (p - fc) + 12 * e.num_layers * t.hidden * seq)
    return TrainingCost(p, p - (head if e.freeze_lm_head else 0), flops, 4 * (t.vocab + 2 * k * e.draft_vocab_size),
                        k * (10 * t.hidden + 3 * (e.intermediate_size or t.inter)) * 2, 3)


def head_cost(target_cfg, draft_vocab: int = 32000, dtype_bytes: int = 2) -> ModelCost:
    """One forward of a head sized like spectrain builds it for this target: fc (3H -> H), one decoder layer
    whose attention reads 2H, lm_head over the draft vocabulary."""
    d = config_dims(target_cfg)
    h = d["h"]
    params = 3 * h * h + layer_params(h, d["nh"], d["nkv"], d["hd"], d["inter"], attn_in=2 * h) + draft_vocab * h
    return ModelCost(weight_bytes=params * dtype_bytes, params=params,
                     kv_bytes_per_token=2 * d["nkv"] * d["hd"] * dtype_bytes, layers=1, attn_dim=d["nh"] * d["hd"])


def deploy_cost(target_cfg, head_cfg: dict, dtype_bytes: int = 2) -> ModelCost:
    """The record's ``decode.deploy_cost`` hook: the head spectrain would build for this target, with the saved
    head's draft vocabulary."""
    return head_cost(target_cfg, head_cfg["draft_vocab_size"], dtype_bytes)
