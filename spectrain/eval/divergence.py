"""Is a greedy speculative output lossless? Per prompt: identical, a near-tie of the target, or a FAILURE.

    rec = judge_divergence(plain_tokens, spec_tokens, margin_at=0.0, scale=0.195)
    rec["verdict"]   # "identical" | "near-tie" | "FAIL"

At T = 0 speculative decoding must emit the target's own greedy tokens. Two kernel paths of the same target (one
token per pass vs k + 1, a padded batch vs one row) round differently, so where the target's top-2 logits are
within rounding noise of each other either token is the target's greedy choice and the outputs may part there.
Anything else is a bug. The judgement needs, at the FIRST position where the outputs differ, the plain target's
top-2 logit margin there and the numeric scale it is judged against:

- ``scale`` = the logit spacing of the dtype the target COMPUTES in at that magnitude, ``eps(dtype) * |top-1
  logit|`` (``logit_scale``): bf16 at a logit of 25: 0.195; fp32: 3.0e-6. With fp32 logits from a bf16 target
  (targets/model.py) the rounding upstream is still bf16's, so the target's weight dtype sets the scale.
- near-tie iff ``margin <= ulps * scale``; ``ulps`` = ``NEAR_TIE_ULPS[dtype]``: 4 for bf16/fp16 (measured on the
  reference target: logits of one position computed by t = 1, t = 6 and t = 64 passes differ by up to 1.1 scale
  units with the fp32 head, 2.1 without, so a top-2 margin moves by up to ~4), 64 for fp32 (fp32 kernels differ
  by reduction order, not by one rounding: measured up to 17 units per logit, ~34 on a margin).

The record (plain values only, JSON-ready; an engine evaluator passes margins from its own top-2 probabilities):
``{"identical", "first_divergence", "margin", "scale", "tolerance", "near_tie", "verdict"}`` (docs/evaluation.md).
"""

from __future__ import annotations

import torch

NEAR_TIE_ULPS = {torch.float32: 64.0, torch.bfloat16: 4.0, torch.float16: 4.0}
DEFAULT_ULPS = 4.0


def first_divergence(plain_tokens: list[int], spec_tokens: list[int]) -> int | None:
    """Index of the first differing token; a length mismatch diverges where the shorter one ends."""
    for i, (a, b) in enumerate(zip(plain_tokens, spec_tokens)):
        if a != b:
            return i
    return None if len(plain_tokens) == len(spec_tokens) else min(len(plain_tokens), len(spec_tokens))


def judge_divergence(plain_tokens: list[int], spec_tokens: list[int], margin_at: float | None,
                     scale: float | None, ulps: float = DEFAULT_ULPS) -> dict:
    """The per-prompt record. `margin_at`: the plain target's top-1 minus top-2 logit at the first divergence
    (ignored when identical); `scale`: the logit spacing it is judged against (``logit_scale``); near-tie iff
    margin <= ulps * scale. A divergence with no margin or scale cannot be excused: FAIL."""
    pos = first_divergence(list(plain_tokens), list(spec_tokens))
    if pos is None:
        return {"identical": True, "first_divergence": None, "margin": None, "scale": None, "tolerance": None,
                "near_tie": None, "verdict": "identical"}
    known = margin_at is not None and scale is not None
    tol = ulps * scale if known else None
    near = bool(known and margin_at <= tol)
    return {"identical": False, "first_divergence": pos, "margin": _num(margin_at), "scale": _num(scale),
            "tolerance": _num(tol), "near_tie": near, "verdict": "near-tie" if near else "FAIL"}


def logit_scale(top1_logit: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` at the top-1 logit's magnitude (eps * |x|)."""
    return float(torch.finfo(dtype).eps) * abs(float(top1_logit))


def summarize(records: list[dict]) -> dict:
    """Counts over prompts: {"identical", "near_tie", "fail", "n"}."""
    count = {v: sum(r["verdict"] == v for r in records) for v in ("identical", "near-tie", "FAIL")}
    return {"identical": count["identical"], "near_tie": count["near-tie"], "fail": count["FAIL"], "n": len(records)}


def _num(x) -> float | None:
    return None if x is None else float(x)
