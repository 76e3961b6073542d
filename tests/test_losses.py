"""Each loss against a value computed by hand on a 2-token vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from spectrain.drafters.losses import LOSSES, drafter_loss, get_loss, hard_ce

# teacher p = [0.25, 0.75], student q = [0.75, 0.25] (given as log-probs = valid logits)
P = [0.25, 0.75]
Q = [0.75, 0.25]
KL_PQ = P[0] * math.log(P[0] / Q[0]) + P[1] * math.log(P[1] / Q[1])
KL_QP = Q[0] * math.log(Q[0] / P[0]) + Q[1] * math.log(Q[1] / P[1])
M = [0.5, 0.5]
JSD = 0.5 * sum(p * math.log(p / m) for p, m in zip(P, M)) + 0.5 * sum(q * math.log(q / m) for q, m in zip(Q, M))
EXPECTED = {
    "fkl": KL_PQ,
    "rkl": KL_QP,
    "jsd": JSD,
    "tvd": 0.5 * (abs(0.25 - 0.75) + abs(0.75 - 0.25)),
    "soft_ce": -(P[0] * math.log(Q[0]) + P[1] * math.log(Q[1])),
    "accept": 1.0 - (min(P[0], Q[0]) + min(P[1], Q[1])),  # overlap alpha = 0.5
    # lambda = exp(-3 * alpha) on KL, 1 - lambda on 1 - alpha
    "lk": math.exp(-1.5) * KL_PQ + (1 - math.exp(-1.5)) * 0.5,
}


def _pair():
    student = torch.tensor([[math.log(Q[0]), math.log(Q[1])]])
    # a constant shift of the teacher logits must not matter
    teacher = torch.tensor([[math.log(P[0]) + 3.0, math.log(P[1]) + 3.0]])
    return student, teacher


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hand_computed(name):
    s, t = _pair()
    assert get_loss(name)(s, t).item() == pytest.approx(EXPECTED[name], rel=1e-5)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_mask_selects_positions_and_zero_at_equality(name):
    s, t = _pair()
    same = t.clone()
    # row 0: mismatch (counted), row 1: student == teacher (masked out), row 2: garbage (masked out)
    student = torch.cat([s, same, torch.tensor([[50.0, -50.0]])])
    teacher = torch.cat([t, same, t])
    mask = torch.tensor([1, 0, 0])
    assert get_loss(name)(student, teacher, mask).item() == pytest.approx(EXPECTED[name], rel=1e-5)
    if name != "soft_ce":  # divergences vanish when q == p
        assert get_loss(name)(same, same).item() == pytest.approx(0.0, abs=1e-6)


def test_fkl_and_soft_ce_differ_by_teacher_entropy():
    torch.manual_seed(0)
    s, t = torch.randn(5, 7), torch.randn(5, 7)
    p = t.softmax(-1)
    entropy = -(p * p.log()).sum(-1).mean()
    assert (get_loss("soft_ce")(s, t) - get_loss("fkl")(s, t)).item() == pytest.approx(entropy.item(), rel=1e-5)


def test_empty_mask_is_zero_not_nan_and_bad_input_errors():
    s, t = _pair()
    assert get_loss("fkl")(s, t, torch.zeros(1)).item() == 0.0
    with pytest.raises(ValueError, match="same"):
        get_loss("fkl")(s, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="choose one of"):
        get_loss("kl")


def test_hard_ce_uses_the_labels_not_the_teacher():
    s, t = _pair()
    labels = torch.tensor([0])
    assert hard_ce(s, labels).item() == pytest.approx(-math.log(Q[0]), rel=1e-5)
    # drafter_loss routes by name: hard_ce ignores the teacher, the divergences ignore the labels
    assert drafter_loss("hard_ce", s, None, labels).item() == pytest.approx(-math.log(Q[0]), rel=1e-5)
    assert drafter_loss("fkl", s, t, None).item() == pytest.approx(EXPECTED["fkl"], rel=1e-5)
    rows = torch.cat([s, s])
    assert hard_ce(rows, torch.tensor([0, 1]), torch.tensor([0, 1])).item() == pytest.approx(-math.log(Q[1]), rel=1e-5)
    with pytest.raises(ValueError, match="hard_ce"):
        get_loss("kl")


@pytest.mark.parametrize("name", ["accept", "lk"])
def test_acceptance_losses_have_gradients_that_raise_the_overlap(name):
    from spectrain.drafters.losses import overlap

    torch.manual_seed(0)
    teacher = torch.randn(6, 9) * 2
    student = torch.randn(6, 9, requires_grad=True)
    before = overlap(student, teacher).mean().item()
    opt = torch.optim.SGD([student], lr=2.0)
    for _ in range(20):
        opt.zero_grad()
        get_loss(name)(student, teacher).backward()
        assert student.grad.abs().sum() > 0
        opt.step()
    assert overlap(student, teacher).mean().item() > before + 0.1


def test_accept_equals_one_minus_overlap_and_tvd():
    torch.manual_seed(1)
    s, t = torch.randn(4, 5), torch.randn(4, 5)
    p, q = t.softmax(-1), s.softmax(-1)
    want = (1 - torch.minimum(p, q).sum(-1)).mean()
    assert get_loss("accept")(s, t).item() == pytest.approx(want.item(), rel=1e-6)
    assert get_loss("tvd")(s, t).item() == pytest.approx(want.item(), rel=1e-5)  # 1 - sum min = TVD


def _projection_case(n=11, h=6, v=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    teacher, labels = torch.randn(n, v, generator=g) * 2, torch.randint(0, v, (n,), generator=g)
    return hidden, weight, teacher, labels


@pytest.mark.parametrize("name", sorted(LOSSES) + ["hard_ce"])
def test_blocked_head_loss_matches_the_whole_logits_in_value_gradient_and_metrics(name, monkeypatch):
    """head_loss never builds [N, V] logits; in 4-row blocks (11 rows: a short last block) it gives the loss,
    the gradients w.r.t. hidden and weight, top-1 agreement and overlap of the plain computation."""
    from spectrain.drafters import losses

    monkeypatch.setattr(losses, "BLOCK_BYTES", 4 * 13 * 4)  # 4 rows of 13 fp32 logits
    hidden, weight, teacher, labels = _projection_case()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h1 @ w1.T
    ref = drafter_loss(name, logits, teacher, labels)
    (2.5 * ref).backward()  # a scaled loss (gradient accumulation) scales both gradients
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    calls = []

    def teacher_fn(s, e):
        calls.append((s, e))
        return teacher[s:e]

    loss, top1, ov = losses.head_loss(name, h2, w2, teacher_fn, labels)
    (2.5 * loss).backward()
    assert calls == ([(0, 11)] if name == "lk" else [(0, 4), (4, 8), (8, 11)])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(top1, logits.argmax(-1) == teacher.argmax(-1))
    torch.testing.assert_close(ov, losses.overlap(logits.detach(), teacher))


def test_blocked_head_loss_under_bf16_autocast_follows_autograd_and_handles_no_rows():
    """Under CPU bf16 autocast the projection runs in bf16 as nn.Linear's would, so the gradients agree with
    autograd's to bf16 precision; with no rows the loss is 0 with a graph (zero gradients), not NaN."""
    from spectrain.drafters.losses import head_loss

    hidden, weight, teacher, _ = _projection_case(n=40, h=16, v=64)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = drafter_loss("fkl", torch.nn.functional.linear(h1, w1), teacher, None)
        loss, _, _ = head_loss("fkl", h2, w2, lambda s, e: teacher[s:e])
    ref.backward()
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=2e-2, atol=2e-3)

    empty = hidden[:0].clone().requires_grad_()
    loss, top1, ov = head_loss("fkl", empty, weight, lambda s, e: teacher[s:e])
    loss.backward()
    assert loss.item() == 0.0 and top1.numel() == 0 and ov.numel() == 0
    assert empty.grad.shape == (0, 16)
    with pytest.raises(ValueError, match="unknown loss 'kl'"):
        head_loss("kl", hidden, weight, lambda s, e: teacher[s:e])
