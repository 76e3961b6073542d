"""The one small interface every drafter implements (n-gram, HF draft LM, EAGLE-3, Medusa).

Decoding loop contract (spectrain.decoding.loop.speculative_generate):

1. ``begin(prompt)`` once per sequence (reset caches / indexes).
2. Repeatedly ``propose(ctx)`` -> ``Proposal``; the target verifies it in one forward pass.
3. ``commit(accepted)`` tells the drafter which proposal nodes were accepted, so it can roll its
   own state (KV cache, tree buffers) back to the accepted prefix. The token the target emitted
   after them (bonus / correction) is not a proposal node: it shows up as the last entry of the
   next ``ctx.tokens``. ``commit`` is called after every ``propose`` (also with ``[]``).

Batched decoding (``batch_size=B``, spectrain/decoding/batched.py) calls ``begin_batch(prompts)``, then per
step ``propose_batch(ctxs)`` / ``commit_batch(accepted)`` with one entry per active row (``None`` for a
row that drafts nothing this step), and ``keep_rows(idx)`` when rows leave the batch. The defaults
below run an independent shallow copy of the drafter per row (weights shared, per-sequence state
separate), so every drafter is correct batched; a family may override them to draft all rows in one
forward (EAGLE-3 chains do). Per row, the contract is exactly the single-sequence one.

``DraftContext.tokens`` is always the full committed sequence (prompt + emitted tokens), length L.

Target features (head drafters) lag the tokens by one: the drafter has, in total, received rows
for positions ``0 .. L-2`` when ``propose`` is called — every committed token except the newest one
(the bonus / corrected token, which the target has not processed yet). ``ctx.features`` holds only
the rows that are new since the previous ``propose`` (``features.start`` = index in ``ctx.tokens``
of its first row; rows are consecutive positions); concatenate them onto what you kept. The first
``propose`` of a sequence gets rows ``0 .. L-2`` of the prompt (``None`` for a 1-token prompt).
Row j of ``aux`` is ``cat([input of layer a][pos] for a in aux_layers], -1)`` (in the order of
``aux_layers``), row j of ``final_hidden`` the target's normed last hidden state at that position,
both exactly what a from-scratch target forward over ``ctx.tokens`` would give. Head drafters
declare what they need with ``features()``, the same ``FeatureSpec`` their trained head returns
(spectrain/registry.py); nothing is computed otherwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spectrain.registry import FeatureSpec

if TYPE_CHECKING:  # annotations only: the sampler module itself checks arguments against this interface
    from spectrain.decoding.sampling import Sampler

@dataclass
class TargetFeatures:
    start: int  # index in ctx.tokens of the first row below
    aux: torch.Tensor | None = None  # [n, len(aux_layers) * H] inputs of the requested layers, concatenated
    final_hidden: torch.Tensor | None = None  # [n, H] after the final norm (Medusa)

    def __len__(self) -> int:
        t = self.aux if self.aux is not None else self.final_hidden
        return 0 if t is None else t.shape[0]


@dataclass
class DraftContext:
    tokens: torch.Tensor  # [L] committed ids (1-D, on the target's device)
    k: int  # chain length, or tree depth
    sampler: Sampler  # the same warp the target side uses
    features: TargetFeatures | None = None  # new target features since the last propose()
    tree: dict | None = None  # tree options (e.g. {"topk": 4, "total_tokens": 32}); None = chain


@dataclass
class Proposal:
    """A chain (``parents=None``) or a tree of drafted tokens.

    Trees: ``parents[i] < i`` (topological order), -1 = child of the last committed token; nodes
    deeper than ``ctx.k`` are dropped. Siblings are verified in index order, so put the likeliest first.

    ``probs`` (sampling only; ignored when greedy). ``None`` means deterministic drafts (e.g. top-k
    or n-gram): q = one-hot, always exact, acceptance = p(x). Otherwise ``probs[i]`` must be the
    distribution node i was actually *drawn* from (same warp as ``ctx.sampler``), given the path to
    it and its earlier siblings. Whether a drawn node stays in the tree must not depend on its own
    value or on its later siblings' values (keep or drop whole prefixes of a sibling group); which
    nodes get expanded may depend on anything. Siblings drawn i.i.d. from one q: give that q for
    each. Siblings drawn *without replacement*: give the parent's q for each and set
    ``without_replacement=True``; the verifier zeroes the earlier siblings' tokens and renormalises.
    Anything else is not lossless (tests/test_sampling_exact.py checks such claims statistically).
    """

    tokens: torch.Tensor  # [n] drafted ids
    parents: torch.Tensor | None = None  # [n] parent node index, -1 = the last committed token; None = chain
    probs: torch.Tensor | None = None  # [n, V] the warped q each node was drawn from (None = deterministic)
    without_replacement: bool = False  # tree siblings drawn without replacement from the shared probs row

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return self.parents is None


class Drafter:
    name: str = "drafter"
    # The default ``features()`` reads these two; a drafter backed by a trained head returns the head's spec.
    aux_layers: list[int] = []  # target layers (inputs of) whose states the drafter needs
    needs_final_hidden: bool = False
    supports_tree: bool = False

    def features(self) -> FeatureSpec:
        """The target features both decoding loops compute for this drafter (aux layers, final hidden)."""
        return FeatureSpec(tuple(self.aux_layers or ()), final_hidden=bool(self.needs_final_hidden))

    def begin(self, prompt: torch.Tensor) -> None:
        """Start a new sequence."""

    def propose(self, ctx: DraftContext) -> Proposal:
        raise NotImplementedError

    def commit(self, accepted: list[int]) -> None:
        """`accepted`: indices of proposal nodes that were accepted, root to leaf."""

    # ---- batched decoding (see the module docstring) -------------------------------------------
    def begin_batch(self, prompts: list[torch.Tensor]) -> None:
        self._rows = []
        for p in prompts:
            row = copy.copy(self)  # begin() below replaces every per-sequence attribute of the copy
            row._rows = None
            row.begin(p)
            self._rows.append(row)

    def propose_batch(self, ctxs: list[DraftContext | None]) -> list[Proposal | None]:
        return [None if c is None else r.propose(c) for r, c in zip(self._rows, ctxs)]

    def commit_batch(self, accepted: list[list[int] | None]) -> None:
        for r, a in zip(self._rows, accepted):
            if a is not None:
                r.commit(a)

    def keep_rows(self, idx: list[int]) -> None:
        self._rows = [self._rows[i] for i in idx]
