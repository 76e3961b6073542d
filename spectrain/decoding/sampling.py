"""Logit warping and sampling shared by plain decoding, the drafters and the verifier.

Losslessness needs the target's p and the drafter's q to be warped by the *same* rule
(temperature, top-k, top-p) that plain sampling would use, so there is exactly one warp here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectrain.decoding.validate import TEMPERATURE_RANGE, check_sampling


@dataclass
class Sampler:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    generator: torch.Generator | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)  # also: finite, T in TEMPERATURE_RANGE

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distribution over the last dim (fp32). Greedy gives the one-hot argmax."""
        logits = logits.float()
        if bool(torch.isnan(logits).any() or torch.isposinf(logits).any()):  # -inf = a masked token, fine
            raise ValueError("the model produced NaN or +Inf logits (broken weights or an overflow in its dtype): "
                             "decoding refuses them; check the drafter/target weights or use float32")
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            # drop a token when the mass *before* it already reaches top_p (keeps at least one)
            drop_sorted = (cum - sorted_logits.softmax(-1)) >= self.top_p
            drop = drop_sorted.scatter(-1, idx, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(-1)
        if not bool(torch.isfinite(probs).all()):
            raise ValueError(f"the distribution warped at temperature {self.temperature:g} is not finite: use 0 "
                             f"(greedy) or a temperature in [{TEMPERATURE_RANGE[0]:g}, {TEMPERATURE_RANGE[1]:g}]")
        return probs

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """Draw one token per row of `probs` ([..., V]); argmax when greedy."""
        if self.greedy:
            return probs.argmax(-1)
        flat = probs.reshape(-1, probs.shape[-1])
        out = torch.multinomial(flat, 1, generator=self.generator).squeeze(-1)
        return out.reshape(probs.shape[:-1])
