"""EAGLE-3 head: the model and its training-time test (TTT); decoding is in decode.py, foreign formats in interop.py.

Alignment (x = tokens, g_t = fused aux features of the target at position t, p_t = the target's
distribution at position t, which predicts x_{t+1}):

- TTT step 0 at anchor t: input (embed(x_{t+1}), fc(g_t)) at RoPE position t, predicts x_{t+2},
  trained against p_{t+1}.
- Step i > 0 at anchor t: input (embed(x_{t+1+i}), the layer output of step i-1 at anchor t) at
  position t+i, trained against p_{t+1+i}. It attends to the step-0 keys at anchors 0..t and to
  the step-1..i keys of anchor t only (the "diagonal"), which is exactly what a drafted chain sees
  in decoding: the committed prefix (always built from true target features) plus its own ancestors.
- Loss masks: token x_{t+2+i} must be an assistant token (data/chat.py: loss_mask[j] = 1 means position
  j-1 is trained to predict x_j) and the target's argmax at t+1+i must lie in the draft vocab.

Parameter names map one-to-one onto the vLLM speculators EAGLE-3 layout (fc.weight,
layers.0.self_attn.q_proj.weight, ..., norm.weight, lm_head.weight, d2t, t2d). The target's
embeddings are used frozen and never stored.

Layer layouts (config flags, all false = the original EAGLE-3 layer; speculators' trainer defaults
norm_before_fc, norm_before_residual and norm_output to true):
- ``norm_before_fc``: one RMSNorm (``input_norm``, n_aux*H_t wide) over the concatenated aux states before fc;
- ``fc_norm``: one RMSNorm per aux state (``fc_norm.{i}``) before concatenation (exclusive with norm_before_fc);
- ``norm_before_residual``: layer 0's residual is hidden_norm(hidden) instead of the raw fused hidden;
- ``norm_output``: the final norm's output (not the pre-norm state) is fed to the next step; logits are
  lm_head(norm(h)) either way.
- ``sliding_window`` + ``layer_types`` (speculators' trainer makes every draft layer sliding_attention, window
  2048): a sliding layer sees the committed / step-0 keys of anchors within ``window`` of its anchor (what
  speculators' TTT mask computes: the window is relative to the anchor, not to the drafted position),
  and always its own chain's keys.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from spectrain.data.packing import DocTTTAttention, PackedDocs
from spectrain.drafters.eagle3.layout import (
    LAYOUT_FLAGS,
    build_draft_vocab,
    config_from_target,
    layer_config,
    layout,
    sort_aux,
    window_keep,
)
from spectrain.drafters.eagle3.rollout import Rollout
from spectrain.drafters.head_io import WEIGHTS_NAME, check_state, read_head_config, save_head
from spectrain.drafters.losses import drafter_loss, hard_ce, sim_tau
from spectrain.drafters.step_metrics import StepMetrics
from spectrain.registry import FeatureSpec
from spectrain.targets.fingerprint import target_fingerprint


# ---- modules ---------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, in_dim: int, cfg: dict):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg["hidden_size"], bias=False)

    def forward(self, x, cos, sin, attend):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.nh // self.nkv
        # keys/values handed to `attend` are already expanded to the query heads
        out = attend(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Layer 0 is the EAGLE-3 layer: attention over cat(norm(embedding), norm(hidden)), residual = hidden.
    Further layers (num_layers > 1) are plain pre-norm Llama layers on the hidden state."""

    def __init__(self, cfg: dict, fused: bool):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.fused = fused
        self.norm_before_residual = layout(cfg)["norm_before_residual"]
        self.input_layernorm = LlamaRMSNorm(h, eps)
        if fused:
            self.hidden_norm = LlamaRMSNorm(h, eps)
        self.self_attn = Attention(2 * h if fused else h, cfg)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden, emb, cos, sin, attend):
        if self.fused:
            normed = self.hidden_norm(hidden)
            x = torch.cat([self.input_layernorm(emb), normed], -1)
            if self.norm_before_residual:
                hidden = normed
        else:
            x = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(x, cos, sin, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class TTTAttention:
    """Per-layer attention state for one TTT unroll: step-0 keys causally, later steps' keys diagonally."""

    def __init__(self, mask0: torch.Tensor):
        self.mask0, self.ks, self.vs = mask0, [], []

    def __call__(self, q, k, v):
        self.ks.append(k)
        self.vs.append(v)
        scale = q.shape[-1] ** -0.5
        s0 = (q @ self.ks[0].transpose(-1, -2)).float() * scale
        s0 = s0.masked_fill(~self.mask0, float("-inf"))
        diag = [((q * kj).sum(-1).float() * scale).unsqueeze(-1) for kj in self.ks[1:]]
        p = torch.cat([s0, *diag], -1).softmax(-1).to(v.dtype)
        t = s0.shape[-1]
        out = p[..., :t] @ self.vs[0]
        for j, vj in enumerate(self.vs[1:]):
            out = out + p[..., t + j: t + j + 1] * vj
        return out


def _shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] right-padded with `fill` back to length T (dim 1)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], 1)


