"""The T = 0 losslessness check of an eval run: every speculative output against the plain target's, per prompt.

Where the two part, the plain target's top-2 logit margin at the first differing position is recomputed (one
forward over prompt + plain output up to there, with the full fp32 head for a 16-bit target: the decoder's screened
logits take the same argmax, spectrain/targets/logits.py) and
judged by spectrain/eval/divergence.py: identical, near-tie (either token is the target's greedy choice within its
rounding noise), or FAIL. A FAIL is a lossless-decoding bug: the report says so and `spectrain eval` exits 1.
"""

from __future__ import annotations

import torch

from spectrain.eval import divergence


@torch.no_grad()
def top2_margin(target, prompt: list[int], plain: list[int], pos: int) -> tuple[float, float] | None:
    """(top-1 minus top-2 logit, the scale it is judged against) for the token after prompt + plain[:pos]."""
    if pos >= len(plain):  # the plain output ended there: nothing to compare with
        return None
    ids = torch.tensor([prompt + plain[:pos]], device=target.device)
    top = target.forward(ids, logits_mode="fp32").logits[0, -1].float().topk(2).values
    return float(top[0] - top[1]), divergence.logit_scale(float(top[0]), target.dtype)


def judge_cells(target, plan: dict, sets, cells: dict, encoded: dict) -> None:
    """Adds ``greedy_check`` (one divergence record per prompt) to every T = 0 speculative cell."""
    ulps = divergence.NEAR_TIE_ULPS.get(target.dtype, divergence.DEFAULT_ULPS)
    margins: dict = {}  # (set, prompt, position) -> margin: configs often part at the same place
    for d, cfgs in plan.items():
        for cfg in (c for c in cfgs if c.temperature == 0):
            for ps in sets:
                cell, base = cells[(d, cfg.label, ps.name)], cells[("plain", "T=0", ps.name)]
                checks = []
                for i, (spec, plain) in enumerate(zip(cell["outputs"], base["outputs"])):
                    pos = divergence.first_divergence(plain, spec)
                    if pos is not None and (ps.name, i, pos) not in margins:
                        margins[(ps.name, i, pos)] = top2_margin(target, encoded[ps.name][i], plain, pos)
                    margin, scale = margins.get((ps.name, i, pos)) or (None, None)
                    checks.append(divergence.judge_divergence(plain, spec, margin, scale, ulps=ulps))
                cell["greedy_check"] = checks

