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
"""

from __future__ import annotations

import torch

from spectrain.drafters.base import DraftContext, Drafter, Proposal


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
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or target.dtype,
                                                     trust_remote_code=trust_remote_code).to(target.device)
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            tok = None  # a bare checkpoint: the size check below still applies
        return cls(model, target, tokenizer=tok)

    def begin(self, prompt: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.cached = []

    def _crop(self, n: int) -> None:
        if n < len(self.cached):
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
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
