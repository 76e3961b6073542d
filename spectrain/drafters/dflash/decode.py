"""DFlash decoding: the whole chain from one draft forward.

The context vectors of committed positions arrive as target features after every verify pass (the decoding loops
hand over the features of every committed token but the newest); each layer's keys / values of them are appended to
a cache once, and nothing rolls back, since only committed tokens ever enter it. A proposal is one forward over the block
[newest token, mask x k] at positions P .. P + k; slot i drafts token P + i. Sampling draws each slot from its own
warped distribution q_i, which does not depend on the other slots' draws: exact rejection sampling holds per slot.
"""

from __future__ import annotations

import torch

from spectrain.decoding.interface import DraftContext, Drafter, Proposal
from spectrain.drafters.dflash.model import DFlashHead
from spectrain.registry import FeatureSpec


class DFlashProposer(Drafter):
    name = "dflash"

    def __init__(self, model: DFlashHead, target):
        self.model = model.eval()
        self.target = target
        self.block_size = int(model.config["block_size"])
        self.begin(None)

    def features(self) -> FeatureSpec:
        return FeatureSpec(tuple(self.model.aux_layers))

    def begin(self, prompt: torch.Tensor | None) -> None:
        self.n = 0  # committed positions 0 .. n - 1 in the cache
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: keys, values [1, heads, n, hd]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        self._add_context(ctx.features)
        P = ctx.tokens.shape[0] - 1
        if self.n != P or P == 0:
            return Proposal(tokens=ctx.tokens.new_empty(0))  # no context yet (a one-token prompt): draft nothing
        k = min(ctx.k, self.block_size - 1)
        dev = ctx.tokens.device
        block = torch.full((k + 1,), int(self.model.config["mask_token_id"]), device=dev, dtype=ctx.tokens.dtype)
        block[0] = ctx.tokens[-1]
        emb = self.target.embed(block)
        mask = torch.ones(k + 1, P + k + 1, dtype=torch.bool, device=dev)  # the whole context and the whole block
        logits = self.model.block_logits(self.target, emb, torch.arange(P, P + k + 1, device=dev), self.kv, mask)[1:]
        sampler = ctx.sampler
        if sampler.temperature == 0:
            return Proposal(tokens=logits.argmax(-1))
        probs = torch.stack([sampler.probs(row) for row in logits])
        tokens = torch.multinomial(probs, 1, generator=sampler.generator)[:, 0]
        return Proposal(tokens=tokens, probs=probs)

    def _add_context(self, f) -> None:
        """Append the new committed positions' keys / values to every layer's cache."""
        if f is None or not len(f):
            return
        if f.start != self.n:
            raise RuntimeError(f"DFlash drafter: features start at position {f.start}, expected {self.n} (a decoding "
                               "loop skipped some)")
        pos = torch.arange(self.n, self.n + len(f), device=f.aux.device)
        new = self.model.context_kv(self.model.context(f.aux), pos)
        self.kv = new if self.kv is None else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                                               for (k, v), (nk, nv) in zip(self.kv, new)]
        self.n += len(f)


def load(path, target) -> DFlashProposer:
    return DFlashProposer(DFlashHead.from_pretrained(path, target), target)
