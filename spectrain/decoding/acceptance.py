"""The exact accept/reject rules of speculative decoding, applied to one verification pass's logits.

Acceptance (docs/decoding.md, Losslessness):
- greedy: a node is accepted iff it equals the target argmax; the emitted sequence equals
  ``model.generate(do_sample=False)``;
- sampling: candidate x ~ q is accepted w.p. min(1, p(x)/q(x)); after a rejection p becomes
  norm(max(0, p - q)); when no candidate of a node survives, the next token is drawn from the current
  p (the residual, or the plain target distribution after a fully accepted path: the bonus token).
  For trees the children of a node are tested in order (multi-candidate recursive rejection); see
  ``Proposal`` in spectrain/decoding/interface.py for what ``probs`` must mean for this to be exact.

``accept_chain`` / ``accept_tree`` return (accepted node indices root to leaf, emitted tokens =
accepted ones + the target's next token, per-depth outcomes for the acceptance statistics).
"""

from __future__ import annotations

import torch

from spectrain.decoding.interface import Proposal
from spectrain.decoding.sampling import Sampler

# Test-only switch: resample from p instead of the residual after a rejection (NOT lossless). The
# statistical tests flip it to prove that they can detect a broken verifier.
_RESIDUAL_FROM_P = False


def accept_chain(logits: torch.Tensor, proposal: Proposal | None, sampler: Sampler):
    n = len(proposal) if proposal is not None else 0
    if sampler.greedy:
        best = logits.argmax(-1)
        if n == 0:
            return [], [int(best[0])], []
        ok = (proposal.tokens.to(best.device) == best[:n]).int()
        n_acc = int(ok.cumprod(0).sum())
        toks = proposal.tokens[:n_acc].tolist() + [int(best[n_acc])]
        outcomes = [True] * n_acc + ([False] if n_acc < n else [])
        return list(range(n_acc)), toks, outcomes
    p = sampler.probs(logits)
    if n == 0:
        return [], [int(sampler.sample(p[0]))], []
    x = proposal.tokens.to(p.device)
    px = p[:n].gather(1, x[:, None])[:, 0]
    q = proposal.probs.to(p.device).float() if proposal.probs is not None else None
    qx = q.gather(1, x[:, None])[:, 0] if q is not None else torch.ones_like(px)
    # Independent uniforms for every position: a decision only matters if all earlier were accepted.
    u = torch.rand(n, device=p.device, generator=sampler.generator)
    ok = (u * qx < px).int()
    n_acc = int(ok.cumprod(0).sum())
    toks = x[:n_acc].tolist()
    if n_acc == n:
        toks.append(int(sampler.sample(p[n])))
        return list(range(n)), toks, [True] * n
    q_rej = q[n_acc] if q is not None else torch.nn.functional.one_hot(x[n_acc], p.shape[-1]).float()
    toks.append(_sample_residual(p[n_acc], q_rej, sampler))
    return list(range(n_acc)), toks, [True] * n_acc + [False]


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if _RESIDUAL_FROM_P:
        return p
    r = (p - q).clamp_min(0)
    s = r.sum()
    # s == 0 only when p == q up to rounding; then a rejection had ~zero probability and p is the answer.
    return r / s if float(s) > 1e-12 else p


def _sample_residual(p: torch.Tensor, q: torch.Tensor, sampler: Sampler) -> int:
    return int(torch.multinomial(_residual(p, q), 1, generator=sampler.generator))


def accept_tree(logits: torch.Tensor, proposal: Proposal, sampler: Sampler):
    parents = proposal.parents.tolist()
    toks = proposal.tokens.tolist()
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        children.setdefault(par, []).append(i)
    greedy = sampler.greedy
    p_all = None if greedy else sampler.probs(logits)
    path: list[int] = []
    outcomes: list[bool] = []
    node = -1  # -1 = the root (last committed token), logits row 0
    while True:
        kids = children.get(node, [])
        row = node + 1
        if greedy:
            best = int(logits[row].argmax())
            nxt = next((c for c in kids if toks[c] == best), None)
            if kids:
                outcomes.append(nxt is not None)
            if nxt is None:
                return path, [toks[i] for i in path] + [best], outcomes
        else:
            nxt, p = _recursive_rejection(p_all[row], kids, toks, proposal, sampler)
            if kids:
                outcomes.append(nxt is not None)
            if nxt is None:
                return path, [toks[i] for i in path] + [int(torch.multinomial(p, 1, generator=sampler.generator))], \
                    outcomes
        path.append(nxt)
        node = nxt


def _recursive_rejection(p: torch.Tensor, kids: list[int], toks: list[int], proposal: Proposal,
                         sampler: Sampler) -> tuple[int | None, torch.Tensor]:
    """Test the children in order; return the accepted one, or None and the final residual p."""
    V = p.shape[-1]
    removed: list[int] = []
    for c in kids:
        x = toks[c]
        if proposal.probs is None:  # deterministic candidate: q = one-hot(x)
            q = torch.nn.functional.one_hot(torch.tensor(x, device=p.device), V).float()
        else:
            q = proposal.probs[c].to(p.device).float()
            if proposal.without_replacement and removed:
                q = q.clone()
                q[removed] = 0.0
                q = q / q.sum() if float(q.sum()) > 0 else q
        u = float(torch.rand((), device=p.device, generator=sampler.generator))
        if u * float(q[x]) < float(p[x]):
            return c, p
        p = _residual(p, q)
        removed.append(x)
    return None, p
