"""A separate small HF causal LM as the drafter (DistillSpec-style draft models).

The draft model keeps its own KV cache. Before drafting it is cropped to the longest prefix it
shares with the committed tokens (so a rollback can never leave stale entries), then fed the new
committed tokens and run autoregressively for k steps. ``commit`` crops it to the accepted prefix
right away, which frees memory early.

Vocabulary safety: draft and target must share the tokenizer; a draft with a different vocabulary
silently corrupts every proposal, so ``check_vocab`` compares token *strings* over the shared id
range (and the sizes) and refuses with the first mismatching ids.

Trees (``tree={"topk": m}``): deterministic top-m children of the root, each extended greedily
(a chain per branch), so q = one-hot and sampling stays exact.

Training (``DraftStudent``, ``drafter.kind: draft``): the same HF model distilled from the frozen
target in spectrain.train.loop's loop; see the class docstring. Its run directories are plain HF model
directories plus ``drafter_config.json``, so ``DraftLMDrafter.from_pretrained`` loads them.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from spectrain.decoding import kv_cache
from spectrain.decoding.interface import DraftContext, Drafter, Proposal
from spectrain.drafters.draft_lm_batch import BatchedDraftLM
from spectrain.drafters.head_io import CONFIG_NAME, warn_if_other_target
from spectrain.drafters.losses import drafter_loss
from spectrain.drafters.step_metrics import StepMetrics
from spectrain.io.integrity import seal_head
from spectrain.recipe.load import check_draft_layers
from spectrain.registry import FeatureSpec
from spectrain.targets.fingerprint import target_fingerprint
from spectrain.targets.model import gathered

SIM_K = 5  # chain length the simulated-tau proxy assumes (the eval's default k)


def check_vocab(target, draft_model, draft_tokenizer) -> None:
    """Raise ValueError unless the draft shares the target's vocabulary (token strings and sizes)."""
    t_tok = getattr(target, "tokenizer", None)
    t_rows = target.vocab_size
    d_rows = draft_model.get_output_embeddings().weight.shape[0]
    if t_tok is not None and draft_tokenizer is not None:
        nt, nd = len(t_tok), len(draft_tokenizer)
        shared = min(nt, nd)
        a = t_tok.convert_ids_to_tokens(list(range(shared)))
        b = draft_tokenizer.convert_ids_to_tokens(list(range(shared)))
        bad = [i for i in range(shared) if a[i] != b[i]]
        if bad:
            shown = ", ".join(f"id {i}: target {a[i]!r} vs draft {b[i]!r}" for i in bad[:3])
            raise ValueError(
                f"draft model tokenizer differs from the target's at {len(bad)} of {shared} ids (first: {shown}); "
                "a draft must use the target's tokenizer, otherwise its proposals mean other tokens")
        if nt != nd:
            raise ValueError(
                f"draft tokenizer has {nd} tokens but the target's has {nt} (ids {shared}.. exist in only one): "
                "use a draft model trained with the target's tokenizer")
        if d_rows < nt:
            raise ValueError(f"draft model lm_head has {d_rows} rows, fewer than the {nt} tokens of the tokenizer")
        return
    if d_rows != t_rows:
        raise ValueError(
            f"draft model vocabulary ({d_rows} rows) differs from the target's ({t_rows}) and there is no "
            "tokenizer pair to compare token strings: pass tokenizers or use a draft with the target's vocabulary")


