"""Medusa heads: model, self-distillation / hard-label training, the decoding adapter, and the rest of the
family's record hooks (training cost, serving engines and commands), at the end of the module.

Alignment (x = tokens, h_t = the target's final *normed* hidden state at position t, p_t = the
target's distribution at t = softmax(lm_head(h_t)), which predicts x_{t+1}):

- head i (0-based) applied to h_t predicts x_{t+2+i}: one past what the target's own lm_head
  predicts from the same row, so head 0 drafts the token after the next one;
- KL-family losses train head i at anchor t against p_{t+1+i} (the target's distribution for
  x_{t+2+i}, computed with the true prefix); ``hard_ce`` is Medusa-1: cross-entropy on the data
  token x_{t+2+i};
- mask: x_{t+2+i} is an attended assistant token (data/chat.py: loss_mask[j] = 1 means position j-1 is
  trained to predict x_j) and the anchor t itself is attended.

In decoding the drafter holds h_{L-2} (features lag the tokens by one, see spectrain/decoding/interface.py) and the bonus
token x_{L-1} is known, so head i applied to h_{L-2} drafts the token at position L + i.

Parameter names follow vLLM's Medusa layout (``blocks.{i}.layers.{j}.weight/bias``,
``lm_heads.{i}.weight``), so the weights export without renaming.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from spectrain.decoding.interface import DraftContext, Drafter, Proposal
from spectrain.drafters.costs import Shape, TrainingCost
from spectrain.drafters.head_io import WEIGHTS_NAME, check_state, read_head_config, save_head
from spectrain.drafters.losses import head_loss, sim_tau
from spectrain.drafters.step_metrics import StepMetrics
from spectrain.recipe.deploy import Decode, ServeCommand, static_tree_note, trtllm_command, vllm_command
from spectrain.registry import FeatureSpec
from spectrain.targets.fingerprint import target_fingerprint


class ResidualStack(nn.Module):
    """n distinct ResBlocks x <- x + SiLU(W x + b). W and b start at zero, so the stack starts as the
    identity and a fresh head reproduces the target's own lm_head (a sensible, not random, start)."""

    def __init__(self, hidden: int, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=True) for _ in range(n))
        for lin in self.layers:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = x + F.silu(lin(x))
        return x


