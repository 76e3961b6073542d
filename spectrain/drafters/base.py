"""The one small interface every drafter implements (n-gram, HF draft LM, EAGLE-3, Medusa).

Decoding loop contract (spectrain.decoding.speculative_generate):

1. ``begin(prompt)`` once per sequence (reset caches / indexes).
2. Repeatedly ``propose(ctx)`` -> ``Proposal``; the target verifies it in one forward pass.
3. ``commit(accepted)`` tells the drafter which proposal nodes were accepted, so it can roll its
   own state (KV cache, tree buffers) back to the accepted prefix.

``DraftContext.tokens`` is always the full committed sequence (prompt + emitted tokens). Target
features lag the tokens by one: after each verification the decoder hands over the target's
hidden states for every committed position whose features the drafter has not yet received
(the last committed token, the bonus/corrected one, has none yet). Head drafters (EAGLE-3 /
Medusa) declare what they need with ``aux_layers`` / ``needs_final_hidden``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectrain.sampling import Sampler


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
    tokens: torch.Tensor  # [n] drafted ids
    parents: torch.Tensor | None = None  # [n] parent node index, -1 = the last committed token; None = chain
    probs: torch.Tensor | None = None  # [n, V] the warped q each node was drawn from (None when greedy)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return self.parents is None


class Drafter:
    name: str = "drafter"
    aux_layers: list[int] = []  # target layers (inputs of) whose states the drafter needs
    needs_final_hidden: bool = False
    supports_tree: bool = False

    def begin(self, prompt: torch.Tensor) -> None:
        """Start a new sequence."""

    def propose(self, ctx: DraftContext) -> Proposal:
        raise NotImplementedError

    def commit(self, accepted: list[int]) -> None:
        """`accepted`: indices of proposal nodes that were accepted, root to leaf."""
