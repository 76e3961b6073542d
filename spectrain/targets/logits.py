"""A 16-bit target's logits: fp32 where they decide a token, the model's own 16-bit head elsewhere.

Why not fp32 everywhere: bf16 logits of ~20-30 are 0.125 apart, so near-ties become exact ties whose winner
depends on the kernel path (one token per pass vs k + 1, a padded batch vs one row); fp32 logits remove them.
But a full fp32 lm_head reads twice the bytes of the bf16 one (SmolLM2: 113 MB instead of 56 MB per pass) and
was measured at 3x the bf16 head's time for one row, 4x for four rows on a 2-core CPU: a third of a decode step.

``screened`` (the default) gives the **same argmax as the full fp32 head**, at the bf16 head's cost:

1. The final norm runs in fp32 on the upcast pre-norm state (``n32``; H values, free).
2. The model's own 16-bit lm_head runs on ``nb = n32`` rounded to 16 bits: ``lb`` for every token.
3. ``|lb(v) - l32(v)| <= E(v)`` bounds what separates it from the fp32 head's logit (``error_bound``). Every
   token that could be the fp32 argmax, ``lb(v) + E(v) >= max_u (lb(u) - E(u))``, gets its exact fp32 logit
   (a few dot products: the candidates' rows upcast). The rest keep ``lb``, which lies below the exact logit
   of the token attaining that max, so the argmax of the result is the fp32 head's argmax, token for token.

At T > 0 the tokens outside the screened set are sampled with the 16-bit head's logits (as HF ``generate``
samples); plain and speculative decoding use the same function, so acceptance stays exact. The greedy check
(eval/greedy_check.py) recomputes its top-2 margins with the full fp32 head (``mode="fp32"``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

MODES = ("screened", "fp32", "native")

# The 16-bit head's error against the fp32 head, as a multiple of ||W_v|| * ||nb||, beyond the input rounding:
# fp32 accumulation over H = 576 terms is ~3e-5; 2^-8 also covers a kernel that rounds partial sums to bf16.
ACCUMULATION = 2.0 ** -8
# The rounding of the 16-bit output itself, relative to |lb| (half a unit in the last place is 2^-9 for bf16;
# doubled so that it bounds the exact value from the rounded one). fp16 has finer spacing: bf16's is an upper bound.
OUTPUT_ROUNDING = 2.0 ** -8


def check_mode(logits: str) -> str:
    """A target's logits mode, or the one-line refusal (load_target checks it before loading any weights)."""
    if logits not in MODES:
        raise ValueError(f"logits={logits!r}: use one of {', '.join(MODES)} (spectrain/targets/logits.py)")
    return logits


class TargetHead:
    """The final norm + lm_head of a 16-bit target, in ``mode`` (module doc). Built once per target."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        self.norm32 = copy.deepcopy(norm).float()  # H weights: the fp32 norm costs nothing
        self.lm_head = lm_head  # the model's own module, shared (no copy)
        w = lm_head.weight.detach()
        self.row_norms = w.float().norm(dim=-1)  # ||W_v|| per token [V], for the bound
        self._head32: nn.Module | None = None

    def logits(self, last_hidden: torch.Tensor, mode: str = "screened") -> torch.Tensor:
        """fp32 logits [..., V] from the pre-norm last hidden state (model dtype)."""
        if mode not in MODES:
            raise ValueError(f"unknown logits mode {mode!r}; use one of {', '.join(MODES)}")
        w = self.lm_head.weight
        n32 = self.norm32(last_hidden.to(w.device, torch.float32))
        if mode == "fp32":
            return self.full_fp32(n32)
        nb = n32.to(w.dtype)
        lb = self.lm_head(nb).float()
        if mode == "native":
            return lb
        return self.refine(lb, n32, nb)

    def full_fp32(self, n32: torch.Tensor) -> torch.Tensor:
        if self._head32 is None:  # made on first use: only the greedy check and mode="fp32" need it
            self._head32 = copy.deepcopy(self.lm_head).float()
        return self._head32(n32)

    def error_bound(self, lb: torch.Tensor, n32: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
        """E(v) >= |lb(v) - l32(v)|: input rounding ||W_v|| ||nb - n32|| (Cauchy-Schwarz), accumulation, and the
        output's own rounding."""
        nbf = nb.float()
        per_row = (nbf - n32).norm(dim=-1, keepdim=True) + ACCUMULATION * nbf.norm(dim=-1, keepdim=True)
        return self.row_norms.to(lb.device) * per_row + OUTPUT_ROUNDING * lb.abs()

    def refine(self, lb: torch.Tensor, n32: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
        """``lb`` with the exact fp32 logit at every token that could be the fp32 argmax."""
        err = self.error_bound(lb, n32, nb)
        floor = (lb - err).amax(dim=-1, keepdim=True)
        cand = (lb + err >= floor).nonzero(as_tuple=True)  # (*row index, token)
        w = self.lm_head.weight
        rows = w[cand[-1]].float()  # [C, H]: only the candidates' rows are upcast
        exact = (rows * n32[cand[:-1]]).sum(-1)
        bias = getattr(self.lm_head, "bias", None)
        if bias is not None:
            exact = exact + bias.float()[cand[-1]]
        out = lb.clone()
        out[cand] = exact
        return out
