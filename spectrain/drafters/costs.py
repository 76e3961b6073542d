"""The arithmetic every family's cost hooks share, so that each family states only its own formula.

Two costs, read by two callers (their formulas: spectrain/train/plan.py and spectrain/eval/roofline.py):
``TrainingCost``, what training a drafter costs per token (the record's ``train.cost``, read by the plan of
`spectrain check --plan`), from a model's ``Shape``; ``ModelCost``, what one forward of a model costs (the
record's ``decode.deploy_cost``, read by the roofline), from ``config_dims`` and ``layer_params``. Pure
arithmetic: no torch, no model. Kept below the families (not in train/ or eval/) because the hooks that
return these live in the families' own modules, and a family may not import the layers above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the roofline owns the accelerators
    from spectrain.eval.roofline import Accelerator


# ---- training: the plan's shapes and per-token cost --------------------------------------------------------


@dataclass
class Shape:
    layers: int
    hidden: int
    inter: int
    heads: int
    kv: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, cfg) -> Shape:
        heads = cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, heads,
                   getattr(cfg, "num_key_value_heads", None) or heads, hd, cfg.vocab_size,
                   bool(getattr(cfg, "tie_word_embeddings", False)))

    def layer(self, in_mult: int = 1, inter: int = 0, heads: int = 0) -> int:
        """Matmul weights of one decoder layer (attention input `in_mult` x H wide, as EAGLE-3's first layer)."""
        h, q = self.hidden, (heads or self.heads) * self.head_dim
        kv = self.kv * self.head_dim if not heads or heads == self.heads else q
        return in_mult * h * (q + 2 * kv) + q * h + 3 * h * (inter or self.inter)

    def params(self) -> int:
        """All weights (embedding + layers + lm_head)."""
        return self.layers * self.layer() + self.vocab * self.hidden * (1 if self.tied else 2)

    def matmul(self) -> int:
        """Weights a token's forward multiplies by: the layers and the lm_head (not the embedding lookup)."""
        return self.layers * self.layer() + self.vocab * self.hidden


@dataclass
class TrainingCost:
    """What training one drafter costs per token: weights, FLOPs and the bytes a micro-batch keeps."""

    params: int  # all weights of the drafter
    trained: int  # weights the optimizer updates
    train_flops: float  # per token, forward + backward
    logits_bytes: float  # per token of a micro-batch: the loss's fp32 logit copies
    act_bytes: float  # per token: other activations kept for backward
    n_aux: int  # aux hidden states in the feature cache


# ---- deployment: one forward's bytes and FLOPs (the roofline's model) ---------------------------------------


@dataclass(frozen=True)
class ModelCost:
    """What one forward of a model costs, per spectrain/eval/roofline.py's module docstring."""

    weight_bytes: float
    params: float  # weights touched per token (2 FLOPs each)
    kv_bytes_per_token: float
    layers: int = 0
    attn_dim: int = 0  # heads * head_dim

    def time(self, acc: Accelerator, batch: int, tokens: int, context: int) -> float:
        mem = self.weight_bytes + batch * context * self.kv_bytes_per_token
        flops = batch * tokens * (2 * self.params + 4 * self.layers * self.attn_dim * context)
        return max(mem / acc.bandwidth, flops / acc.flops)


def config_dims(cfg) -> dict:
    """The sizes of a Llama-style HF config (object or dict): h, nh, hd, nkv, n, inter, vocab, tied."""
    g = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    h, nh = int(g("hidden_size")), int(g("num_attention_heads"))
    hd = int(g("head_dim") or h // nh)
    return dict(h=h, nh=nh, hd=hd, nkv=int(g("num_key_value_heads") or nh), n=int(g("num_hidden_layers")),
                inter=int(g("intermediate_size")), vocab=int(g("vocab_size")), tied=bool(g("tie_word_embeddings", False)))


def layer_params(h: int, nh: int, nkv: int, hd: int, inter: int, attn_in: int | None = None) -> int:
    """Matmul weights of one decoder layer whose attention reads ``attn_in`` (default h) wide inputs."""
    attn_in = attn_in or h
    return attn_in * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter
