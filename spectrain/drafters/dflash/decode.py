"""DFlash decoding: the whole chain from one draft forward.

The context vectors of committed positions arrive as target features after every verify pass (the decoding loops
hand over the features of every committed token but the newest) and are kept: only committed tokens ever enter, so
nothing rolls back. Each layer projects them to keys / values per proposal (a [P, H] matmul per layer). A proposal is one forward over the block
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
        self.ctx = None  # [n, H] context vectors of committed positions 0 .. n - 1

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        f = ctx.features
        if f is not None and len(f):
            if f.start != (0 if self.ctx is None else self.ctx.shape[0]):
                raise RuntimeError(f"DFlash drafter: features start at position {f.start}, expected "
                                   f"{0 if self.ctx is None else self.ctx.shape[0]} (a decoding loop skipped some)")
            new = self.model.context(f.aux)
            self.ctx = new if self.ctx is None else torch.cat([self.ctx, new])
        P = ctx.tokens.shape[0] - 1
        if self.ctx is None or self.ctx.shape[0] != P:
            return Proposal(tokens=ctx.tokens.new_empty(0))  # no context yet (a one-token prompt): draft nothing
        k = min(ctx.k, self.block_size - 1)
        dev = ctx.tokens.device
        block = torch.full((k + 1,), int(self.model.config["mask_token_id"]), device=dev, dtype=ctx.tokens.dtype)
        block[0] = ctx.tokens[-1]
        emb = self.target.embed(block)
        mask = torch.ones(k + 1, P + k + 1, dtype=torch.bool, device=dev)  # the whole context and the whole block
        logits = self.model.block_logits(self.target, emb, torch.arange(P, P + k + 1, device=dev), self.ctx,
                                         torch.arange(P, device=dev), mask)[1:]
        sampler = ctx.sampler
        if sampler.temperature == 0:
            return Proposal(tokens=logits.argmax(-1))
        probs = torch.stack([sampler.probs(row) for row in logits])
        tokens = torch.multinomial(probs, 1, generator=sampler.generator)[:, 0]
        return Proposal(tokens=tokens, probs=probs)


def load(path, target) -> DFlashProposer:
    return DFlashProposer(DFlashHead.from_pretrained(path, target), target)
