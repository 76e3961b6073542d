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


# ---- a vocabulary projection and its loss, in row blocks ---------------------------------------------
# A head's step on CPU is dominated by its [N, V] logits. Built whole, the loss keeps several [N, V] fp32
# tensors alive until backward (logits, both log-softmaxes, their product) and allocates them anew every
# step: at V = 49152 each is hundreds of MB, which glibc maps fresh and the kernel faults in page by page.
# Blocks of rows whose [rows, V] fp32 slice stays under BLOCK_BYTES (below glibc's 32 MiB mmap ceiling)
# are reused from the heap; the loss's gradient w.r.t. the logits is taken per block, inside the forward,
# and only it is kept (one [N, V] tensor in the matmul dtype), so backward is two matmuls.
BLOCK_BYTES = 16 << 20


def block_rows(vocab: int) -> int:
    """Rows per block for a vocabulary of ``vocab`` entries (at least 1)."""
    return max(1, BLOCK_BYTES // (4 * vocab))


class _BlockedHeadLoss(torch.autograd.Function):
    """loss(name, hidden @ weight.T, teacher) over row blocks; also returns each row's top-1 agreement with
    the teacher and its T=1 overlap sum min(p, q) (no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, name, teacher_fn, labels, rows):
        dev = hidden.device.type
        # the dtype autocast would give the projection, so the gradients match autograd's own
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
        h, w = hidden.detach().to(dt), weight.detach().to(dt)
        n = h.shape[0]
        grad = torch.empty(n, w.shape[0], dtype=dt, device=h.device)
        total = torch.zeros((), device=h.device)
        match = torch.zeros(n, dtype=torch.bool, device=h.device)
        ov = torch.zeros(n, device=h.device)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            student = (h[s:e] @ w.T).float().requires_grad_()
            teacher = teacher_fn(s, e)
            with torch.enable_grad():  # the whole loss is a mean over rows: each block adds its share
                part = drafter_loss(name, student, teacher, None if labels is None else labels[s:e]) * ((e - s) / n)
            grad[s:e] = torch.autograd.grad(part, student)[0]
            total += part.detach()
            with torch.no_grad():
                match[s:e] = student.argmax(-1) == teacher.argmax(-1)
                ov[s:e] = overlap(student, teacher)
        ctx.save_for_backward(h, w, grad)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(match, ov)
        return total, match, ov

    @staticmethod
    def backward(ctx, g, _match, _ov):
        h, w, grad = ctx.saved_tensors
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = ((grad @ w).float() * g).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            gw = ((grad.T @ h).float() * g).to(ctx.dtypes[1])
        return gh, gw, None, None, None, None


def head_loss(name: str, hidden: torch.Tensor, weight: torch.Tensor, teacher_fn, labels=None):
    """``drafter.loss`` of the projection ``hidden [N, H] @ weight [V, H].T`` against the teacher, without
    materialising the [N, V] logits: ``teacher_fn(start, end)`` gives the teacher's fp32 logits of rows
    start:end; ``labels`` [N] for ``hard_ce``. Returns (mean loss over the N rows (0 with a graph when N = 0),
    top-1 agreement [N] bool, overlap sum min(p, q) [N]). ``lk`` runs as one block: its lambda is a mean
    over all rows."""
    if name != "hard_ce":
        get_loss(name)  # an unknown name fails here, naming the known ones
    rows = hidden.shape[0] if name == "lk" else block_rows(weight.shape[0])
    return _BlockedHeadLoss.apply(hidden, weight, name, teacher_fn, labels, max(rows, 1))


def sim_tau(acc: list[float]) -> float:
    """1 + sum_i prod_{j<=i} acc_j: the greedy, teacher-forced PROXY of tokens per target pass, from the
    per-position top-1 agreements a drafter family reports as ``acc_i`` (the loop pools them the same way)."""
    out, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        out += prod
    return out