class DraftLMDrafter(Drafter):
    name = "draft"
    supports_tree = True

    def __init__(self, model, target, tokenizer=None, check: bool = True):
        model.eval()
        model.requires_grad_(False)
        if check:
            check_vocab(target, model, tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        self.vocab = target.vocab_size  # proposals and q live in the target's id space
        self.cache = None
        self.cached: list[int] = []  # ids whose keys/values the draft cache holds
        self._base = 0  # committed length at the last propose

    @classmethod
    def from_pretrained(cls, path: str, target, dtype=None, trust_remote_code: bool = False) -> DraftLMDrafter:
        _warn_if_other_target(path, target)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or target.dtype,
                                                     trust_remote_code=trust_remote_code).to(target.device)
        bad = next((n for n, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()),
                   None)
        if bad is not None:
            raise ValueError(f"draft model {path}: tensor {bad} holds NaN or Inf values (a diverged or damaged "
                             "model): use another checkpoint or retrain")
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            tok = None  # a bare checkpoint: the size check below still applies
        return cls(model, target, tokenizer=tok)

    def begin(self, prompt: torch.Tensor) -> None:
        self.cache = DynamicCache()
        self.cached = []

    def _crop(self, n: int) -> None:
        if n < len(self.cached):
            kv_cache.crop(self.cache, n)
            self.cached = self.cached[:n]

    def _step(self, ids: list[int]) -> torch.Tensor:
        """Feed ids after the cached prefix; return the logits of the last position over the target vocab."""
        dev = self.model.get_input_embeddings().weight.device
        start = len(self.cached)
        pos = torch.arange(start, start + len(ids), device=dev)[None]
        out = self.model(torch.tensor([ids], device=dev), position_ids=pos, cache=self.cache, use_cache=True)
        self.cached.extend(ids)
        logits = out.logits[0, -1].float()
        if logits.shape[-1] > self.vocab:
            logits = logits[: self.vocab]  # padding rows beyond the target vocab can never be proposed
        elif logits.shape[-1] < self.vocab:
            logits = torch.cat([logits, logits.new_full((self.vocab - logits.shape[-1],), float("-inf"))])
        return logits

    def _sync(self, tokens: list[int]) -> torch.Tensor:
        common = 0
        for a, b in zip(self.cached, tokens):
            if a != b:
                break
            common += 1
        self._crop(min(common, len(tokens) - 1))  # re-feed at least the newest token to get its logits
        return self._step(tokens[len(self.cached):])

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        tokens = ctx.tokens.tolist()
        logits = self._sync(tokens)
        self._base = len(tokens)
        if ctx.tree is not None:
            return self._propose_tree(ctx, tokens, logits)
        sampler = ctx.sampler
        out, qs = [], []
        for i in range(ctx.k):
            if sampler.greedy:
                x = int(logits.argmax())
            else:
                q = sampler.probs(logits)
                x = int(sampler.sample(q))
                qs.append(q)
            out.append(x)
            if i + 1 < ctx.k:
                logits = self._step([x])
        dev = ctx.tokens.device
        return Proposal(tokens=torch.tensor(out, device=dev), probs=torch.stack(qs) if qs else None)

    def _propose_tree(self, ctx: DraftContext, tokens: list[int], logits: torch.Tensor) -> Proposal:
        topk = int(ctx.tree.get("topk", 4))
        base = len(self.cached)
        firsts = logits.topk(min(topk, logits.shape[-1])).indices.tolist()
        node_tok, parents = [], []
        for first in firsts:
            self._crop(base)
            par = -1
            x = first
            for depth in range(ctx.k):
                node_tok.append(x)
                parents.append(par)
                par = len(node_tok) - 1
                if depth + 1 < ctx.k:
                    x = int(self._step([x]).argmax())
        self._crop(base)
        dev = ctx.tokens.device
        return Proposal(tokens=torch.tensor(node_tok, device=dev), parents=torch.tensor(parents))

    def commit(self, accepted: list[int]) -> None:
        # Chains: the cache holds the committed tokens + drafts[:k-1]; drop the rejected drafts now.
        # Trees were cropped back to the committed prefix in propose; _sync feeds the accepted path.
        self._crop(self._base + len(accepted))

    # batched decoding (spectrain/decoding/batched.py): chains share one draft cache (draft_lm_batch.py);
    # trees use one copy of this drafter per row (the Drafter defaults)
    def begin_batch(self, prompts: list[torch.Tensor]) -> None:
        Drafter.begin_batch(self, prompts)
        self._batch, self._tree_mode = BatchedDraftLM(self, len(prompts)), False

    @torch.no_grad()
    def propose_batch(self, ctxs: list[DraftContext | None]) -> list[Proposal | None]:
        self._tree_mode = any(c is not None and c.tree is not None for c in ctxs)
        return Drafter.propose_batch(self, ctxs) if self._tree_mode else self._batch.propose(ctxs)

    def commit_batch(self, accepted: list[list[int] | None]) -> None:
        if self._tree_mode:
            Drafter.commit_batch(self, accepted)
        else:
            self._batch.commit(accepted)

    def keep_rows(self, idx: list[int]) -> None:
        Drafter.keep_rows(self, idx)
        self._batch.keep_rows(idx)


def _warn_if_other_target(path, target) -> None:
    cfg_file = Path(path) / CONFIG_NAME
    if cfg_file.is_file():  # a plain HF model (hub id or directory) records nothing
        cfg = json.loads(cfg_file.read_text())
        warn_if_other_target(cfg.get("target_fingerprint"), target, f"draft model at {path}", cfg.get("target"))


