"""The per-step training metrics every drafter family reports, computed one way: ``acc_i``, ``cond_acc_i``, the
T=1 acceptance ``acc_t1_i`` and the chain PROXIES ``sim_tau`` / ``sim_tau_t1`` (DESIGN.md section 3). Step i asks,
at every anchor position, whether draft position i+1 agrees with the target (teacher-forced): EAGLE-3's TTT step
i, Medusa's head i, the draft model's position t+i."""

from __future__ import annotations

import torch


class StepMetrics:
    """Feed the steps in order (``step``); a chain from an anchor stops at its first disagreement (greedy) or
    multiplies the steps' T=1 acceptances. ``tau`` = 1 + sum_i (anchors whose greedy chain reaches step i) /
    anchors; ``tau_t1`` = 1 + sum_i mean over anchors of prod_{j<=i} acceptance_j; anchors = step 0's."""

    def __init__(self, shape, device):
        self.run = torch.ones(shape, dtype=torch.bool, device=device)  # every earlier step agreed here
        self.run_t1 = torch.ones(shape, device=device)  # prod of the earlier steps' T=1 acceptance
        self.anchors = 1
        self.tau = self.tau_t1 = 1.0

    @torch.no_grad()
    def step(self, i: int, correct: torch.Tensor, mask: torch.Tensor, s_t1: torch.Tensor, sup: torch.Tensor
             ) -> tuple[float, float, float, int]:
        """Step ``i`` at every anchor: ``correct`` agreement (False outside ``mask``), ``mask`` the anchors it is
        scored on, ``s_t1`` its T=1 acceptance sum_x min(p, q) (0 outside ``sup``), ``sup`` the anchors the T=1
        proxy counts. -> (acc_i, cond_acc_i: among anchors whose earlier steps all agreed, acc_t1_i, scored n)."""
        n = int(mask.sum())
        acc = correct.sum().item() / max(n, 1)
        cond = (correct & self.run).sum().item() / max(int((mask & self.run).sum()), 1)
        self.run = self.run & correct
        acc_t1 = float(s_t1[sup].mean()) if sup.any() else 0.0
        self.run_t1 = self.run_t1 * torch.where(sup, s_t1, 0.0)
        if i == 0:
            self.anchors = max(int(sup.sum()), 1)
        self.tau += int(self.run.sum()) / self.anchors
        self.tau_t1 += float(self.run_t1.sum()) / self.anchors
        return acc, cond, acc_t1, n
