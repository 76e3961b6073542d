"""Draft-path rollouts for EAGLE-3 training (``drafter.eagle3.rollout``): TTT along the head's own drafts.

Plain TTT feeds step i > 0 of anchor t the *data* token x_{t+1+i} and trains it against the target's
distribution on the data prefix. Decoding feeds the head its *own* draft d_{i-1} instead; the two agree
until the first step where the draft leaves the target's path, and after it (a sampled draft accepted at
T > 0, a tree branch) the head runs on prefixes TTT never shows it. On a rollout step, for ``anchors``
supervised anchors per row (chosen with the step's seeded generator):

1. the TTT unroll feeds those anchors the head's own draft of the previous step (argmax over the draft
   vocab, or sampled at ``temperature``), the other anchors the data token as usual;
2. one extra target pass verifies every drafted prefix at once, as a tree attention mask does in decoding:
   the row followed by the nodes (t, j) = d_j(t), node (t, j) seeing the row up to x_{t+1} and nodes
   (t, 0..j), at position t+2+j;
3. step i of a rolled-out anchor is trained against the target's distribution at node (t, i-1) (its
   argmax must lie in the draft vocab, like every TTT target), with the usual position mask.

Cost per rollout step: one target forward over T + anchors * (ttt_steps - 1) tokens per row (the row is
recomputed rather than cached) on top of the step's feature pass; the head's unroll costs what TTT costs.
Metrics: ``rollout_div_step`` = mean first step whose draft differs from the target's greedy choice on
the drafted prefix (ttt_steps when none does); ``rollout_off_path`` = share of rolled-out step-positions
whose prefix has already left the target's greedy path (states plain TTT on greedy data never trains).
"""

from __future__ import annotations

import torch

from spectrain.decoding.masks import as_attn_mask, sliding_window