# ---- the trainable head ----------------------------------------------------------------------
class Eagle3Head(nn.Module):
    kind = "eagle3"

    def __init__(self, cfg: dict, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__()
        self.config = dict(cfg)
        h, d, ht = cfg["hidden_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]
        self.aux_layers = list(cfg["aux_layers"])
        if self.aux_layers != sorted(self.aux_layers):
            # engines feed fc the captured layers in ascending order (eagle3_import.sort_aux sorts old heads)
            raise ValueError(f"EAGLE-3 aux layers {self.aux_layers} are not ascending: vLLM, SGLang and TensorRT-LLM "
                             "feed fc the captured layers in ascending order; list them sorted")
        self.layout = layout(cfg)
        n_aux, eps = len(self.aux_layers), cfg["rms_norm_eps"]
        if self.layout["norm_before_fc"]:
            self.input_norm = LlamaRMSNorm(n_aux * ht, eps)
        if self.layout["fc_norm"]:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(ht, eps) for _ in range(n_aux))
        self.fc = nn.Linear(n_aux * ht, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, fused=i == 0) for i in range(cfg["num_layers"]))
        types = cfg.get("layer_types") or []
        self.windows = [cfg.get("sliding_window") if i < len(types) and types[i] == "sliding_attention" else None
                        for i in range(cfg["num_layers"])]
        self.norm = LlamaRMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, d, bias=False)
        if d2t is None:
            d2t, t2d = build_draft_vocab(None, d, cfg["target_vocab_size"])
        self.register_buffer("d2t", d2t.long().clone())
        self.register_buffer("t2d", t2d.bool().clone())
        self.rotary = LlamaRotaryEmbedding(layer_config(cfg))
        self.apply(self._init_weights)
        if cfg.get("freeze_lm_head", False):
            self.lm_head.weight.requires_grad_(False)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_recipe(cls, recipe, target, token_counts: torch.Tensor | None) -> Eagle3Head:
        e = recipe.drafter.eagle3
        if e.init_from:
            raise ValueError("drafter.eagle3.init_from: build the head with spectrain.drafters.eagle3.interop.build")
        aux = target.validate_aux_layers(list(e.aux_layers) or target.default_aux_layers())
        d2t, t2d = build_draft_vocab(token_counts, e.draft_vocab_size, target.vocab_size)
        cfg = config_from_target(target, e, aux, e.draft_vocab_size)
        cfg["loss"] = recipe.drafter.loss
        cfg.update(lm_head_init=e.lm_head_init, freeze_lm_head=e.freeze_lm_head, loss_positions=e.loss_positions,
                   out_of_vocab=e.out_of_vocab)
        # Same shapes do not mean same weights: a head trained on another build of the target
        # loads fine and then accepts almost nothing. Record which target it was trained on.
        cfg["target_fingerprint"] = target_fingerprint(target)
        model = cls(cfg, d2t, t2d)
        model.rollout_cfg = e.rollout  # training only: not part of the saved head
        if e.lm_head_init != "random":
            model.init_head_from_target(target, with_norm=e.lm_head_init == "target_with_norm")
        return model.to(target.device)

    @torch.no_grad()
    def init_head_from_target(self, target, with_norm: bool = False) -> None:
        """lm_head = the target's lm_head rows of the draft vocabulary (a head that starts out mapping a
        target-like hidden state to the target's logits); with_norm also copies the final norm's scale."""
        w = target.lm_head.weight
        if getattr(target.lm_head, "bias", None) is not None:
            raise ValueError("drafter.eagle3.lm_head_init=target: the target's lm_head has a bias, which the "
                             "EAGLE-3 head's lm_head cannot hold; use lm_head_init=random")
        self.lm_head.weight.copy_(w[self.draft_ids.to(w.device)].to(self.lm_head.weight))
        if with_norm:
            self.norm.weight.copy_(target.norm.weight.to(self.norm.weight))
            x = torch.randn(2, self.norm.weight.numel(), dtype=torch.float32)
            # a target norm with another formula (e.g. Gemma's x * (1 + w)) cannot be copied weight for weight
            if not torch.allclose(self.norm.float()(x), copy.deepcopy(target.norm).float().cpu()(x), atol=1e-4):
                raise ValueError(f"drafter.eagle3.lm_head_init=target_with_norm: the target's final norm "
                                 f"({type(target.norm).__name__}) is not an RMSNorm x * w; use lm_head_init=target")

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(tuple(self.aux_layers), last_hidden=True)

    @property
    def draft_ids(self) -> torch.Tensor:
        """[D] target id of every draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    # ---- one draft step ----------------------------------------------------------------------
    def step(self, emb, hidden, position_ids, attends) -> tuple[torch.Tensor, torch.Tensor]:
        """emb/hidden [B,T,H] -> (layer output [B,T,H] fed to the next step, draft-vocab logits)."""
        cos, sin = self.rotary(hidden, position_ids)
        for layer, attend in zip(self.layers, attends):
            hidden = layer(hidden, emb, cos, sin, attend)
        normed = self.norm(hidden)
        # norm_output: the normed state, not the pre-norm one, is what the next step builds on
        return (normed if self.layout["norm_output"] else hidden), self.lm_head(normed)

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.fc.weight.dtype)

    def _emb(self, e: torch.Tensor) -> torch.Tensor:
        """The target's embedding rows as this head sees them: an imported head that stored the embedding in a
        lower precision (speculators saves bf16) computed with those rounded rows (config ``embed_dtype``)."""
        if self.config.get("embed_dtype"):
            e = e.to(getattr(torch, self.config["embed_dtype"]))
        return self._inputs(e)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux*H_t] concatenated aux states -> the fused hidden [..., H] (the optional norms, then fc)."""
        x = self._inputs(aux)
        if self.layout["norm_before_fc"]:
            x = self.input_norm(x)
        if self.layout["fc_norm"]:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(x)

    def ttt_logits(self, input_ids, attention_mask, aux, target, steps: int | None = None,
                   docs: PackedDocs | None = None, feed=None) -> list[torch.Tensor]:
        """Unrolled TTT forward: per step i, logits [B,T,D] at every anchor t (see module docstring).
        ``docs``: the row is packed (spectrain.data.packing); attention stays inside each document.
        ``feed(i, previous step's logits, data tokens)``: step i's input tokens (rollouts; default the data's)."""
        steps = steps or self.config["ttt_steps"]
        if docs is not None:
            # a window at least as long as the packed row masks nothing (e.g. speculators' 2048 on short rows)
            if any(w is not None and w < input_ids.shape[1] for w in self.windows):
                raise ValueError("training.packing=true does not support drafter.eagle3.sliding_window shorter than "
                                 "the packed row yet; set training.packing=false or a larger sliding_window")
            pos0, attends = docs.positions, [DocTTTAttention(docs) for _ in self.layers]
        else:
            t = input_ids.shape[1]
            am = attention_mask.bool()
            pos0 = (am.long().cumsum(1) - 1).clamp_min(0)
            idx = torch.arange(t, device=input_ids.device)
            causal = idx[None, :] <= idx[:, None]
            # a padded query still sees itself, so no softmax row is empty
            mask0 = (causal[None] & (am[:, None, :] | torch.eye(t, dtype=torch.bool, device=am.device)))[:, None]
            attends = [TTTAttention(mask0 if w is None else mask0 & window_keep(idx, t, w)) for w in self.windows]
        hidden = self.fuse(aux)
        out = []
        for i in range(steps):
            with torch.no_grad():
                tok = _shift(input_ids, 1 + i)
                if feed is not None and i > 0:
                    tok = feed(i, out[-1], tok)
                emb = self._emb(target.embed(tok))
            hidden, logits = self.step(emb, hidden, pos0 + i, attends)
            out.append(logits)
        return out

    # ---- training ----------------------------------------------------------------------------
    def train_loss(self, batch: dict, feats: dict, target) -> tuple[torch.Tensor, dict[str, float]]:
        ids, am, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
        steps, decay = self.config["ttt_steps"], self.config["ttt_decay"]
        name = self.config.get("loss", "fkl")
        # a position is trained when its predicted token (default) or its input token is the assistant's
        lead = 2 if self.config.get("loss_positions", "predicted") == "predicted" else 1
        keep_oov = self.config.get("out_of_vocab", "mask") == "keep"
        to_draft = torch.cumsum(self.t2d.long(), 0) - 1  # target id -> draft id (where t2d)
        with torch.no_grad():
            tlogits = target.logits_from_last_hidden(feats["last_hidden"])
            greedy = tlogits.argmax(-1)  # the target's greedy choice on the data row
            in_vocab = self.t2d[greedy]
            teacher = tlogits[..., self.draft_ids].float()  # restricted; its softmax is renormalised
            log_z = torch.logsumexp(tlogits.float(), -1)  # full-vocab normaliser, for the T=1 acceptance proxy
            del tlogits
        docs = PackedDocs(batch["doc_lengths"]) if "doc_lengths" in batch else None
        inside = docs.same_doc if docs is not None else (lambda n: True)  # packed: not past the document's end
        roll = self._rollout(batch, _shift(lm & am, lead, False) & inside(lead))
        logits = self.ttt_logits(ids, am, feats["aux"], target, steps, docs, roll.feed if roll else None)
        total = torch.zeros((), device=ids.device)
        metrics: dict[str, float] = {}
        if roll is not None:  # the target's verification pass over the drafted prefixes
            metrics.update(roll.verify(target, ids, am, _shift(greedy, 1)))
        chain = StepMetrics(am.shape, ids.device)
        for i, lg in enumerate(logits):
            tch, lz, inv = _shift(teacher, 1 + i), _shift(log_z, 1 + i), _shift(in_vocab, 1 + i, False)
            if roll is not None and i > 0:  # rolled-out anchors: the target on the head's own prefix
                tch, lz, inv = roll.substitute(i, tch, lz, inv)
            sup = _shift(lm & am, lead + i, False) & inside(lead + i)
            mask = sup if keep_oov else sup & inv
            if name == "hard_ce":  # labels = the data's token t+2+i, where the draft vocabulary has it
                data = _shift(ids, 2 + i)
                li = hard_ce(lg, to_draft[data].clamp_min(0),
                             sup & _shift(am, 2 + i, False) & inside(2 + i) & self.t2d[data])
            else:
                li = drafter_loss(name, lg, tch, None, mask)
            total = total + decay**i * li
            with torch.no_grad():
                correct = (lg.argmax(-1) == tch.argmax(-1)) & mask
                # T=1 acceptance of step i: sum over the draft vocab of min(p, q) with p the target's FULL
                # distribution (its mass outside the draft vocab is rejected, as in decoding), over every
                # supervised position (out-of-vocab argmax ones included)
                s_t1 = torch.minimum(lg.float().softmax(-1), (tch - lz[..., None]).exp()).sum(-1)
                acc, metrics[f"cond_acc_{i}"], metrics[f"acc_t1_{i}"], n = chain.step(i, correct, mask, s_t1, sup)
            metrics[f"loss_{i}"], metrics[f"acc_{i}"] = float(li.detach()), acc
            if i == 0:
                metrics["tokens"] = float(n)
                # assistant tokens whose predicting position has its target argmax outside the draft vocab
                asst = lm[:, 1:] & am[:, 1:] & (docs.same_doc(1) if docs is not None else am)[:, :-1]
                metrics["frac_out_of_draft_vocab"] = float((asst & ~in_vocab[:, :-1]).sum()) / max(
                    float(asst.sum()), 1.0)
        metrics["loss"] = float(total.detach())
        # PROXY: teacher-forced greedy top-1 agreement, +1 bonus token
        metrics["sim_tau"] = sim_tau([metrics[f"acc_{i}"] for i in range(len(logits))])
        # PROXY at T=1: 1 + sum_i mean over anchors of prod_{j<=i} acc_t1_j(anchor) (a chain stops at an
        # unsupervised position), the same definition as the draft model's sim_tau_t1
        metrics["sim_tau_t1"] = chain.tau_t1
        return total, metrics

    def _rollout(self, batch: dict, sup0: torch.Tensor):
        """A rollout step (the loop put ``rollout_seed`` into the batch; drafters/eagle3/rollout.py) or None."""
        if "rollout_seed" not in batch:
            return None
        if "doc_lengths" in batch:
            raise ValueError("drafter.eagle3.rollout does not support training.packing=true yet; set "
                             "training.packing=false")
        return Rollout(self, sup0, self.rollout_cfg, int(batch["rollout_seed"]))

    # ---- persistence -------------------------------------------------------------------------
    def save_pretrained(self, path, state_dict: dict | None = None) -> None:
        """``state_dict``: full weights gathered by the loop when ZeRO-3 / FSDP shard this module."""
        save_head(path, self.config, state_dict or self.state_dict())

    @classmethod
    def from_pretrained(cls, path, target) -> Eagle3Head:
        cfg = read_head_config(path, "eagle3", target, "EAGLE-3 head")
        target.validate_aux_layers(cfg["aux_layers"])
        cfg, state = sort_aux(cfg, load_file(str(Path(path) / WEIGHTS_NAME)), f"EAGLE-3 head at {path}")
        model = cls(cfg, state["d2t"], state["t2d"])
        check_state(state, model, f"EAGLE-3 head at {path}")
        model.load_state_dict(state, strict=True)
        return model.to(target.device)


__all__ = ["LAYOUT_FLAGS", "Eagle3Head", "build_draft_vocab", "config_from_target", "layer_config", "layout"]


