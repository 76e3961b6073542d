"""A separate draft LM for batched decoding: one draft KV cache for all rows, one forward per depth.

Same layout as the target cache in spectrain/decoding/batched.py: ``[B, heads, S, dim]`` with ``slot_pos[b, s]``
= the position slot s of row b holds, -1 = a hole. ``cached[b]`` lists the ids of row b's valid slots
(positions 0..n-1). Per step, each row invalidates the slots past the longest prefix it shares with
its committed tokens (rejected drafts become holes, nothing is re-padded), feeds its new committed
tokens (ragged, padded to the longest) and then all rows draft one token per forward. Chains only:
``DraftLMDrafter.propose_batch`` drafts trees per row with the single-sequence code.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import DynamicCache

from spectrain.decoding import kv_cache
from spectrain.decoding.interface import DraftContext, Proposal
from spectrain.decoding.masks import batch_mask


class BatchedDraftLM:
    def __init__(self, drafter, n_rows: int):
        self.d = drafter
        self.dev = drafter.model.get_input_embeddings().weight.device
        self.cache = DynamicCache()
        self.slot_pos = torch.zeros(n_rows, 0, dtype=torch.long, device=self.dev)
        self.cached: list[list[int]] = [[] for _ in range(n_rows)]
        self.base = [0] * n_rows
        # what masks.batch_mask needs to know about the model it masks for
        self.like = SimpleNamespace(config=drafter.model.config, dtype=drafter.model.dtype)

    def keep_rows(self, idx: list[int]) -> None:
        self.slot_pos = kv_cache.select_rows(self.cache, self.slot_pos, idx)
        self.cached, self.base = [self.cached[i] for i in idx], [self.base[i] for i in idx]

    def _truncate(self, b: int, n: int) -> None:
        if n < len(self.cached[b]):
            self.slot_pos[b] = torch.where(self.slot_pos[b] >= n, -1, self.slot_pos[b])
            self.cached[b] = self.cached[b][:n]

    def _feed(self, new: list[list[int]]) -> torch.Tensor:
        """Append each row's ids (ragged); returns the logits after each row's last id [B, V_target]."""
        B, m = len(new), max(map(len, new))
        counts = torch.tensor([len(x) for x in new], device=self.dev)
        ids = torch.zeros(B, m, dtype=torch.long, device=self.dev)
        for b, x in enumerate(new):
            ids[b, : len(x)] = torch.tensor(x, device=self.dev)
        start = torch.tensor([len(c) for c in self.cached], device=self.dev)
        pos = start[:, None] + torch.arange(m, device=self.dev)[None]
        causal = torch.ones(m, m, dtype=torch.bool, device=self.dev).tril().expand(B, m, m)
        mask = batch_mask(self.like, self.slot_pos, pos, causal, counts - 1)
        out = self.d.model(ids, position_ids=pos, attention_mask=mask, cache=self.cache, use_cache=True)
        real = torch.arange(m, device=self.dev)[None] < counts[:, None]
        self.slot_pos = torch.cat([self.slot_pos, torch.where(real, pos, -1)], 1)
        for b, x in enumerate(new):
            self.cached[b] += x
        logits = out.logits[torch.arange(B, device=self.dev), (counts - 1).clamp_min(0)].float()
        V = self.d.vocab
        if logits.shape[-1] >= V:
            return logits[:, :V]  # padding rows beyond the target vocab can never be proposed
        return torch.cat([logits, logits.new_full((B, V - logits.shape[-1]), float("-inf"))], 1)

    def propose(self, ctxs: list[DraftContext | None]) -> list[Proposal | None]:
        out: list[Proposal | None] = [None] * len(ctxs)
        chains = [b for b, c in enumerate(ctxs) if c is not None]
        if not chains:
            return out
        new = [[] for _ in ctxs]
        for b in chains:
            tokens = ctxs[b].tokens.tolist()
            common = next((i for i, (x, y) in enumerate(zip(self.cached[b], tokens)) if x != y),
                          min(len(self.cached[b]), len(tokens)))
            self._truncate(b, min(common, len(tokens) - 1))  # re-feed at least the newest token
            new[b], self.base[b] = tokens[len(self.cached[b]):], len(tokens)
        sampler, kmax = ctxs[chains[0]].sampler, max(ctxs[b].k for b in chains)
        logits = self._feed(new)
        toks, qs = [], []
        for j in range(kmax):
            q = None if sampler.greedy else sampler.probs(logits)
            x = logits.argmax(-1) if q is None else torch.multinomial(q, 1, generator=sampler.generator)[:, 0]
            toks.append(x)
            qs.append(q)
            if j + 1 < kmax:
                logits = self._feed([[int(x[b])] if b in chains else [] for b in range(len(ctxs))])
        tokens = torch.stack(toks, 1)
        for b in chains:
            k, dev = ctxs[b].k, ctxs[b].tokens.device
            probs = None if sampler.greedy else torch.stack([q[b] for q in qs[:k]])
            out[b] = Proposal(tokens=tokens[b, :k].to(dev), probs=probs)
        self.slot_pos = kv_cache.compact(self.cache, self.slot_pos)
        return out

    def commit(self, accepted: list[list[int] | None]) -> None:
        for b, a in enumerate(accepted):
            if a is not None:
                self._truncate(b, self.base[b] + len(a))