class MedusaHeads(nn.Module):
    kind = "medusa"

    def __init__(self, cfg: dict, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = dict(cfg)
        h, v, n = cfg["target_hidden_size"], cfg["target_vocab_size"], cfg["num_heads"]
        if n < 1:
            raise ValueError(f"Medusa needs num_heads >= 1, got {n}")
        self.blocks = nn.ModuleList(ResidualStack(h, cfg["num_resblocks"]) for _ in range(n))
        self.lm_heads = nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(n))
        if lm_head_weight is not None:
            with torch.no_grad():
                for head in self.lm_heads:
                    head.weight.copy_(lm_head_weight.detach().float())

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_recipe(cls, recipe, target, token_counts: torch.Tensor | None = None) -> MedusaHeads:
        m = recipe.drafter.medusa
        cfg = {"kind": "medusa", "target": target.name_or_path, "target_hidden_size": target.hidden_size,
               "target_vocab_size": target.vocab_size, "num_heads": m.num_heads,
               "num_resblocks": m.num_resblocks, "loss": recipe.drafter.loss,
               # same shapes do not mean same weights: record which target the heads were trained on
               "target_fingerprint": target_fingerprint(target)}
        return cls(cfg, target.lm_head.weight).to(target.device)

    def feature_spec(self) -> FeatureSpec:
        # The normed last hidden state is all Medusa reads; the teacher logits are lm_head(it).
        return FeatureSpec(final_hidden=True)

    # ---- forward -----------------------------------------------------------------------------
    def head_hidden(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head i's ResBlocks on target final hidden rows [..., H] (in the drafter weights' dtype)."""
        return self.blocks[i](hidden.to(self.lm_heads[i].weight.dtype))

    def head_logits(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head i on target final hidden rows [..., H] -> logits [..., V] (fp32 drafter weights)."""
        return self.lm_heads[i](self.head_hidden(i, hidden))

    def forward(self, hidden: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """The first n heads (default all) on [..., H] -> [n, ..., V]."""
        return torch.stack([self.head_logits(i, hidden) for i in range(n or self.num_heads)])

    # ---- training ----------------------------------------------------------------------------
    def train_loss(self, batch: dict, feats: dict, target) -> tuple[torch.Tensor, dict[str, float]]:
        """Sum over heads of the per-head loss (heads share no parameters, so with Adam a per-head
        weight would barely matter). Heads run only on the rows they are trained on."""
        ids, am = batch["input_ids"], batch["attention_mask"].bool()
        lm = batch["loss_mask"].bool() & am
        fh = feats["final_hidden"]
        name = self.config.get("loss", "fkl")
        b, t = ids.shape
        total = torch.zeros((), device=ids.device)
        metrics: dict[str, float] = {}
        chain = StepMetrics(am.shape, ids.device)  # head i = draft step i
        for i in range(self.num_heads):
            n_anchor = max(t - 2 - i, 0)
            mask = lm[:, 2 + i:] & am[:, :n_anchor]  # [B, T-2-i] over anchors t
            rb, rt = mask.nonzero(as_tuple=True)
            hidden = self.head_hidden(i, fh[rb, rt])
            teacher_hidden = fh[rb, rt + 1 + i].to(target.dtype)

            def teacher(s, e, th=teacher_hidden):  # the teacher's logits, one row block at a time
                with torch.no_grad():
                    return target.lm_head(th[s:e]).float()

            # hard_ce: Medusa-1's data labels; the [N, V] logits are never built whole (losses.head_loss)
            li, top1, s_t1_rows = head_loss(name, hidden, self.lm_heads[i].weight, teacher, ids[rb, rt + 2 + i])
            total = total + li
            with torch.no_grad():
                correct = torch.zeros_like(am)
                correct[rb, rt] = top1
                sup = torch.zeros_like(am)
                sup[:, :n_anchor] = mask
                # T=1 acceptance proxy of head i: sum_v min(p, q) over the full vocabulary
                s_t1 = torch.zeros(am.shape, device=ids.device)
                s_t1[rb, rt] = s_t1_rows
                acc, metrics[f"cond_acc_{i}"], metrics[f"acc_t1_{i}"], n = chain.step(i, correct, sup, s_t1, sup)
            metrics[f"loss_{i}"], metrics[f"acc_{i}"] = float(li.detach()), acc
            if i == 0:
                metrics["tokens"] = float(n)
        metrics["loss"] = float(total.detach())
        # PROXY, not a measured tau: teacher-forced greedy top-1 agreement, 1 + sum_i prod_{j<=i} acc_j
        metrics["sim_tau"] = sim_tau([metrics[f"acc_{i}"] for i in range(self.num_heads)])
        metrics["sim_tau_t1"] = chain.tau_t1  # PROXY at T=1: 1 + sum_i mean over anchors of prod_{j<=i} acc_t1_j
        return total, metrics

    # ---- persistence -------------------------------------------------------------------------
    def save_pretrained(self, path, state_dict: dict | None = None) -> None:
        """``state_dict``: full weights gathered by the loop when ZeRO-3 / FSDP shard this module."""
        save_head(path, self.config, state_dict or self.state_dict())

    @classmethod
    def from_pretrained(cls, path, target) -> MedusaHeads:
        model = cls(read_head_config(path, "medusa", target, "Medusa heads"))
        state = load_file(str(Path(path) / WEIGHTS_NAME))
        check_state(state, model, f"Medusa heads at {path}")
        model.load_state_dict(state, strict=True)
        return model.to(target.device)


# ---- decoding adapter ------------------------------------------------------------------------
class MedusaProposer(Drafter):
    """Decoding-side Medusa. Heads do not look at drafted tokens, so all state is the newest target
    hidden row; drafts are deterministic (top-1 chain, top-m tree), which keeps greedy and sampled
    verification exact (``Proposal.probs=None``: q is one-hot)."""

    name = "medusa"
    supports_tree = True

    def __init__(self, model: MedusaHeads, target):
        self.model = model.eval()
        self.target = target
        self.begin(None)

    def features(self) -> FeatureSpec:
        return self.model.feature_spec()  # the heads' own spec: the normed final hidden state

    def begin(self, prompt: torch.Tensor | None) -> None:
        self.last = None  # final hidden row of the newest position received
        self.n = 0  # positions received so far

    def commit(self, accepted: list[int]) -> None:
        pass  # the accepted tokens' true hidden rows arrive with the next propose()

    def _ingest(self, ctx: DraftContext) -> None:
        f, total = ctx.features, int(ctx.tokens.numel())
        if f is not None and len(f):
            if f.final_hidden is None:
                raise ValueError("Medusa needs ctx.features.final_hidden (the target's normed last hidden "
                                 "state); the decoder must honour the drafter's features() (final_hidden)")
            if f.start > self.n:
                raise ValueError(f"Medusa drafter got features from position {f.start} but has only {self.n}: "
                                 "features for committed positions were skipped")
            self.last = f.final_hidden[-1]
            self.n = f.start + len(f)
        if self.n != total - 1 or self.last is None:
            raise ValueError(f"Medusa drafter has features for {self.n} positions but {total} tokens are committed; "
                             f"features must lag the tokens by exactly one (spectrain/decoding/interface.py contract)")

    def _check_depth(self, k: int) -> None:
        if k > self.model.num_heads:
            raise ValueError(f"this Medusa drafter has {self.model.num_heads} heads, so it drafts at most "
                             f"{self.model.num_heads} tokens per step; got k (or tree depth) {k}: use k <= "
                             f"{self.model.num_heads} or train more heads (drafter.medusa.num_heads)")

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        self._check_depth(ctx.k)
        if ctx.tokens.numel() < 2:  # a 1-token prompt: no target hidden state to draft from yet
            return Proposal(tokens=ctx.tokens.new_zeros(0))
        self._ingest(ctx)
        return self._from_logits(ctx, self.model(self.last, ctx.k).float())

    @torch.no_grad()
    def propose_batch(self, ctxs: list[DraftContext | None]) -> list[Proposal | None]:
        """Batched decoding: every row's heads in one forward (per-row state: the Drafter default copies)."""
        out: list[Proposal | None] = [None if c is None else Proposal(tokens=c.tokens.new_zeros(0)) for c in ctxs]
        live = [b for b, c in enumerate(ctxs) if c is not None and c.tokens.numel() >= 2]
        for b in live:
            self._check_depth(ctxs[b].k)
            self._rows[b]._ingest(ctxs[b])
        if live:
            kmax = max(ctxs[b].k for b in live)
            logits = self.model(torch.stack([self._rows[b].last for b in live]), kmax).float()  # [kmax, R, V]
            for r, b in enumerate(live):
                out[b] = self._from_logits(ctxs[b], logits[: ctxs[b].k, r])
        return out

    def _from_logits(self, ctx: DraftContext, logits: torch.Tensor) -> Proposal:
        """logits [k, V]: head i's logits for draft position i+1."""
        if ctx.tree is None:
            return Proposal(tokens=logits.argmax(-1).long().to(ctx.tokens.device))
        topk = int(ctx.tree.get("topk", 4))
        total = int(ctx.tree.get("total_tokens", 32))
        if topk < 1 or total < 1:
            raise ValueError(f"tree options need topk >= 1 and total_tokens >= 1, got {ctx.tree}")
        top = logits.log_softmax(-1).topk(min(topk, logits.shape[-1]), dim=-1)
        paths, parents = best_tree(top.values.tolist(), total)
        ids = [int(top.indices[len(path) - 1, path[-1]]) for path in paths]  # depth d reads head d-1
        dev = ctx.tokens.device
        return Proposal(tokens=torch.tensor(ids, dtype=torch.long, device=dev),
                        parents=torch.tensor(parents, dtype=torch.long, device=dev))


def best_tree(logq: list[list[float]], total: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """The `total` root paths with the highest summed log-prob, where depth d offers the candidates
    logq[d-1] (sorted descending) independently of the path. Returns (paths as rank tuples, parents)
    ordered by depth then lexicographically: parents first, siblings likeliest first.

    Best-first enumeration: a popped node pushes its next sibling and its first child, so each node is
    pushed once, scores pop in non-increasing order (log-probs are <= 0 and siblings are sorted), and a
    node is only reachable after its parent and earlier siblings: the chosen set is a tree."""
    depth = len(logq)
    if depth == 0 or not logq[0]:
        return [], []
    def push(path: tuple[int, ...]) -> None:
        # summed root to leaf, the same order for every path: an extension never rounds above its prefix
        score = 0.0
        for d, r in enumerate(path):
            score += logq[d][r]
        heapq.heappush(heap, (-score, path))

    heap: list[tuple[float, tuple[int, ...]]] = []
    push((0,))
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < total:
        _, path = heapq.heappop(heap)
        chosen.append(path)
        d, r = len(path), path[-1]
        if r + 1 < len(logq[d - 1]):
            push(path[:-1] + (r + 1,))
        if d < depth:
            push(path + (0,))
    chosen.sort(key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(chosen)}
    return chosen, [index[p[:-1]] if len(p) > 1 else -1 for p in chosen]


def load(path, target) -> MedusaProposer:
    """Registry entry (spectrain/registry.py): decoding-ready Medusa heads."""
    return MedusaProposer(MedusaHeads.from_pretrained(path, target), target)


# ---- the family record's other hooks (spectrain/registry.py) ---------------------------------------------


def training_cost(recipe, t: Shape, student: Shape | None = None, seq: float = 0.0) -> TrainingCost:
    """K heads of ResBlocks + a full-vocab Linear each (the record's ``train.cost`` hook)."""
    m = recipe.drafter.medusa
    p = m.num_heads * (m.num_resblocks * (t.hidden ** 2 + t.hidden) + t.vocab * t.hidden)
    return TrainingCost(p, p, 6 * p, 4 * t.vocab * (1 + 2 * m.num_heads), m.num_heads * t.hidden * 8, 0)


NO_MEDUSA = {"vllm": "vLLM 0.33.0 has no Medusa support at all (read from its source)",
             "sglang": "SGLang has no Medusa algorithm (its SpeculativeAlgorithm lists EAGLE, EAGLE3, STANDALONE, NGRAM ...)"}


def engine_problems(engine: str, flags: dict[str, bool], sliding: bool = False, num_layers: int = 1,
                    aux: list[int] | None = None) -> list[str]:
    """The ``serve.engine_problems`` hook: only TensorRT-LLM computes Medusa heads."""
    return [f"{NO_MEDUSA[engine]}: serve Medusa heads with TensorRT-LLM or train an EAGLE-3 head"] \
        if engine in NO_MEDUSA else []


def serve_command(engine: str, target: str, model_dir: str, d: Decode, head: dict) -> ServeCommand:
    """The ``serve.command`` hook: vLLM's Medusa path (older releases) or TensorRT-LLM with a chain of choices."""
    num_heads = int(head.get("num_heads", d.k))
    if engine == "vllm":
        cmd = vllm_command("medusa", target, model_dir, d.k)
        cmd.notes.append(f"{NO_MEDUSA['vllm']}: this command is for the vLLM releases that loaded Medusa (V1 engine "
                         "from PR #17956, May 2025; see spectrain's docs/export.md); on vLLM 0.33 serve an EAGLE-3 "
                         "head instead")
    else:
        chain = [[0] * i for i in range(1, d.k + 1)]  # path i = the top-1 token of heads 1..i
        cmd = trtllm_command("tensorrt", target, {"decoding_type": "Medusa", "max_draft_len": d.k,
                                                  "speculative_model": model_dir, "num_medusa_heads": num_heads,
                                                  "medusa_choices": chain})
    if d.tree:
        cmd.notes.append(static_tree_note(engine, d, "a static medusa_choices tree cannot reproduce" if
                                          engine == "trtllm" else "this Medusa path does not implement"))
    return cmd


def serve_k(head: dict, k: int | None) -> int:
    """The ``serve.k`` hook: --k (at most one per head), else every head."""
    if k is None:
        return int(head.get("num_heads", 3))
    if k > int(head.get("num_heads", k)):
        raise ValueError(f"--k {k} exceeds this Medusa export's {head['num_heads']} heads: use --k <= {head['num_heads']}")
    return k
