"""EAGLE-3 for batched decoding: every row's head cache in one tensor, one head forward per draft step.

The single-sequence adapter (``Eagle3Proposer`` in decode.py) keeps, per layer, the step-0 K/V of
every committed position. Here those caches are stacked into ``[B, heads, S, dim]`` with
``slot_pos[b, s]`` = the position held by slot s of row b, or -1 for a hole (the same layout as the
target cache in spectrain/decoding/batched.py). Per step:

- ingest: each row's new target features (1 + its accepted drafts, ragged) are padded to the
  longest and run in one forward; padded rows become holes;
- chains: all rows draft together, one forward per depth, each row attending to its own valid
  cache + its drafted tokens (drafted K/V stay temporary, as in the single-sequence adapter);
- trees: the EAGLE-2 dynamic tree of tree.py for every row at once: each row expands its own
  best nodes, all rows' expanded nodes share one forward per depth.

Per row, the attention sees exactly the single-sequence keys; only rounding differs, which changes
at most the draft, never the output (the target verifies every token).
"""

from __future__ import annotations

import torch

from spectrain.decoding.interface import DraftContext, Proposal
from spectrain.decoding.kv_cache import compact_order, gather_slots
from spectrain.drafters.eagle3.tree import DraftTree


class BatchedEagle3:
    def __init__(self, proposer, n_rows: int):
        self.p = proposer
        c, w = proposer.model.config, proposer.model.fc.weight
        z = w.new_zeros(n_rows, c["num_attention_heads"], 0, c["head_dim"])
        self.cache = [(z, z) for _ in proposer.model.layers]
        self.slot_pos = torch.zeros(n_rows, 0, dtype=torch.long, device=w.device)
        self.n = [0] * n_rows  # committed positions ingested per row
        self.root_h = w.new_zeros(n_rows, c["hidden_size"])
        self.root_logits = w.new_zeros(n_rows, c["draft_vocab_size"]).float()

    def keep_rows(self, idx: list[int]) -> None:
        i = torch.tensor(idx, device=self.slot_pos.device)
        self.cache = [(k.index_select(0, i), v.index_select(0, i)) for k, v in self.cache]
        self.slot_pos, self.root_h, self.root_logits = (t.index_select(0, i) for t in
                                                        (self.slot_pos, self.root_h, self.root_logits))
        self.n = [self.n[j] for j in idx]

    # ---- ingesting target features -------------------------------------------------------------
    def _new_rows(self, ctxs: list[DraftContext | None]) -> list[int]:
        counts = []
        for b, ctx in enumerate(ctxs):
            f = None if ctx is None else ctx.features
            m = 0 if f is None else len(f)
            if m:
                if f.aux is None:
                    raise ValueError("EAGLE-3 needs ctx.features.aux (the target's aux-layer inputs); the decoder "
                                     f"must request layers {self.p.aux_layers}")
                if f.start != self.n[b] or f.start + m != ctx.tokens.numel() - 1:
                    raise ValueError(f"EAGLE-3 row {b}: features for positions {f.start}..{f.start + m - 1} do not "
                                     f"continue the {self.n[b]} cached ones up to the newest committed token "
                                     "(spectrain/decoding/interface.py contract: consecutive, lagging the tokens by one)")
            counts.append(m)
        return counts

    def ingest(self, ctxs: list[DraftContext | None]) -> None:
        counts = self._new_rows(ctxs)
        m = max(counts)
        if m == 0:
            return
        model, B, dev = self.p.model, len(ctxs), self.slot_pos.device
        aux = None
        ids = torch.zeros(B, m, dtype=torch.long, device=dev)
        for b, (ctx, c) in enumerate(zip(ctxs, counts)):
            if c:
                f = ctx.features
                if aux is None:
                    aux = f.aux.new_zeros(B, m, f.aux.shape[-1])
                aux[b, :c] = f.aux
                ids[b, :c] = ctx.tokens[f.start + 1: f.start + 1 + c]
        real = torch.arange(m, device=dev)[None] < torch.tensor(counts, device=dev)[:, None]  # [B, m]
        pos = torch.tensor(self.n, device=dev)[:, None] + torch.arange(m, device=dev)[None]
        causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        new_mask = (causal[None] & real[:, None, :] & real[:, :, None]) | torch.eye(m, dtype=torch.bool, device=dev)
        past = (self.slot_pos >= 0)[:, None, :] & real[:, :, None]
        mask = torch.cat([past, new_mask], -1)[:, None]
        h, logits, new = self._run(self.p.target.embed(ids), model.fuse(aux), pos, mask, self._empty(B))
        self.cache = self.p.append_kv(self.cache, new)
        self.slot_pos = torch.cat([self.slot_pos, torch.where(real, pos, -1)], 1)
        for b, c in enumerate(counts):
            if c:
                self.n[b] += c
                self.root_h[b], self.root_logits[b] = h[b, c - 1], logits[b, c - 1]
        order = compact_order(self.slot_pos)
        if order is not None:
            self.cache = [(gather_slots(k, order), gather_slots(v, order)) for k, v in self.cache]
            self.slot_pos = self.slot_pos.gather(1, order)

    def _empty(self, B: int):
        k = self.cache[0][0]
        z = k.new_zeros(B, k.shape[1], 0, k.shape[-1])
        return [(z, z) for _ in self.cache]

    def _run(self, emb, hidden, pos, mask, temp):
        return self.p.run_rows(self.cache, emb, hidden, pos, mask, temp)

    # ---- proposing -----------------------------------------------------------------------------
    def propose(self, ctxs: list[DraftContext | None]) -> list[Proposal | None]:
        self.ingest(ctxs)
        out: list[Proposal | None] = [None] * len(ctxs)
        live = [b for b, c in enumerate(ctxs) if c is not None]
        for b in live:
            if self.n[b] != ctxs[b].tokens.numel() - 1 or ctxs[b].tokens.numel() < 2:
                if ctxs[b].tokens.numel() >= 2:
                    raise ValueError(f"EAGLE-3 row {b} has features for {self.n[b]} positions but "
                                     f"{ctxs[b].tokens.numel()} tokens are committed")
                out[b] = Proposal(tokens=ctxs[b].tokens.new_zeros(0))  # 1-token prompt: nothing to draft from
        todo = [b for b in live if out[b] is None]
        chains = [b for b in todo if ctxs[b].tree is None]
        if chains:
            for b, prop in zip(chains, self._chains([ctxs[b] for b in chains], chains)):
                out[b] = prop
        trees = [b for b in todo if ctxs[b].tree is not None]
        for k in sorted({ctxs[b].k for b in trees}):  # rows near their token budget draft shallower trees
            rows = [b for b in trees if ctxs[b].k == k]
            for b, prop in zip(rows, self._trees([ctxs[b] for b in rows], rows)):
                out[b] = prop
        return out

    def _trees(self, ctxs: list[DraftContext], rows: list[int]) -> list[Proposal]:
        """The single-row EAGLE-2 tree (tree.DraftTree) for every row at once: per depth each row expands its own
        `topk` best nodes, and all rows' expanded nodes go through one head forward (same shapes in every row)."""
        p, dev = self.p, self.slot_pos.device
        opts, sampler, k = ctxs[0].tree, ctxs[0].sampler, ctxs[0].k
        topk, total = int(opts.get("topk", 4)), int(opts.get("total_tokens", 32))
        idx = torch.tensor(rows, device=dev)
        cache = [(kk.index_select(0, idx), v.index_select(0, idx)) for kk, v in self.cache]
        valid = self.slot_pos.index_select(0, idx) >= 0
        root_h = self.root_h.index_select(0, idx)
        n = torch.tensor([self.n[b] for b in rows], device=dev)
        trees = [DraftTree.root(*p.children(self.root_logits[b], topk, sampler)) for b in rows]
        temp = self._empty(len(rows))
        for d in range(2, k + 1):
            expand = [t.to_expand(topk) for t in trees]
            m = len(expand[0])
            anc = torch.zeros(len(rows), m, len(trees[0].hid), dtype=torch.bool, device=dev)
            hid, toks = [], []
            for r, (t, ex) in enumerate(zip(trees, expand)):
                row_hid, row_toks = t.inputs(ex, root_h[r], anc[r])
                hid += row_hid
                toks += row_toks
            eye = torch.eye(m, dtype=torch.bool, device=dev).expand(len(rows), m, m)
            mask = torch.cat([valid[:, None, :].expand(-1, m, -1), anc, eye], 2)[:, None]
            h, lg, new = p.run_rows(cache, p.target.embed(torch.stack(toks)).view(len(rows), m, -1),
                                    torch.stack(hid).view(len(rows), m, -1), (n + d - 2)[:, None].expand(-1, m),
                                    mask, temp)
            temp = p.append_kv(temp, new)
            for r, (t, ex) in enumerate(zip(trees, expand)):
                t.grow(ex, d, h[r], anc[r], lambda j, r=r, lg=lg: p.children(lg[r, j], topk, sampler))
        return [t.proposal(total, sampler.greedy, dev) for t in trees]

    def _chains(self, ctxs: list[DraftContext], rows: list[int]) -> list[Proposal]:
        """Chains for `rows`, one head forward per depth for all of them."""
        dev = self.slot_pos.device
        sampler, kmax = ctxs[0].sampler, max(c.k for c in ctxs)
        idx = torch.tensor(rows, device=dev)
        cache = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.cache]
        valid = self.slot_pos.index_select(0, idx) >= 0
        h, logits = self.root_h.index_select(0, idx)[:, None], self.root_logits.index_select(0, idx)
        n = torch.tensor([self.n[b] for b in rows], device=dev)
        temp, toks, qs = self._empty(len(rows)), [], []
        for j in range(kmax):
            tok, q = self._next_tokens(logits, sampler)
            toks.append(tok)
            qs.append(q)
            if j == kmax - 1:
                break
            # drafted token j+1 sits at position n + j and sees the row's valid cache + drafted 0..j
            mask = torch.cat([valid, valid.new_ones(len(rows), j + 1)], 1)[:, None, None]
            h, lg, new = self.p.run_rows(cache, self.p.target.embed(tok)[:, None], h, (n + j)[:, None], mask, temp)
            temp, logits = self.p.append_kv(temp, new), lg[:, 0]
        tokens = torch.stack(toks, 1).long()
        probs = None if sampler.greedy else torch.stack(qs, 1)
        return [Proposal(tokens=tokens[r, : c.k], probs=None if probs is None else probs[r, : c.k])
                for r, c in enumerate(ctxs)]

    def _next_tokens(self, logits: torch.Tensor, sampler):
        """A chain's next token per row: (target ids [R], q rows [R, V] or None when greedy)."""
        ids = self.p.model.draft_ids
        if sampler.greedy:
            return ids[logits.argmax(-1)], None
        full = logits.new_full((logits.shape[0], self.p.target.vocab_size), float("-inf"))
        full[:, ids] = logits
        q = sampler.probs(full)
        return torch.multinomial(q, 1, generator=sampler.generator)[:, 0], q
