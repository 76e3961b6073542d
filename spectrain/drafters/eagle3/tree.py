"""EAGLE-2's dynamic draft tree, written once: the growing tree of one row (``DraftTree``) and its node
selection (``select_nodes``), used by the single-row proposer (decode.py, one tree) and the batched one
(batch.py, one tree per row, all rows' expanded nodes in one head forward per depth)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spectrain.decoding.interface import Proposal


def select_nodes(par: list[int], score: list[float], depth: list[int], total: int, greedy: bool) -> set[int]:
    """EAGLE-2's dynamic tree: keep the ``total`` nodes of highest cumulative score (greedy), or, when sampling,
    whole prefixes of each parent's i.i.d. draws in score order of the parents."""
    # a parent's cumulative log-prob is >= its children's and its depth smaller, so walking nodes
    # by (-score, depth) always meets a parent before its children
    rank = sorted(range(len(par)), key=lambda i: (-score[i], depth[i], i))
    keep: set[int] = set()
    if greedy:
        for i in rank:
            if len(keep) >= total:
                break
            if par[i] < 0 or par[i] in keep:
                keep.add(i)
        return keep
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(par):
        groups.setdefault(p, []).append(i)
    for p in [-1, *rank]:
        if p in groups and (p < 0 or p in keep):
            keep.update(groups[p][: max(0, total - len(keep))])  # a prefix of i.i.d. draws is i.i.d.
    return keep


@dataclass
class DraftTree:
    """One row's tree while it grows. Nodes are numbered in creation order: token, parent (-1 = a child of the
    root), cumulative draft log-prob, depth (1 = the root's children) and the q row they were drawn from (None
    when greedy). Nodes that were expanded ("forwarded") also keep the head's output row for them and their
    ancestor mask over all forwarded rows (itself included): what their children attend to."""

    tok: list[torch.Tensor]
    par: list[int]
    score: list[torch.Tensor]
    depth: list[int]
    q: list[torch.Tensor | None]
    layer: list[int]  # the newest depth's nodes: the candidates for the next expansion
    fwd_of: dict[int, int] = field(default_factory=dict)  # node -> forwarded row (row of the temp K/V)
    hid: list[torch.Tensor] = field(default_factory=list)  # per forwarded row: the head's layer output
    anc: list[torch.Tensor] = field(default_factory=list)  # per forwarded row: ancestor rows (bool)

    @classmethod
    def root(cls, tok: torch.Tensor, lq: torch.Tensor, q: torch.Tensor | None) -> DraftTree:
        """The root's children (depth 1) as drawn from the root's logits."""
        n = len(tok)
        return cls(list(tok), [-1] * n, list(lq), [1] * n, [q] * n, list(range(n)))

    def to_expand(self, topk: int) -> list[int]:
        """The newest depth's ``topk`` best nodes (by cumulative score; ties keep creation order)."""
        return sorted(self.layer, key=lambda i: -float(self.score[i]))[:topk]

    def inputs(self, expand: list[int], root_hidden: torch.Tensor, anc: torch.Tensor
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """For the nodes to expand: fills ``anc`` [m, forwarded rows] with each node's parent's ancestor mask,
        returns (hidden fed with each node: its parent's output row or the root's, its token)."""
        hid, toks = [], []
        for j, i in enumerate(expand):
            p = self.par[i]
            if p >= 0:
                a = self.anc[self.fwd_of[p]]
                anc[j, : a.numel()] = a
            hid.append(root_hidden if p < 0 else self.hid[self.fwd_of[p]])
            toks.append(self.tok[i])
        return hid, toks

    def grow(self, expand: list[int], depth: int, h: torch.Tensor, anc: torch.Tensor,
             children: Callable[[int], tuple]) -> None:
        """Record the forward of ``expand`` (head outputs ``h`` [m, H], ancestor masks ``anc`` [m, base]) and add
        each node's children, ``children(j) -> (target ids, log q, q row or None)`` for expanded node j."""
        base, m = len(self.hid), len(expand)
        self.layer = []
        for j, i in enumerate(expand):
            self.fwd_of[i] = base + j
            self.hid.append(h[j])
            row = torch.zeros(base + m, dtype=torch.bool, device=anc.device)
            row[:base], row[base + j] = anc[j], True
            self.anc.append(row)
            tok, lq, q = children(j)
            self.layer += range(len(self.tok), len(self.tok) + len(tok))
            self.tok += list(tok)
            self.par += [i] * len(tok)
            self.score += list(self.score[i] + lq)
            self.depth += [depth] * len(tok)
            self.q += [q] * len(tok)

    def proposal(self, total: int, greedy: bool, device, select=select_nodes) -> Proposal:
        """The kept nodes (``select``: the EAGLE-2 rule) as a Proposal, parents before children."""
        keep = select(self.par, [float(s) for s in self.score], self.depth, total, greedy)
        order = sorted(keep, key=lambda i: (self.depth[i], i))
        new_index = {old: new for new, old in enumerate(order)}
        parents = torch.tensor([-1 if self.par[i] < 0 else new_index[self.par[i]] for i in order], device=device)
        tokens = torch.stack([self.tok[i] for i in order]).long()
        probs = None if greedy else torch.stack([self.q[i] for i in order])
        return Proposal(tokens=tokens, parents=parents, probs=probs)
