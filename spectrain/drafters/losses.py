"""Distillation losses between a student (drafter) and a teacher (the frozen target).

Every loss takes ``(student_logits [..., V], teacher_logits [..., V], mask [...])`` and returns the
mean of the per-position loss over the positions where ``mask`` is true (0 when none is). Both
sides are given as *logits* over the same vocabulary (for EAGLE-3: the draft vocabulary, i.e. the
teacher restricted to it, so its softmax is the renormalised restricted distribution); working in
log-space keeps the KL terms finite where probabilities underflow.

Names follow DistillSpec: ``fkl`` = KL(p_teacher || q_student) (equals ``soft_ce`` up to the
teacher's entropy, which has no gradient), ``rkl`` = KL(q || p), ``jsd`` = Jensen-Shannon with
beta = 0.5, ``tvd`` = total variation 0.5 * sum |p - q|. ``accept`` = 1 - sum_v min(p, q), one minus the
token acceptance probability of speculative sampling at T=1 (equal to ``tvd`` in value and gradient; the
name says what is optimised). ``lk`` = the LK-lambda blend of KL and acceptance (arXiv 2602.23881, as in
ModelOpt's ``masked_lk_lambda_loss`` and speculators' ``lk_hybrid``): lambda * fkl + (1 - lambda) * accept,
lambda = exp(-LK_ETA * alpha) with alpha the masked mean sum min(p, q) of the call, detached: KL dominates
while the overlap is small (where the acceptance loss alone has vanishing gradients), acceptance once it
is large. Each family calls the loss once per TTT step / Medusa head, so lambda is per step / head. ``hard_ce`` is the one loss that does not
look at the teacher: cross-entropy on hard labels, the data's next tokens (Medusa-1 / supervised
fine-tuning; on target-regenerated data it is sequence-level distillation). Every family applies
``drafter.loss`` through ``drafter_loss`` so the name means the same thing for all of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _masked_mean(per_pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return per_pos.mean()
    m = mask.to(per_pos.dtype)
    # clamp: a batch whose mask is all zero contributes 0 (with a graph), not NaN
    return (per_pos * m).sum() / m.sum().clamp_min(1.0)


def _logps(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ; both must be over the same (draft) vocabulary"
        )
    return F.log_softmax(student_logits.float(), -1), F.log_softmax(teacher_logits.float(), -1)


def fkl(student_logits, teacher_logits, mask=None) -> torch.Tensor:
    """Forward KL(p_teacher || q_student) = sum p (log p - log q)."""
    lq, lp = _logps(student_logits, teacher_logits)
    return _masked_mean((lp.exp() * (lp - lq)).sum(-1), mask)


def rkl(student_logits, teacher_logits, mask=None) -> torch.Tensor:
    """Reverse KL(q_student || p_teacher) = sum q (log q - log p) (mode-seeking)."""
    lq, lp = _logps(student_logits, teacher_logits)
    return _masked_mean((lq.exp() * (lq - lp)).sum(-1), mask)


def jsd(student_logits, teacher_logits, mask=None) -> torch.Tensor:
    """Jensen-Shannon divergence 0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2 (bounded by log 2)."""
    lq, lp = _logps(student_logits, teacher_logits)
    lm = torch.logsumexp(torch.stack([lp, lq]), 0) - math.log(2.0)
    per = 0.5 * (lp.exp() * (lp - lm)).sum(-1) + 0.5 * (lq.exp() * (lq - lm)).sum(-1)
    return _masked_mean(per, mask)


def tvd(student_logits, teacher_logits, mask=None) -> torch.Tensor:
    """Total variation distance 0.5 * sum |p - q| (what greedy-free acceptance 1 - TVD depends on)."""
    lq, lp = _logps(student_logits, teacher_logits)
    return _masked_mean(0.5 * (lp.exp() - lq.exp()).abs().sum(-1), mask)


def overlap(student_logits, teacher_logits) -> torch.Tensor:
    """Per position sum_v min(p, q): the probability that speculative sampling at T=1 accepts a token drawn
    from q when the target's distribution is p (shapes [...]; both over the same vocabulary)."""
    lq, lp = _logps(student_logits, teacher_logits)
    return torch.minimum(lp.exp(), lq.exp()).sum(-1)


def accept(student_logits, teacher_logits, mask=None) -> torch.Tensor:
    """1 - sum_v min(p, q): the expected rejection rate at T=1 (== tvd; see the module docstring)."""
    return _masked_mean(1.0 - overlap(student_logits, teacher_logits), mask)


LK_ETA = 3.0  # the LK paper's and ModelOpt's default decay rate (0 would be pure KL)


def lk(student_logits, teacher_logits, mask=None, eta: float = LK_ETA) -> torch.Tensor:
    """LK lambda: lambda * fkl + (1 - lambda) * accept, lambda = exp(-eta * mean alpha), detached."""
    ov = overlap(student_logits, teacher_logits)
    lam = math.exp(-eta * float(_masked_mean(ov.detach(), mask)))
    return lam * fkl(student_logits, teacher_logits, mask) + (1.0 - lam) * _masked_mean(1.0 - ov, mask)


def soft_ce(student_logits, teacher_logits, mask=None) -> torch.Tensor:
    """Soft cross-entropy -sum p log q (the EAGLE / SpecForge loss; same gradient as fkl)."""
    lq, lp = _logps(student_logits, teacher_logits)
    return _masked_mean(-(lp.exp() * lq).sum(-1), mask)


def hard_ce(student_logits, labels, mask=None) -> torch.Tensor:
    """Cross-entropy on hard labels ``labels`` [...] (token ids in the student's vocabulary)."""
    lq = torch.log_softmax(student_logits.float(), -1)
    return _masked_mean(-lq.gather(-1, labels[..., None].long()).squeeze(-1), mask)


# the divergences from the teacher's distribution (hard_ce takes labels instead: see drafter_loss)
LOSSES = {"fkl": fkl, "rkl": rkl, "jsd": jsd, "tvd": tvd, "accept": accept, "lk": lk, "soft_ce": soft_ce}


def drafter_loss(name: str, student_logits, teacher_logits, labels, mask=None) -> torch.Tensor:
    """``drafter.loss`` of a recipe: ``hard_ce`` on ``labels`` (the data's next tokens), else the named
    divergence from the teacher's distribution."""
    if name == "hard_ce":
        return hard_ce(student_logits, labels, mask)
    return get_loss(name)(student_logits, teacher_logits, mask)


def get_loss(name: str):
    """Look a loss up by its recipe name (``drafter.loss``)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}, hard_ce")
    return LOSSES[name]


def sim_tau(acc: list[float]) -> float:
    """1 + sum_i prod_{j<=i} acc_j: the greedy, teacher-forced PROXY of tokens per target pass, from the
    per-position top-1 agreements a drafter family reports as ``acc_i`` (the loop pools them the same way)."""
    out, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        out += prod
    return out

