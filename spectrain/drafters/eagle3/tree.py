"""The node selection of EAGLE-2's dynamic draft tree, shared by single-row (decode.py) and batched (batch.py)
drafting."""

from __future__ import annotations


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
