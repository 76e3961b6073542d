"""DFlash: a block drafter. One forward drafts a whole block of tokens, conditioned on the target's hidden states.

The model (as published: z-lab/dflash; SpecForge, speculators and llama.cpp serve the same layout):
- the target's hidden states at a few layers (the *inputs* of ``aux_layers``, as EAGLE-3 reads them) are
  concatenated, projected by ``fc`` to the target's width and normed (``hidden_norm``): one context vector per
  position the target has processed;
- a few decoder layers of the target's width; in every layer the queries come from the **block** only, the keys and
  values from [context vectors ; block] through that layer's own k/v projections ("KV injection"): the context
  reaches every layer without the drafter re-reading it;
- the block is the last verified token followed by B - 1 copies of a mask token (the target's embedding of
  ``mask_token_id``), at positions P .. P + B - 1, attending to the whole context and bidirectionally inside the
  block; the output at block slot i (i >= 1) is the draft for the token at P + i, so one forward drafts B - 1;
- the target's embedding and lm_head are shared and frozen (never stored with the head).

Training: random anchors a inside assistant text (the token after a is the assistant's); per anchor the context is
the target's states at positions < a and the block is [token a, mask ...]; block slot i is trained towards the
target's distribution for token a + i (its logits at position a + i - 1 over the data row) with weight
``decay ** (i - 1)``. All anchors of a row share one pass: each block sees its own context prefix and itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from spectrain.drafters.head_io import WEIGHTS_NAME, check_state, read_head_config, save_head
from spectrain.drafters.losses import drafter_loss, sim_tau
from spectrain.registry import FeatureSpec
from spectrain.targets.fingerprint import target_fingerprint


def config_from_target(target, section, aux_layers: list[int], mask_token_id: int) -> dict:
    tc = target.config
    heads = tc.num_attention_heads
    kv = getattr(tc, "num_key_value_heads", None) or heads
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                     "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    return {"kind": "dflash", "target": target.name_or_path, "aux_layers": list(aux_layers),
            "hidden_size": target.hidden_size, "target_hidden_size": target.hidden_size,
            "target_vocab_size": target.vocab_size,
            "num_layers": section.num_layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": getattr(tc, "head_dim", None) or target.hidden_size // heads,
            "intermediate_size": tc.intermediate_size, "rms_norm_eps": getattr(tc, "rms_norm_eps", 1e-6),
            "rope_parameters": dict(rope), "max_position_embeddings": getattr(tc, "max_position_embeddings", 4096),
            "block_size": section.block_size, "mask_token_id": int(mask_token_id), "decay": section.decay,
            "anchors_per_row": section.anchors_per_row}


def aux_layers_for(section, target) -> list[int]:
    """The target layers whose inputs feed fc: the recipe's, else EAGLE's three (low, middle, high)."""
    return target.validate_aux_layers(sorted(section.aux_layers) or target.default_aux_layers())


def features_for(recipe, target) -> FeatureSpec:
    """The registry's ``train.features`` hook: what online training and the feature cache compute."""
    return FeatureSpec(tuple(aux_layers_for(recipe.drafter.sections["dflash"], target)), last_hidden=True)


def default_mask_token(target) -> int:
    """A token id whose (frozen) embedding marks the slots to draft: the tokenizer's pad / unk token, else the last
    id of the vocabulary (rarely a real token's)."""
    tok = target.tokenizer
    for name in ("pad_token_id", "unk_token_id"):
        tid = getattr(tok, name, None) if tok is not None else None
        if isinstance(tid, int) and 0 <= tid < target.vocab_size:
            return tid
    return target.vocab_size - 1


