"""Batched lossless speculative decoding: B rows share every target verification pass.

``speculative_generate(..., batch_size=B)`` lands here. Rows are taken in chunks of B; inside a
chunk every step runs ONE target forward over ``[B, 1 + n_max]`` tokens (each row's last committed
token + its drafted nodes, padded to the longest proposal of the step) and each row accepts its own
number of tokens (ragged acceptance) with the same rules as batch size 1 (spectrain/decoding/acceptance.py).

Target cache: one HF ``DynamicCache`` of shape ``[B, heads, S, dim]``. Every step appends the same
q = 1 + n_max slots to every row; ``slot_pos[b, s]`` is the logical position held by slot s of row
b, or -1 for a hole (left padding of the prefill, padded nodes, rejected nodes). The attention mask
is built here as a 4-D ``[B, 1, q, S + q]`` tensor, which HF models take as-is: a query attends to
its row's valid past slots (sliding-window layers: inside the window, spectrain/decoding/masks.py), to its
tree ancestors among this step's nodes and to itself. Position ids are explicit per row, so holes
cost nothing but memory; the cache is compacted (valid slots gathered, left padded) when holes
outnumber valid slots. Rows that stop (eos or max_new_tokens) leave the batch: their cache rows are
dropped and the drafter is told (``Drafter.keep_rows``), so nothing is ever re-padded per step.

The per-row invariant is batch size 1's (loop.py): the valid slots of row b hold ``tokens[:-1]``.
Drafters see the per-row contract of spectrain/decoding/interface.py through ``propose_batch`` (default:
one independent copy of the drafter per row; EAGLE-3 chains run all rows in one head forward).

Statistics are per row (one ``DecodeStats`` per output, aggregated with ``DecodeStats.merge`` as
for batch size 1). Shared step time is split evenly over the rows active in that step, so summed
``target_time_s`` / ``draft_time_s`` equal the batch's; a row's ``wall_time_s`` is its latency from
the start of its chunk to its last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import DynamicCache

from spectrain.decoding import kv_cache
from spectrain.decoding.acceptance import accept_chain, accept_tree
from spectrain.decoding.interface import DraftContext
from spectrain.decoding.masks import batch_mask, layer_masks
from spectrain.decoding.stats import DecodeStats, SpecOutput
from spectrain.decoding.step import (
    clip_proposal,
    concat_features,
    cut_at_stop,
    depths,
    features_at,
    now,
    record_step,
    timed,
)
from spectrain.registry import FeatureSpec


@dataclass
class _Row:
    tokens: list[int]
    stats: object
    pending: list = field(default_factory=list)  # TargetFeatures not yet handed to the drafter
    emitted: list[int] = field(default_factory=list)
    stop: str = "length"
    done: bool = False


def generate_batched(target, drafter, rows: list[list[int]], max_new: int, k: int, sampler, eos: set[int],
                     tree: dict | None, batch_size: int) -> list:
    """All rows, ``batch_size`` at a time; returns one ``SpecOutput`` per row, in order."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer (rows decoded together), got {batch_size!r}")
    outs = []
    for i in range(0, len(rows), batch_size):
        outs += _generate_chunk(target, drafter, rows[i: i + batch_size], max_new, k, sampler, eos, tree)
    return outs


def _generate_chunk(target, drafter, prompts, max_new, k, sampler, eos, tree) -> list:
    dev = target.device
    spec = drafter.features() if drafter is not None else FeatureSpec()
    aux_layers, want_final = list(spec.aux_layers), spec.final_hidden
    want_feats = bool(aux_layers) or want_final
    rows = [_Row(tokens=list(p), stats=DecodeStats(k=k, sequences=1, prefill_tokens=len(p))) for p in prompts]
    for r in rows:
        r.stats._grow(k)
    active = list(range(len(rows)))  # indices of rows still decoding, in batch order
    t_start = now(dev)
    draft, verify = partial(_share, rows, active, "draft_time_s"), partial(_share, rows, active, "target_time_s")
    if drafter is not None:
        with timed(dev, draft):
            drafter.begin_batch([torch.tensor(p, device=dev) for p in prompts])
    with timed(dev, verify):
        cache, slot_pos = _prefill(target, rows, aux_layers, want_final, want_feats)
    while active:
        draft, verify = partial(_share, rows, active, "draft_time_s"), partial(_share, rows, active, "target_time_s")
        step = _Step(target, drafter, [rows[i] for i in active], k, max_new, sampler, tree, eos)
        with timed(dev, draft):
            step.propose()
        with timed(dev, verify):
            new_pos = step.verify(cache, slot_pos, aux_layers, want_final, want_feats)
            slot_pos = torch.cat([slot_pos, new_pos], 1)
        with timed(dev, draft):
            step.commit()
        t_now = now(dev)
        for i in active:
            if rows[i].done:
                rows[i].stats.wall_time_s = t_now - t_start
        keep = [j for j, i in enumerate(active) if not rows[i].done]
        if len(keep) < len(active):  # rows that stopped leave the batch: cache rows and drafter rows
            active = [active[j] for j in keep]
            if not active:
                break
            slot_pos = kv_cache.select_rows(cache, slot_pos, keep)
            if drafter is not None:
                drafter.keep_rows(keep)
        slot_pos = kv_cache.compact(cache, slot_pos)
    return [SpecOutput(tokens=r.emitted, stats=r.stats, stop_reason=r.stop) for r in rows]


def _share(rows, active, name: str, seconds: float) -> None:
    for i in active:
        setattr(rows[i].stats, name, getattr(rows[i].stats, name) + seconds / len(active))


# ---------------------------------------------------------------------------------------------
# one step


