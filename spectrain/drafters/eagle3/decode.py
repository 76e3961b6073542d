"""EAGLE-3 decoding adapter: a KV cache of step-0 entries for committed positions, chains and EAGLE-2 dynamic
trees drafted on top of it (the head itself and its training live in model.py)."""

from __future__ import annotations

import torch

from spectrain.decoding.interface import DraftContext, Drafter, Proposal
from spectrain.drafters.eagle3.batch import BatchedEagle3
from spectrain.drafters.eagle3.layout import window_keep
from spectrain.drafters.eagle3.model import Eagle3Head
from spectrain.drafters.eagle3.tree import DraftTree, select_nodes
from spectrain.registry import FeatureSpec


def attend_masked(q, k, v, mask):
    """Plain softmax attention; mask [..., q, kv] bool (True = attend). fp32 softmax."""
    s = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    return (s.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)) @ v


# ---- decoding adapter ------------------------------------------------------------------------
class Eagle3Proposer(Drafter):
    """Decoding-side EAGLE-3: a KV cache of step-0 entries built from *true* target features for
    every committed position; drafted nodes live only in per-proposal temporary K/V, so rolling back
    after verification needs nothing (the accepted tokens' true features arrive with the next call)."""

    name = "eagle3"
    supports_tree = True

    def __init__(self, model: Eagle3Head, target):
        self.model = model.eval()
        self.target = target
        self.aux_layers = list(model.aux_layers)
        self.begin(None)

    def features(self) -> FeatureSpec:
        return self.model.feature_spec()  # the head's own spec: its aux layers (and the teacher's last hidden)

    def begin(self, prompt: torch.Tensor | None) -> None:
        self.cache = self._empty()  # per layer (K, V) [1, heads, n, head_dim], keys already rotated
        self.n = 0  # committed positions whose step-0 entry is cached
        self.root_hidden = self.root_logits = None

    def commit(self, accepted: list[int]) -> None:
        pass  # drafted K/V were temporary; see the class docstring

    # ---- internals ---------------------------------------------------------------------------
    def _empty(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c, w = self.model.config, self.model.fc.weight
        z = w.new_zeros(1, c["num_attention_heads"], 0, c["head_dim"])
        return [(z, z) for _ in self.model.layers]

    def _run(self, emb, hidden, positions, mask, temp, anchors, committed: int):
        """One step for m rows attending to cache + temp + themselves (mask [m, n + n_temp + m]); the first
        ``committed`` columns are committed positions 0.., which sliding layers window around ``anchors`` [m].
        Returns (layer output [1,m,H], logits [m,D] fp32, the rows' new per-layer K/V)."""
        h, logits, new = self.run_rows(self.cache, emb[None], hidden, positions[None], mask, temp, anchors, committed)
        return h, logits[0], new

    def run_rows(self, cache, emb, hidden, positions, mask, temp, anchors=None, committed: int = 0):
        """Batched step: emb/hidden [B,m,H], positions [B,m], mask broadcastable to [B, heads, m, cache +
        temp + m]; cache/temp per layer (K, V) [B, heads, n, dim]. Returns ([B,m,H], [B,m,D] fp32, new K/V).
        ``anchors``/``committed``: see _run (one row only; batched decoding refuses short windows)."""
        new = []

        def make(li):
            lmask, w = mask, self.model.windows[li]
            if w is not None and anchors is not None:
                lmask = mask.clone()
                lmask[:, :committed] &= window_keep(anchors, committed, w)

            def attend(q, k, v):
                new.append((k, v))
                (ck, cv), (tk, tv) = cache[li], temp[li]
                return attend_masked(q, torch.cat([ck, tk, k], 2), torch.cat([cv, tv, v], 2), lmask)
            return attend

        m = self.model
        h, logits = m.step(m._emb(emb), hidden, positions, [make(i) for i in range(len(m.layers))])
        return h, logits.float(), new

    # batched decoding (spectrain/decoding/batched.py): all rows' head caches in one tensor, see eagle3/batch.py
    def begin_batch(self, prompts: list[torch.Tensor]) -> None:
        limit = getattr(self.target.config, "max_position_embeddings", None) or 1 << 62
        if any(w is not None and w < limit for w in self.model.windows):
            raise ValueError(f"batched decoding (batch_size > 1) does not support a sliding-window EAGLE-3 head whose "
                             f"window ({min(w for w in self.model.windows if w)}) is shorter than the target's "
                             f"max_position_embeddings ({limit}); decode it with batch_size=1")
        self._batch = BatchedEagle3(self, len(prompts))

    @torch.no_grad()
    def propose_batch(self, ctxs: list[DraftContext | None]) -> list[Proposal | None]:
        return self._batch.propose(ctxs)

    def commit_batch(self, accepted: list[list[int] | None]) -> None:
        pass  # drafted K/V were temporary; the accepted tokens' features arrive with the next call

    def keep_rows(self, idx: list[int]) -> None:
        self._batch.keep_rows(idx)

    @staticmethod
    def append_kv(kv, new):
        return [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(kv, new)]

    def _ingest(self, ctx: DraftContext) -> None:
        f, total = ctx.features, int(ctx.tokens.numel())
        if f is not None and len(f):
            if f.aux is None:
                raise ValueError("EAGLE-3 needs ctx.features.aux (the target's aux-layer inputs); the decoder "
                                 f"must request layers {self.aux_layers}")
            if f.start > self.n:
                raise ValueError(f"EAGLE-3 drafter got features from position {f.start} but has only {self.n} "
                                 "cached: features for committed positions were skipped")
            if f.start < self.n:  # re-sent features: recompute from there
                self.cache = [(k[:, :, :f.start], v[:, :, :f.start]) for k, v in self.cache]
                self.n = f.start
            n_new = len(f)
            if f.start + n_new > total - 1:
                raise ValueError(f"features reach position {f.start + n_new - 1} but the last committed token "
                                 f"is at {total - 1}; features must lag the tokens by one (spectrain/decoding/interface.py contract)")
            m = self.model
            emb = self.target.embed(ctx.tokens[f.start + 1: f.start + 1 + n_new])
            hidden = m.fuse(f.aux)[None]
            pos = torch.arange(f.start, f.start + n_new, device=hidden.device)
            causal = torch.ones(n_new, n_new, dtype=torch.bool, device=hidden.device).tril()
            mask = torch.cat([causal.new_ones(n_new, self.n), causal], 1)
            h, logits, new = self._run(emb, hidden, pos, mask, self._empty(), pos, self.n + n_new)
            self.cache = self.append_kv(self.cache, new)
            self.n = f.start + n_new
            self.root_hidden, self.root_logits = h[:, -1:], logits[-1]
        if self.n != total - 1 or self.root_logits is None:
            raise ValueError(f"EAGLE-3 drafter has features for {self.n} positions but {total} tokens are "
                             f"committed; the decoder must hand over features for positions up to {total - 2}")

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits -> target-vocab logits (-inf outside the draft vocab)."""
        full = logits.new_full((self.target.vocab_size,), float("-inf"))
        full[self.model.draft_ids] = logits
        return full

    def children(self, logits, n: int, sampler):
        """n children of one node: (target ids [n], log q [n], q row [V] or None)."""
        if sampler.greedy:
            top = logits.log_softmax(-1).topk(min(n, logits.numel()))
            return self.model.draft_ids[top.indices], top.values, None
        q = sampler.probs(self._full_logits(logits))
        # i.i.d. draws from q: what recursive rejection over siblings assumes
        toks = torch.multinomial(q, n, replacement=True, generator=sampler.generator)
        return toks, q[toks].log(), q

    # ---- proposing ---------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        if ctx.tokens.numel() < 2:  # a 1-token prompt: no target features to condition on yet
            return Proposal(tokens=ctx.tokens.new_zeros(0))
        self._ingest(ctx)
        if ctx.tree is not None:
            return self._tree(ctx)
        h, logits, temp = self.root_hidden, self.root_logits, self._empty()
        toks, qs = [], []
        for j in range(ctx.k):
            tok, _, q = self.children(logits, 1, ctx.sampler)
            toks.append(tok)
            qs.append(q)
            if j == ctx.k - 1:
                break
            # drafted token j+1 sits at position n + j and sees the whole cache + drafted 0..j
            mask = torch.ones(1, self.n + j + 1, dtype=torch.bool, device=h.device)
            pos = torch.tensor([self.n + j], device=h.device)
            h, lg, new = self._run(self.target.embed(tok), h, pos, mask, temp, pos.new_full((1,), self.n - 1), self.n)
            temp, logits = self.append_kv(temp, new), lg[0]
        tokens = torch.cat(toks) if toks else torch.zeros(0, dtype=torch.long, device=self.root_logits.device)
        probs = None if ctx.sampler.greedy or not qs else torch.stack(qs)
        return Proposal(tokens=tokens.long(), probs=probs)

    def _tree(self, ctx: DraftContext) -> Proposal:
        """EAGLE-2 dynamic tree: per depth, expand the `topk` best nodes (cumulative draft log-prob) by
        `topk` children each; keep the best `total_tokens` nodes (greedy) or whole sibling groups in
        order of their parent's score (sampling: dropping individual draws would bias the verifier)."""
        opts, sampler = ctx.tree, ctx.sampler
        topk, total = int(opts.get("topk", 4)), int(opts.get("total_tokens", 32))
        dev = self.root_logits.device
        tree = DraftTree.root(*self.children(self.root_logits, topk, sampler))
        temp = self._empty()
        for d in range(2, ctx.k + 1):
            expand = tree.to_expand(topk)
            m = len(expand)
            anc = torch.zeros(m, len(tree.hid), dtype=torch.bool, device=dev)
            hid, toks = tree.inputs(expand, self.root_hidden[0, 0], anc)
            mask = torch.cat([anc.new_ones(m, self.n), anc, torch.eye(m, dtype=torch.bool, device=dev)], 1)
            pos = torch.full((m,), self.n + d - 2, device=dev)
            h, lg, new = self._run(self.target.embed(torch.stack(toks)), torch.stack(hid)[None], pos, mask, temp,
                                   pos.new_full((m,), self.n - 1), self.n)
            temp = self.append_kv(temp, new)
            tree.grow(expand, d, h[0], anc, lambda j, lg=lg: self.children(lg[j], topk, sampler))
        return tree.proposal(total, sampler.greedy, dev, self._select)

    _select = staticmethod(select_nodes)  # the EAGLE-2 rule (tree.py); tests swap it per instance


def load(path, target) -> Eagle3Proposer:
    """Registry entry: a decoding-ready EAGLE-3 drafter from a spectrain head directory."""
    return Eagle3Proposer(Eagle3Head.from_pretrained(path, target), target)