class BlockLayer(nn.Module):
    """Pre-norm Llama layer whose attention reads keys / values of [context ; block] and queries of the block."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.input_layernorm = LlamaRMSNorm(h, eps)
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, cfg["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(h, cfg["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(cfg["intermediate_size"], h, bias=False)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotated) and values [1, heads, n, hd] of n rows of context vectors or normed block states."""
        n = x.shape[1]
        k = self.k_proj(x).view(1, n, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(1, n, self.nkv, self.hd).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        rep = self.nh // self.nkv
        return k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x [1, m, H] block states; ctx_k/v the context's keys / values; mask [m, n_ctx + m] (True = attend)."""
        m = x.shape[1]
        normed = self.input_layernorm(x)
        q = self.q_proj(normed).view(1, m, self.nh, self.hd).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        bk, bv = self.kv(normed, cos, sin)
        out = F.scaled_dot_product_attention(q, torch.cat([ctx_k, bk], 2), torch.cat([ctx_v, bv], 2),
                                             attn_mask=mask)
        x = x + self.o_proj(out.transpose(1, 2).reshape(1, m, self.nh * self.hd))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashHead(nn.Module):
    kind = "dflash"

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = dict(cfg)
        h = cfg["hidden_size"]
        self.aux_layers = list(cfg["aux_layers"])
        self.fc = nn.Linear(len(self.aux_layers) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg["num_layers"]))
        self.norm = LlamaRMSNorm(h, cfg["rms_norm_eps"])
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(
            hidden_size=h, num_attention_heads=cfg["num_attention_heads"], head_dim=cfg["head_dim"],
            rope_parameters=dict(cfg["rope_parameters"]), max_position_embeddings=cfg["max_position_embeddings"]))
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)

    @classmethod
    def from_recipe(cls, recipe, target, token_counts=None) -> DFlashHead:
        section = recipe.drafter.sections["dflash"]
        aux = aux_layers_for(section, target)
        mask = section.mask_token_id if section.mask_token_id >= 0 else default_mask_token(target)
        if mask >= target.vocab_size:
            raise ValueError(f"drafter.dflash.mask_token_id={mask} is outside the target's vocabulary "
                             f"(0..{target.vocab_size - 1}); give a token id of the target, or -1 for the default")
        cfg = config_from_target(target, section, aux, mask)
        cfg["loss"] = recipe.drafter.loss
        cfg["target_fingerprint"] = target_fingerprint(target)
        return cls(cfg).to(target.device)

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(tuple(self.aux_layers), last_hidden=True)  # last hidden: the teacher's logits

    # ---- the shared forward ------------------------------------------------------------------
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Context vectors [.., n, H] from the concatenated aux states [.., n, len(aux_layers) * H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys (rotated) and values of context vectors ctx [n, H] at positions ctx_pos [n]."""
        cos, sin = self.rotary(ctx[None], ctx_pos[None])
        return [layer.kv(ctx[None], cos, sin) for layer in self.layers]

    def block_logits(self, target, emb, block_pos, ctx_kv, mask) -> torch.Tensor:
        """emb [m, H] block inputs at positions block_pos [m]; ctx_kv the context's keys / values per layer
        (``context_kv``, n positions); mask [m, n + m]. Returns fp32 logits [m, V]: the head's own final norm, then
        the target's frozen lm_head."""
        x = emb[None].to(self.fc.weight.dtype)
        cos_b, sin_b = self.rotary(x, block_pos[None])
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos_b, sin_b, ck, cv, mask[None, None])
        head = target.lm_head
        return head(self.norm(x[0]).to(head.weight.dtype)).float()

    # ---- training ----------------------------------------------------------------------------
    def anchors(self, lm: torch.Tensor, am: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Up to ``anchors_per_row`` random positions a whose next token is the assistant's (lm, am: one row)."""
        ok = torch.zeros_like(lm)
        ok[:-1] = lm[1:] & am[1:] & am[:-1]
        ok[0] = False  # a block needs at least one context position before it
        cand = ok.nonzero()[:, 0]
        n = min(int(self.config["anchors_per_row"]), cand.numel())
        pick = torch.randperm(cand.numel(), generator=gen)[:n].to(cand.device)
        return cand[pick].sort().values

    def train_loss(self, batch: dict, feats: dict, target) -> tuple[torch.Tensor, dict[str, float]]:
        ids, am, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
        B, name = self.config["block_size"], self.config.get("loss", "fkl")
        gen = torch.Generator().manual_seed(int(ids.sum()) % (2**31))  # the same anchors on every rank / resume
        students, teachers, masks = [], [], []
        for r in range(ids.shape[0]):
            a = self.anchors(lm[r], am[r], gen)
            if a.numel() == 0:
                continue
            s, t, m = self._row(target, ids[r], am[r], lm[r], feats["aux"][r], feats["last_hidden"][r], a, B)
            students.append(s), teachers.append(t), masks.append(m)
        if not students:
            zero = self.fc.weight.sum() * 0.0  # a graph, so every rank steps alike
            return zero, {"loss": 0.0, "tokens": 0.0}
        s, t, m = torch.cat(students), torch.cat(teachers), torch.cat(masks)  # [N, B-1, V], [N, B-1]
        total = torch.zeros((), device=ids.device)
        metrics: dict[str, float] = {"tokens": float(m[:, 0].sum())}
        agree = s.detach().argmax(-1) == t.argmax(-1)  # [N, B-1]
        accs = []
        for i in range(B - 1):
            li = drafter_loss(name, s[:, i], t[:, i], t[:, i].argmax(-1), m[:, i])
            total = total + self.config["decay"] ** i * li
            # acc_i: slot i + 1 agrees where every earlier slot was supervised and agreed (a chain's acceptance)
            base = (agree[:, :i] & m[:, :i]).all(-1) & m[:, i]
            accs.append(float((agree[:, i] & base).sum()) / max(float(base.sum()), 1.0))
            metrics[f"loss_{i}"], metrics[f"acc_{i}"] = float(li.detach()), accs[-1]
        metrics["loss"] = float(total.detach())
        metrics["sim_tau"] = sim_tau(accs)  # PROXY: teacher-forced, each slot conditioned on the earlier ones
        return total, metrics

    def _row(self, target, ids, am, lm, aux, last, anchors, B):
        """One row's anchors in one pass: student logits [N, B-1, V], teacher logits, supervision mask."""
        L, N, dev = int(am.sum()), anchors.numel(), ids.device
        ctx = self.context(aux[:L])
        slots = torch.arange(B, device=dev)
        block_pos = (anchors[:, None] + slots[None]).reshape(-1)  # [N*B]
        tok = torch.full((N, B), self.config["mask_token_id"], device=dev, dtype=ids.dtype)
        tok[:, 0] = ids[anchors]
        with torch.no_grad():
            emb = target.embed(tok.reshape(-1))
        owner = torch.arange(N, device=dev).repeat_interleave(B)
        sees_ctx = torch.arange(L, device=dev)[None, :] < anchors[owner][:, None]  # context before the anchor
        same_block = owner[:, None] == owner[None, :]
        mask = torch.cat([sees_ctx, same_block], 1)
        logits = self.block_logits(target, emb, block_pos, self.context_kv(ctx, torch.arange(L, device=dev)), mask)
        student = logits.view(N, B, -1)[:, 1:]
        pred = (anchors[:, None] + slots[None, 1:])  # positions of the drafted tokens [N, B-1]
        inside = pred < L
        with torch.no_grad():
            src = (pred - 1).clamp(max=L - 1)  # the target's logits at position t - 1 are its distribution for t
            teacher = target.logits_from_last_hidden(last[src.reshape(-1)]).float().view(N, B - 1, -1)
            sup = inside & lm[pred.clamp(max=L - 1)] & am[pred.clamp(max=L - 1)]
        return student, teacher, sup

    # ---- persistence -------------------------------------------------------------------------
    def save_pretrained(self, path, state_dict: dict | None = None) -> None:
        save_head(path, self.config, state_dict or self.state_dict())

    @classmethod
    def from_pretrained(cls, path, target) -> DFlashHead:
        cfg = read_head_config(path, "dflash", target, "DFlash head")
        target.validate_aux_layers(cfg["aux_layers"])
        state = load_file(str(Path(path) / WEIGHTS_NAME))
        model = cls(cfg)
        check_state(state, model, f"DFlash head at {path}")
        model.load_state_dict(state, strict=True)
        return model.to(target.device)