class _Step:
    """Propose for every active row, verify them in one target pass, accept per row."""

    def __init__(self, target, drafter, rows, k, max_new, sampler, tree, eos):
        self.target, self.drafter, self.rows, self.k = target, drafter, rows, k
        self.max_new, self.sampler, self.tree, self.eos = max_new, sampler, tree, eos
        self.props: list = [None] * len(rows)
        self.keep_idx: list[list[int]] = [[] for _ in rows]
        self.paths: list[list[int]] = [[] for _ in rows]

    def propose(self) -> None:
        if self.drafter is None:
            return
        dev = self.target.device
        ctxs = []
        for r in self.rows:
            limit = min(self.k, self.max_new - len(r.emitted) - 1)  # never draft past the token budget
            if limit <= 0:
                ctxs.append(None)
                continue
            ctxs.append(DraftContext(tokens=torch.tensor(r.tokens, device=dev), k=limit, sampler=self.sampler,
                                     features=concat_features(r.pending), tree=self.tree))
            r.pending = []
        self.ctxs = ctxs
        for j, (ctx, prop) in enumerate(zip(ctxs, self.drafter.propose_batch(ctxs))):
            if ctx is not None:
                self.props[j], self.keep_idx[j] = clip_proposal(prop, ctx.k, self.target.vocab_size)

    def verify(self, cache, slot_pos, aux_layers, want_final, want_feats) -> torch.Tensor:
        """The batch's verification pass; returns the new slots' positions [B, q] (-1 = hole)."""
        dev = self.target.device
        B = len(self.rows)
        sizes = [len(p) if p is not None else 0 for p in self.props]
        q = 1 + max(sizes)
        ids = torch.zeros(B, q, dtype=torch.long, device=dev)
        depth = torch.zeros(B, q, dtype=torch.long, device=dev)
        anc = torch.eye(q, dtype=torch.bool, device=dev).repeat(B, 1, 1)  # [B, q, q] tree structure
        for b, (r, p) in enumerate(zip(self.rows, self.props)):
            ids[b, 0] = r.tokens[-1]
            if p is None:
                continue
            n = len(p)
            ids[b, 1: n + 1] = p.tokens.to(dev)
            if p.is_chain:  # node i sees the root and nodes 0..i
                depth[b, 1: n + 1] = torch.arange(1, n + 1, device=dev)
                anc[b, : n + 1, : n + 1] = torch.ones(n + 1, n + 1, dtype=torch.bool, device=dev).tril()
                continue
            parents = p.parents.tolist()
            depth[b, 1: n + 1] = torch.tensor(depths(parents), device=dev)
            for i, par in enumerate(parents):
                anc[b, i + 1] |= anc[b, par + 1]
        P = torch.tensor([len(r.tokens) - 1 for r in self.rows], device=dev)
        qpos = P[:, None] + depth
        mask = batch_mask(self.target, slot_pos, qpos, anc, torch.tensor(sizes, device=dev))
        out = self.target.forward(ids, position_ids=qpos, attention_mask=mask, cache=cache, aux_layers=aux_layers,
                                  want_final_hidden=want_final, use_cache=True)
        new_pos = torch.full((B, q), -1, dtype=torch.long, device=dev)
        for b, (r, p) in enumerate(zip(self.rows, self.props)):
            rule = accept_chain if p is None or p.is_chain else accept_tree
            path, new, outcomes = rule(out.logits[b, : 1 + sizes[b]], p, self.sampler)
            path, new, outcomes, stop = cut_at_stop(path, new, outcomes, self.max_new - len(r.emitted), self.eos)
            Pb = int(P[b])
            new_pos[b, 0] = Pb
            for j, i in enumerate(path):
                new_pos[b, 1 + i] = Pb + 1 + j
            if want_feats:
                r.pending.append(features_at(out, Pb, [0] + [1 + i for i in path], b))
            record_step(r.stats, p, outcomes, new)
            r.tokens.extend(new)
            r.emitted.extend(new)
            self.paths[b] = path
            if stop or len(r.emitted) >= self.max_new:
                r.done, r.stop = True, stop or "length"
        return new_pos

    def commit(self) -> None:
        if self.drafter is None:
            return
        self.drafter.commit_batch([None if ctx is None else [keep[i] for i in path]
                                   for ctx, keep, path in zip(self.ctxs, self.keep_idx, self.paths)])


# ---------------------------------------------------------------------------------------------
# the prefill


def _prefill(target, rows, aux_layers, want_final, want_feats):
    """Feed every row's prompt[:-1], left padded; returns (cache, slot_pos [B, S])."""
    dev = target.device
    B = len(rows)
    lens = [len(r.tokens) - 1 for r in rows]
    L = max(lens)
    cache = DynamicCache()
    slot_pos = torch.full((B, L), -1, dtype=torch.long, device=dev)
    if L == 0:
        return cache, slot_pos
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    for b, (r, n) in enumerate(zip(rows, lens)):
        ids[b, L - n:] = torch.tensor(r.tokens[:-1], device=dev)
        slot_pos[b, L - n:] = torch.arange(n, device=dev)
    pos = slot_pos.clamp_min(0)
    valid = slot_pos >= 0
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    mask = causal[None] & valid[:, None, :] & valid[:, :, None]
    mask |= torch.eye(L, dtype=torch.bool, device=dev)[None]  # pad queries see themselves: no NaN rows
    out = target.forward(ids, position_ids=pos, attention_mask=layer_masks(target, mask, pos, pos), cache=cache,
                         aux_layers=aux_layers, want_final_hidden=want_final, want_logits=False, use_cache=True)
    if want_feats:
        for b, (r, n) in enumerate(zip(rows, lens)):
            if n:
                r.pending.append(features_at(out, 0, list(range(L - n, L)), b))
    return out.cache, slot_pos