# ---- training: the draft model as a student of the frozen target --------------------------------


def sliced_config(config, layers: list[int]):
    """The target's config with only `layers` kept. Lists with one entry per layer (a key containing
    "layer" whose list has num_hidden_layers entries: layer_types, no_rope_layers ...) are sliced
    the same way, so sliding-window / full-attention choices stay with their weights."""
    n = config.num_hidden_layers
    d = config.to_dict()
    for key, value in d.items():
        if "layer" in key and isinstance(value, list) and len(value) == n:
            d[key] = [value[i] for i in layers]
    d["num_hidden_layers"] = len(layers)
    return type(config).from_dict(d)


def _layers_prefix(target) -> str:
    for name, module in target.model.named_modules():
        if module is target.layers:
            return name
    raise ValueError(f"cannot locate the decoder layers of {type(target.model).__name__} in its state dict")


def layer_subset(target, layers: list[int]) -> nn.Module:
    """A float32 copy of the target keeping only decoder `layers` (plus embeddings, final norm, lm_head).
    Built from the target's own class and config; weights are copied, never shared."""
    check_draft_layers(f"layers:{','.join(map(str, layers))}", target.num_layers)  # the same check as `check`

    prefix = _layers_prefix(target)
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.+)$")
    model = type(target.model)(sliced_config(target.config, layers)).float()
    keep = [p for k, p in target.model.named_parameters() if (m := pattern.match(k)) is None or int(m[1]) in layers]
    with gathered(keep):  # ZeRO-3 holds a slice of each target weight per rank; the copy needs them whole
        state = {}
        for key, value in target.model.state_dict().items():
            m = pattern.match(key)
            if m is None:
                state[key] = value
            elif int(m[1]) in layers:
                state[f"{prefix}.{layers.index(int(m[1]))}.{m[2]}"] = value
        missing, unexpected = model.load_state_dict(state, strict=False)  # copies: nothing is shared
    if missing or unexpected:
        raise ValueError(f"layer-subset copy of {type(target.model).__name__} does not line up with the target's "
                         f"weights (missing {missing[:4]}, unexpected {unexpected[:4]})")
    model.generation_config = copy.deepcopy(target.model.generation_config)  # saved with the draft
    return model


