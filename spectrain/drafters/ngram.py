"""Prompt-lookup (n-gram) drafter: training-free, strong on extractive tasks (RAG, summaries, code edits).

The longest suffix of the committed tokens (n = max_n down to min_n) is searched in the earlier
text (prompt + generated); the tokens that followed the most recent match are proposed. Drafts are
deterministic (q = one-hot), which keeps sampling exactly lossless. As a tree drafter it merges the
continuations of up to ``topk`` distinct most-recent matches into a trie.

Spec strings for ``load_drafter``: ``"ngram"`` or ``"ngram:max_n=3,min_n=1,k=8"`` (``n`` is an
alias of ``max_n``; ``k`` caps the draft length below the decoder's k; defaults max_n=3, min_n=1).
"""

from __future__ import annotations

import torch

from spectrain.decoding.interface import DraftContext, Drafter, Proposal


class NgramDrafter(Drafter):
    name = "ngram"
    supports_tree = True

    def __init__(self, max_n: int = 3, min_n: int = 1, k: int | None = None):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"ngram drafter needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if k is not None and k <= 0:
            raise ValueError(f"ngram drafter k must be positive, got {k}")
        self.max_n, self.min_n, self.k = max_n, min_n, k

    @staticmethod
    def is_spec(spec: str) -> bool:
        """"ngram" / "ngram:..." (a drafter spec, not a path)."""
        return spec.split(":", 1)[0].strip() == "ngram"

    @classmethod
    def from_spec(cls, spec: str) -> NgramDrafter:
        """Parse "ngram" / "ngram:max_n=3,min_n=1,k=8"."""
        head, _, opts = spec.partition(":")
        if head.strip() != "ngram":
            raise ValueError(f"not an ngram spec: {spec!r}")
        kw: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in opts.split(","))):
            key, eq, val = item.partition("=")
            key = {"n": "max_n"}.get(key.strip(), key.strip())
            if not eq or key not in ("max_n", "min_n", "k"):
                raise ValueError(f"bad ngram option {item!r} in {spec!r}; valid: n|max_n=INT, min_n=INT, k=INT")
            try:
                kw[key] = int(val)
            except ValueError:
                raise ValueError(f"ngram option {key} needs an integer, got {val!r}") from None
        return cls(**kw)

    def _continuations(self, tokens: torch.Tensor, k: int, want: int) -> list[list[int]]:
        """Up to `want` distinct continuations (<= k tokens) of the longest matching suffix."""
        L = tokens.shape[0]
        found: list[list[int]] = []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = tokens[L - n:]
            # windows starting at 0..L-n-1 (the suffix itself is excluded: it has no continuation)
            windows = tokens[: L - 1].unfold(0, n, 1)
            hits = (windows == suffix).all(1).nonzero()[:, 0].flip(0).tolist()  # most recent first
            for start in hits:
                cont = tokens[start + n: start + n + k].tolist()
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) >= want:
                        return found
            if found:
                return found
        return found

    def propose(self, ctx: DraftContext) -> Proposal:
        k = min(ctx.k, self.k) if self.k else ctx.k
        tokens = ctx.tokens
        want = int(ctx.tree.get("topk", 4)) if ctx.tree else 1
        conts = self._continuations(tokens, k, want)
        if not conts:
            return Proposal(tokens=tokens.new_empty(0))
        if ctx.tree is None:
            return Proposal(tokens=torch.tensor(conts[0], device=tokens.device))
        # Merge continuations into a trie; parents precede children by construction.
        node_tok: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for cont in conts:
            par = -1
            for t in cont:
                key = (par, t)
                if key not in index:
                    index[key] = len(node_tok)
                    node_tok.append(t)
                    parents.append(par)
                par = index[key]
        return Proposal(tokens=torch.tensor(node_tok, device=tokens.device), parents=torch.tensor(parents))