def pick_anchors(sup0: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """[B, A] anchor positions (-1 = none) drawn without replacement among each row's supervised step-0
    anchors (sup0 [B, T] bool), at most n per row."""
    rows = []
    for b in range(sup0.shape[0]):
        cand = sup0[b].nonzero().squeeze(-1).cpu()
        pick = cand[torch.randperm(len(cand), generator=gen)[:n]].sort().values
        rows.append(pick)
    a = max(1, max(len(r) for r in rows))
    out = torch.full((sup0.shape[0], a), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out.to(sup0.device)


def draft_tokens(logits: torch.Tensor, d2t: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """Target ids of the head's drafts from draft-vocab logits [..., D]: argmax, or sampled at temperature."""
    if temperature == 0:
        idx = logits.argmax(-1)
    else:
        probs = (logits.float().detach() / temperature).softmax(-1).cpu()
        idx = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=gen).reshape(probs.shape[:-1])
        idx = idx.to(logits.device)
    return idx + d2t[idx]


@torch.no_grad()
def verify_nodes(target, ids: torch.Tensor, am: torch.Tensor, anchors: torch.Tensor,
                 nodes: torch.Tensor) -> torch.Tensor:
    """The target's pre-norm last hidden state at every drafted node: ids/am [B, T], anchors [B, A] (-1 = none),
    nodes [B, A, J] target ids (node j of anchor t follows x_{t+1}, d_0..d_{j-1}) -> [B, A, J, H]."""
    b, t = ids.shape
    a, j = nodes.shape[1], nodes.shape[2]
    n = a * j
    dev = ids.device
    window = sliding_window(target.config)
    if window is not None and t + 2 + j > window:
        raise ValueError("drafter.eagle3.rollout does not support a sliding-window target yet (one tree mask "
                         "serves all layers); set drafter.eagle3.rollout.fraction=0")
    valid = anchors >= 0
    anc = anchors.clamp_min(0)
    idx = torch.arange(t, device=dev)
    row_mask = (idx[None, :] <= idx[:, None])[None] & (am.bool()[:, None, :] | torch.eye(t, dtype=torch.bool,
                                                                                        device=dev))
    # node (a, j) -> data keys s <= t_a + 1 (attended), and nodes (a, 0..j) of its own chain
    node_data = (idx[None, None, :] <= (anc + 1)[:, :, None]) & am.bool()[:, None, :]  # [B, A, T]
    node_data = node_data[:, :, None, :].expand(b, a, j, t).reshape(b, n, t)
    chain = torch.eye(a, dtype=torch.bool, device=dev)[:, None, :, None] & \
        (torch.arange(j, device=dev)[None, :] <= torch.arange(j, device=dev)[:, None])[None, :, None, :]
    node_nodes = chain.reshape(n, n)[None].expand(b, n, n) & valid.repeat_interleave(j, 1)[:, None, :]
    node_nodes = node_nodes | torch.eye(n, dtype=torch.bool, device=dev)[None]  # an unused node sees itself
    top = torch.cat([row_mask, torch.zeros(b, t, n, dtype=torch.bool, device=dev)], 2)
    bottom = torch.cat([node_data & valid.repeat_interleave(j, 1)[:, :, None], node_nodes], 2)
    mask = torch.cat([top, bottom], 1)[:, None]
    pos_row = (am.long().cumsum(1) - 1).clamp_min(0)
    pos_nodes = (anc[:, :, None] + 2 + torch.arange(j, device=dev)[None, None, :]).reshape(b, n)
    seq = torch.cat([ids, nodes.reshape(b, n)], 1)
    out = target.forward(seq, as_attn_mask(target, mask), torch.cat([pos_row, pos_nodes], 1),
                         want_last_hidden=True, want_logits=False)
    return out.last_hidden[:, t:].reshape(b, a, j, -1)


def first_divergence(drafts: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """[..., K] drafted ids vs the target's greedy ids on the same prefixes -> index of the first
    mismatch (K when they agree throughout)."""
    miss = drafts != greedy
    k = drafts.shape[-1]
    first = torch.where(miss, torch.arange(k, device=drafts.device), k)
    return first.min(-1).values


class Rollout:
    """One rollout step's state inside ``Eagle3Head.train_loss``: ``feed`` for the unroll, ``verify`` for
    the target pass, ``substitute`` for each step's teacher (see the module docstring)."""

    def __init__(self, head, sup0: torch.Tensor, cfg, seed: int):
        self.head, self.temperature = head, cfg.temperature
        self.gen = torch.Generator().manual_seed(int(seed))
        self.anchors = pick_anchors(sup0, cfg.anchors, self.gen)  # [B, A]
        self.valid = self.anchors >= 0
        self.rb, self.ra = self.valid.nonzero(as_tuple=True)
        self.rt = self.anchors[self.rb, self.ra]
        self.drafts: list[torch.Tensor] = []  # d_{i-1} at the anchors [B, A], for steps i = 1 ..

    def feed(self, i: int, prev_logits: torch.Tensor, data_tok: torch.Tensor) -> torch.Tensor:
        """Step i's input tokens [B, T]: the data's, except the head's own previous draft at the anchors."""
        at = prev_logits[torch.arange(len(self.anchors), device=prev_logits.device)[:, None],
                         self.anchors.clamp_min(0)]  # [B, A, D]
        d = draft_tokens(at.detach(), self.head.d2t, self.temperature, self.gen)
        self.drafts.append(d)
        tok = data_tok.clone()
        tok[self.rb, self.rt] = d[self.rb, self.ra]
        return tok

    def verify(self, target, ids: torch.Tensor, am: torch.Tensor, greedy0: torch.Tensor) -> dict[str, float]:
        """The target pass over every drafted prefix; greedy0 [B, T] = the target's argmax on the data row."""
        nodes = torch.stack(self.drafts, -1)  # [B, A, J]
        logits = target.logits_from_last_hidden(verify_nodes(target, ids, am, self.anchors, nodes))
        self.teacher = logits[..., self.head.draft_ids].float()  # restricted, like every TTT teacher
        self.log_z = torch.logsumexp(logits.float(), -1)
        greedy = logits.argmax(-1)
        self.in_vocab = self.head.t2d[greedy]
        # the target's greedy choice on each drafted prefix: at x_{t+1} for d_0, at node j-1 for d_j
        path = torch.cat([greedy0.gather(1, self.anchors.clamp_min(0))[..., None], greedy[..., :-1]], -1)
        div = first_divergence(nodes, path)[self.valid].float()
        steps = torch.arange(1, nodes.shape[-1] + 1, device=div.device)
        n = max(int(self.valid.sum()), 1)
        return {"rollout_div_step": float(div.sum()) / n,
                "rollout_off_path": float((div[:, None] < steps[None]).float().sum()) / (n * len(steps))}

    def substitute(self, i: int, tch: torch.Tensor, log_z: torch.Tensor, in_vocab: torch.Tensor):
        """Step i's teacher logits / normaliser / in-vocab mask with the rolled-out anchors' replaced."""
        rb, ra, rt = self.rb, self.ra, self.rt
        tch, log_z, in_vocab = tch.clone(), log_z.clone(), in_vocab.clone()
        tch[rb, rt] = self.teacher[rb, ra, i - 1].to(tch.dtype)
        log_z[rb, rt] = self.log_z[rb, ra, i - 1]
        in_vocab[rb, rt] = self.in_vocab[rb, ra, i - 1]
        return tch, log_z, in_vocab