def _load_student(name: str, init: str, trust_remote_code: bool):
    """init=pretrained: the weights at `name`; init=config: its architecture, randomly initialised."""
    try:
        if init == "pretrained":
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32,
                                                         trust_remote_code=trust_remote_code)
        else:
            cfg = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ValueError(f"drafter.draft.model={name!r} cannot be loaded for init={init} ({e}); give an HF hub "
                         "id or a local model directory") from e
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        tok = None  # check_vocab then compares sizes only
    return model.float(), tok


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded at the end with zeros / False back to length T."""
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]))], 1) if n else x


def chain_metrics(valid: torch.Tensor, agree: torch.Tensor, accept: torch.Tensor, k: int = SIM_K) -> dict:
    """Teacher-forced chain statistics. valid [B,T] bool; agree / accept = per valid position (in
    valid[...] order) greedy agreement and sum_x min(p, q). A chain from anchor t of depth i+1
    needs positions t..t+i; anything outside `valid` ends it."""
    n = int(valid.sum())
    g = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
    s = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    g[valid], s[valid] = agree, accept.float()
    out = {"tokens": float(n), "expected_acc": float(s.sum()) / max(n, 1)}
    chain = StepMetrics(valid.shape, valid.device)  # step i = position t+i of a chain from anchor t
    for i in range(k):
        # conditional: prod_{j<=i} acc_j = P(greedy run >= i+1), which the loop's sim_tau multiplies out
        out[f"acc_{i}"] = chain.step(i, _shift(g, i), valid, _shift(s, i), _shift(valid, i))[1]
    out["sim_tau"], out["sim_tau_t1"] = chain.tau, chain.tau_t1
    return out


class DraftStudent(nn.Module):
    """A separate HF causal LM distilled from the frozen target (DistillSpec), for spectrain.train.loop.

    Inits (drafter.draft.init): ``pretrained`` = the weights of drafter.draft.model (hub id or dir);
    ``config`` = its architecture, random weights; ``layers:i,j,...`` = a copy of the target keeping
    those decoder layers. The student trains in float32 (master weights; the loop's autocast handles
    bf16), and must share the target's vocabulary (check_vocab).

    Alignment: student and target see the same tokens; the student's logits at position t are pulled
    toward the target's distribution at t (both predict token t+1) wherever token t+1 is an assistant
    token (loss_mask[t+1], spectrain/data/chat.py convention) inside the attention mask. drafter.loss fkl / rkl / jsd /
    tvd / soft_ce compare with the target's distribution; hard_ce is cross-entropy on the data's next
    token (supervised fine-tuning; on target-regenerated data, sequence-level distillation).

    Metrics, all teacher-forced along the data (the drafted chain conditions on the draft's own tokens,
    so these are PROXIES of the decoded numbers):
    - acc_0: student argmax == target argmax. acc_i (i < 5): of the anchors whose positions t..t+i-1
      all agreed, the fraction that also agrees at t+i; so the loop's sim_tau = 1 + sum_i prod_j acc_j
      = 1 + E[min(greedy run, 5)], exact for greedy decoding when the data is the target's greedy text.
    - expected_acc: mean sum_x min(p, q) at T=1, the exact per-token acceptance probability of
      speculative sampling at temperature 1 in that context.
    - sim_tau_t1: 1 + sum_i mean_t prod_{j<=i} min-overlap(t+j), the same proxy at T=1.
    """

    kind = "draft"

    def __init__(self, model: nn.Module, config: dict, tokenizer=None):
        super().__init__()
        self.model = model
        self.config = dict(config)
        self.tokenizer = tokenizer  # the target's, saved next to the weights

    @classmethod
    def from_recipe(cls, recipe, target, token_counts: torch.Tensor | None = None) -> DraftStudent:
        d = recipe.drafter.draft
        if d.init.startswith("layers:"):
            layers = [int(x) for x in d.init.split(":", 1)[1].split(",")]
            model, tok = layer_subset(target, layers), target.tokenizer
        elif d.model:
            model, tok = _load_student(d.model, d.init, recipe.target.trust_remote_code)
        else:
            raise ValueError(f"drafter.draft.init={d.init} needs drafter.draft.model (an HF id or directory)")
        check_vocab(target, model, tok)
        source = getattr(target, "load_path", target.name_or_path) if d.init.startswith("layers:") else d.model
        cfg = {"kind": "draft", "init": d.init, "source": source,
               "loss": recipe.drafter.loss, "target": target.name_or_path, "target_vocab_size": target.vocab_size,
               "target_fingerprint": target_fingerprint(target), "sim_k": SIM_K}
        return cls(model, cfg, tokenizer=target.tokenizer).to(target.device)

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(last_hidden=True)  # teacher logits = the target's norm + lm_head on it

    def train_loss(self, batch: dict, feats: dict, target) -> tuple[torch.Tensor, dict[str, float]]:
        ids, am, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
        valid = torch.zeros_like(am)
        valid[:, :-1] = lm[:, 1:] & am[:, 1:] & am[:, :-1]
        logits = self.model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits
        student = logits[valid]
        with torch.no_grad():  # only the trained positions: [N, V] instead of [B, T, V]
            teacher = target.logits_from_last_hidden(feats["last_hidden"][valid]).float()
        v = min(student.shape[-1], teacher.shape[-1])  # rows past the shared tokenizer are padding
        student, teacher = student[:, :v], teacher[:, :v]
        ones = torch.ones(student.shape[0], dtype=torch.bool, device=student.device)

        labels = ids[:, 1:][valid[:, :-1]]  # hard_ce: the data's next tokens
        loss = drafter_loss(self.config["loss"], student, teacher, labels, ones)
        with torch.no_grad():
            q, p = student.float().softmax(-1), teacher.softmax(-1)
            metrics = chain_metrics(valid, student.argmax(-1) == teacher.argmax(-1),
                                    torch.minimum(p, q).sum(-1), int(self.config.get("sim_k", SIM_K)))
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    def save_pretrained(self, path, state_dict: dict | None = None) -> None:
        """A plain HF model directory (+ the target's tokenizer) with drafter_config.json beside it.
        ``state_dict``: this module's full weights, gathered by the loop when ZeRO-3 / FSDP shard it."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if state_dict is not None:  # keys are "model.<HF name>"
            state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        self.model.save_pretrained(str(path), state_dict=state_dict)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(path))
        (path / CONFIG_NAME).write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")

        seal_head(path)  # every head spectrain writes carries SHA256SUMS (load_drafter requires it)


def load(path, target) -> DraftLMDrafter:
    """Registry entry: a trained draft model (or any HF causal LM sharing the target's tokenizer)."""
    return DraftLMDrafter.from_pretrained(str(path), target)
