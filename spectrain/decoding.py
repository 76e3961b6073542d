"""Lossless speculative decoding: chain and tree drafts, greedy and sampling, target KV-cache reuse.

One verification pass per step. Invariant: the target cache holds ``tokens[:-1]`` (every committed
token except the newest). A step feeds ``[tokens[-1]] + drafted nodes`` at positions
``P + depth`` (P = len(tokens) - 1; a chain has depth 1..n), so logits row 0 is the target's
distribution for the first drafted position and the row of node i is the distribution after it.
After acceptance the cache keeps the root plus the accepted path (a crop for chains, a gather for
trees), which restores the invariant. The prefill feeds ``prompt[:-1]`` and emits nothing, so every
counted target pass emits >= 1 token and plain decoding has tau = 1 exactly.

Acceptance rules (greedy, and exact sampling with residuals): spectrain/acceptance.py.

Batches: ``input_ids`` may be 1-D (one prompt -> ``SpecOutput``) or 2-D / a list of lists (-> a list of
``SpecOutput``, one per row, with one shared random generator; padding is removed with
``attention_mask`` when given). By default rows are decoded one after another; ``batch_size=B``
decodes B rows at once with one target pass per step for all of them (spectrain/batched.py), each
row's output exactly what batch size 1 gives. Aggregate with ``DecodeStats.merge``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from spectrain.acceptance import accept_chain, accept_tree
from spectrain.drafters.base import DraftContext, Drafter, Proposal, TargetFeatures
from spectrain.masks import tree_mask
from spectrain.sampling import Sampler
from spectrain.validate import check_generate_args, positive_int


@dataclass
class DecodeStats:
    """Counters of one or more decoded sequences. Conventions: DESIGN.md section 3."""

    k: int = 0
    attempts: list[int] = field(default_factory=list)  # [i-1]: times draft position i was verified
    accepts: list[int] = field(default_factory=list)  # [i-1]: times it was accepted
    drafted: int = 0  # drafted tokens (tree: nodes), verified or not
    target_passes: int = 0  # verification passes (each emits >= 1 token); the prefill is not one
    emitted: int = 0
    prefill_tokens: int = 0
    sequences: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0

    def _grow(self, n: int) -> None:
        while len(self.attempts) < n:
            self.attempts.append(0)
            self.accepts.append(0)

    def record(self, outcomes: list[bool]) -> None:
        """outcomes[i]: whether draft position i+1 was accepted, for the positions that were verified."""
        self._grow(len(outcomes))
        for i, ok in enumerate(outcomes):
            self.attempts[i] += 1
            self.accepts[i] += int(ok)

    @property
    def alpha(self) -> list[float]:
        """Conditional per-position acceptance alpha_i (nan where position i was never verified)."""
        return [a / n if n else float("nan") for a, n in zip(self.accepts, self.attempts)]

    @property
    def tau(self) -> float:
        """Tokens emitted per target verification pass, including the bonus / corrected token."""
        return self.emitted / self.target_passes if self.target_passes else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """vLLM style: accepted drafted tokens / drafted tokens."""
        return sum(self.accepts) / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.wall_time_s if self.wall_time_s > 0 else float("nan")

    @classmethod
    def merge(cls, stats: list[DecodeStats]) -> DecodeStats:
        out = cls(k=max((s.k for s in stats), default=0))
        for s in stats:
            out._grow(len(s.attempts))
            for i in range(len(s.attempts)):
                out.attempts[i] += s.attempts[i]
                out.accepts[i] += s.accepts[i]
            for name in ("drafted", "target_passes", "emitted", "prefill_tokens", "sequences",
                         "draft_time_s", "target_time_s", "wall_time_s"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
        return out

    def to_dict(self) -> dict:
        def clean(x: float):
            return None if x != x else x  # nan -> null in JSON

        d = asdict(self)
        d.update(alpha=[clean(a) for a in self.alpha], tau=clean(self.tau),
                 acceptance_rate=clean(self.acceptance_rate), tokens_per_s=clean(self.tokens_per_s))
        return d


@dataclass
class SpecOutput:
    tokens: list[int]  # generated ids, prompt excluded (ends with eos when stopped by it)
    stats: DecodeStats
    stop_reason: str = "length"  # "eos" or "length"


# ---------------------------------------------------------------------------------------------
# public entry points


def speculative_generate(
    target,
    drafter: Drafter | None,
    input_ids,
    max_new_tokens: int = 128,
    k: int = 5,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_token_id: int | list[int] | None = None,
    tree: dict | None = None,
    attention_mask=None,
    batch_size: int | None = None,
) -> SpecOutput | list[SpecOutput]:
    """Generate with ``drafter`` proposing and ``target`` verifying; the output is distributed exactly
    as the target's own decoding (identical tokens when greedy).

    ``k``: chain length, or the maximum tree depth. ``tree``: None for chains, else a dict of tree
    options handed to the drafter (``DraftContext.tree``, e.g. ``{"topk": 4}``); the drafter must
    support trees. ``eos_token_id``: None = the target's generation_config / config / tokenizer eos;
    ``[]`` = never stop early. ``drafter=None`` is plain decoding (see ``plain_generate``).
    ``batch_size``: None = rows one after another; B = B rows per target pass (spectrain/batched.py).
    """
    check_generate_args(target, drafter, input_ids, k, tree, temperature, top_p, top_k)
    if drafter is None:
        k = 0
    elif not isinstance(k, int) or k <= 0:
        raise ValueError(f"k (draft length / tree depth) must be a positive integer, got {k!r}")
    if tree is not None and drafter is not None and not getattr(drafter, "supports_tree", False):
        raise ValueError(f"drafter {getattr(drafter, 'name', type(drafter).__name__)!r} cannot propose trees; "
                         "pass tree=None for chain drafts")
    positive_int("max_new_tokens", max_new_tokens)
    positive_int("batch_size", batch_size, allow_none=True)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    generator = torch.Generator(device=target.device).manual_seed(int(seed))
    sampler = Sampler(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), generator=generator)
    rows, batched = _as_rows(input_ids, attention_mask)
    limit = target.max_positions
    for i, row in enumerate(rows):
        if limit is not None and len(row) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(row)} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
                f"target's context window of {limit} positions: shorten the prompt or lower max_new_tokens")
    eos = _resolve_eos(target, eos_token_id)
    if batch_size is not None:
        from spectrain.batched import generate_batched

        outs = generate_batched(target, drafter, rows, max_new_tokens, k, sampler, eos, tree, batch_size)
    else:
        outs = [_generate_one(target, drafter, row, max_new_tokens, k, sampler, eos, tree) for row in rows]
    return outs if batched else outs[0]


def plain_generate(target, input_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, seed: int = 0, eos_token_id: int | list[int] | None = None,
                   attention_mask=None, batch_size: int | None = None) -> SpecOutput | list[SpecOutput]:
    """The plain target baseline: the same loop, batching and cache, one token per pass (tau = 1)."""
    return speculative_generate(target, None, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, eos_token_id=eos_token_id,
                                attention_mask=attention_mask, batch_size=batch_size)


# ---------------------------------------------------------------------------------------------
# input handling


def _as_rows(input_ids, attention_mask) -> tuple[list[list[int]], bool]:
    """Prompts as lists of ids; ``attention_mask`` (same form and shape as ``input_ids``, 1 = keep) is applied
    to every form: a 1-D or 2-D tensor, a list of ids, a list of lists."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be 1-D or 2-D, got shape {tuple(input_ids.shape)}")
        batched = input_ids.dim() == 2
        rows = input_ids.tolist() if batched else [input_ids.tolist()]
    elif isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, torch.Tensor)):
        rows = [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in input_ids]
        batched = True
    elif isinstance(input_ids, (list, tuple)):
        rows, batched = [list(input_ids)], False
    else:
        raise ValueError(f"input_ids must be a tensor or a list of ints / lists, got {type(input_ids).__name__}")
    if not rows:
        raise ValueError("input_ids holds no prompts")
    if attention_mask is not None:
        rows = _apply_mask(rows, attention_mask, batched)
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. the BOS token)")
    return [[int(t) for t in r] for r in rows], batched


def _apply_mask(rows: list[list], attention_mask, batched: bool) -> list[list]:
    """Keep the positions whose mask is 1; a mask of another shape, or with values other than 0/1, is refused."""
    if isinstance(attention_mask, torch.Tensor):
        mask = attention_mask.tolist()
    elif isinstance(attention_mask, (list, tuple)):
        mask = [m.tolist() if isinstance(m, torch.Tensor) else m for m in attention_mask]
    else:
        raise ValueError(f"attention_mask must be a tensor or a list like input_ids, got {type(attention_mask).__name__}")
    mask = mask if batched else [mask]
    shape = [len(r) for r in rows]
    if len(mask) != len(rows) or any(not isinstance(m, (list, tuple)) or len(m) != n for m, n in zip(mask, shape)):
        got = [len(m) if isinstance(m, (list, tuple)) else "scalar" for m in mask]
        raise ValueError(f"attention_mask does not match input_ids: prompt lengths {shape}, mask lengths {got}; give "
                         "one 0/1 entry per token (the same shape as input_ids)")
    if any(v not in (0, 1) for m in mask for v in m):
        raise ValueError("attention_mask must hold only 0 (padding, dropped) and 1 (a real token)")
    return [[t for t, keep in zip(r, m) if keep] for r, m in zip(rows, mask)]


def _resolve_eos(target, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gen = getattr(target.model, "generation_config", None)
        for src in (gen, target.config, target.tokenizer):
            eos_token_id = getattr(src, "eos_token_id", None) if src is not None else None
            if eos_token_id is not None:
                break
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


# ---------------------------------------------------------------------------------------------
# the loop


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # the split between draft and target time needs finished kernels
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _generate_one(target, drafter, prompt: list[int], max_new: int, k: int, sampler: Sampler,
                  eos: set[int], tree: dict | None) -> SpecOutput:
    from transformers import DynamicCache

    dev = target.device
    stats = DecodeStats(k=k, sequences=1, prefill_tokens=len(prompt))
    stats._grow(k)
    aux_layers = list(getattr(drafter, "aux_layers", []) or []) if drafter is not None else []
    want_final = bool(drafter is not None and getattr(drafter, "needs_final_hidden", False))
    want_feats = bool(aux_layers) or want_final
    tokens = list(prompt)
    # A plain DynamicCache (full-attention layers only) so that any prefix can be cropped or gathered;
    # sliding-window models still get their window from the attention mask.
    cache = DynamicCache()
    pending: list[TargetFeatures] = []
    t_start = _now(dev)
    if drafter is not None:
        drafter.begin(torch.tensor(prompt, device=dev))
        stats.draft_time_s += _now(dev) - t_start
    if len(tokens) > 1:
        t0 = _now(dev)
        out = target.forward(torch.tensor([tokens[:-1]], device=dev), cache=cache, aux_layers=aux_layers,
                             want_final_hidden=want_final, want_logits=False, use_cache=True)
        cache = out.cache
        if want_feats:
            pending.append(_features(out, 0, list(range(len(tokens) - 1))))
        stats.target_time_s += _now(dev) - t0
    emitted: list[int] = []
    stop = "length"
    while len(emitted) < max_new:
        depth_limit = min(k, max_new - len(emitted) - 1)  # never draft past the token budget
        proposal, keep_idx = None, []
        if drafter is not None and depth_limit > 0:
            t0 = _now(dev)
            ctx = DraftContext(tokens=torch.tensor(tokens, device=dev), k=depth_limit, sampler=sampler,
                               features=_concat_features(pending), tree=tree)
            pending = []
            proposal, keep_idx = _clip(drafter.propose(ctx), depth_limit, target.vocab_size)
            stats.draft_time_s += _now(dev) - t0
        t0 = _now(dev)
        path, new, outcomes, out = _verify(target, cache, tokens, proposal, sampler, aux_layers, want_final)
        path, new, outcomes, eos_hit = _cut(path, new, outcomes, max_new - len(emitted), eos)
        stop = eos_hit or stop
        P = len(tokens) - 1
        _rollback(cache, P + 1, path)
        if want_feats:
            pending.append(_features(out, P, [0] + [1 + i for i in path]))
        stats.target_time_s += _now(dev) - t0
        _record_step(stats, proposal, outcomes, new)
        tokens.extend(new)
        emitted.extend(new)
        if proposal is not None:
            t0 = _now(dev)
            drafter.commit([keep_idx[i] for i in path])
            stats.draft_time_s += _now(dev) - t0
        if stop == "eos":
            break
    stats.wall_time_s = _now(dev) - t_start
    return SpecOutput(tokens=emitted, stats=stats, stop_reason=stop)


def _cut(path, new, outcomes, room: int, eos: set[int]):
    """Stop at eos inside the accepted tokens and at the token budget; later positions are neither
    emitted nor counted. Returns (path, new, outcomes, "eos" or None)."""
    cut, stop = min(len(new), room), None
    for j, t in enumerate(new[:cut]):
        if t in eos:
            cut, stop = j + 1, "eos"
            break
    if cut <= len(path):
        path, outcomes = path[:cut], outcomes[:cut]
    return path, new[:cut], outcomes, stop


def _record_step(stats: DecodeStats, proposal, outcomes: list[bool], new: list[int]) -> None:
    stats.target_passes += 1
    stats.drafted += len(proposal) if proposal is not None else 0
    stats.record(outcomes)
    stats.emitted += len(new)


def _clip(proposal: Proposal, depth_limit: int, vocab: int) -> tuple[Proposal | None, list[int]]:
    """Drop nodes deeper than the budget allows; returns the clipped proposal and kept original indices."""
    if proposal is None or len(proposal) == 0:
        return None, []
    toks = proposal.tokens.reshape(-1)
    if int(toks.min()) < 0 or int(toks.max()) >= vocab:
        raise ValueError(f"drafter proposed token ids outside the target vocabulary [0, {vocab})")
    if proposal.is_chain:
        n = min(len(proposal), depth_limit)
        probs = proposal.probs[:n] if proposal.probs is not None else None
        return Proposal(tokens=toks[:n], probs=probs), list(range(n))
    parents = proposal.parents.tolist()
    depth = _depths(parents)
    keep = [i for i, d in enumerate(depth) if d <= depth_limit]
    if len(keep) == len(parents):
        return proposal, keep
    remap = {old: new for new, old in enumerate(keep)}
    new_parents = torch.tensor([remap[parents[i]] if parents[i] >= 0 else -1 for i in keep])
    idx = torch.tensor(keep, device=toks.device)
    probs = proposal.probs[idx] if proposal.probs is not None else None
    return Proposal(tokens=toks[idx], parents=new_parents, probs=probs,
                    without_replacement=proposal.without_replacement), keep


def _depths(parents: list[int]) -> list[int]:
    depth = []
    for i, p in enumerate(parents):
        if p >= i or p < -1:
            raise ValueError(f"tree proposal node {i} has parent {p}: parents must precede their children "
                             "(-1 = the last committed token)")
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


# ---------------------------------------------------------------------------------------------
# verification


def _verify(target, cache, tokens, proposal, sampler, aux_layers, want_final):
    """One target pass over [last token] + nodes. Returns (accepted node indices root->leaf, emitted
    tokens, per-depth outcomes, target output)."""
    dev = target.device
    P = len(tokens) - 1
    n = len(proposal) if proposal is not None else 0
    ids = torch.tensor([tokens[-1]], device=dev)
    mask = None
    if n == 0:
        pos = torch.tensor([P], device=dev)
    else:
        ids = torch.cat([ids, proposal.tokens.to(dev)])
        if proposal.is_chain:
            pos = torch.arange(P, P + n + 1, device=dev)
        else:
            depth = torch.tensor([0] + _depths(proposal.parents.tolist()), device=dev)
            pos = P + depth
            mask = tree_mask(target, proposal.parents.tolist(), P, pos)
    out = target.forward(ids[None], position_ids=pos[None], attention_mask=mask, cache=cache,
                         aux_layers=aux_layers, want_final_hidden=want_final, use_cache=True)
    logits = out.logits[0]
    if proposal is None or proposal.is_chain:
        path, new, outcomes = accept_chain(logits, proposal, sampler)
    else:
        path, new, outcomes = accept_tree(logits, proposal, sampler)
    return path, new, outcomes, out


# ---------------------------------------------------------------------------------------------
# cache and features


def _rollback(cache, keep_prefix: int, path: list[int]) -> None:
    """Keep the first ``keep_prefix`` entries (past + root) plus the accepted nodes' entries."""
    contiguous = path == list(range(len(path)))
    idx = None
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if contiguous:
            end = keep_prefix + len(path)
            layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        else:
            if idx is None:
                idx = torch.tensor(list(range(keep_prefix)) + [keep_prefix + i for i in path],
                                   device=layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = layer.keys.shape[-2]


def _features(out, start: int, rows: list[int], b: int = 0) -> TargetFeatures:
    """Feature rows `rows` (query indices) of batch row `b` of a target output."""
    idx = torch.tensor(rows, device=(out.aux_hidden[0] if out.aux_hidden else out.final_hidden).device)
    aux = torch.cat([h[b] for h in out.aux_hidden], dim=-1).index_select(0, idx) if out.aux_hidden else None
    final = out.final_hidden[b].index_select(0, idx) if out.final_hidden is not None else None
    return TargetFeatures(start=start, aux=aux, final_hidden=final)


def _concat_features(pieces: list[TargetFeatures]) -> TargetFeatures | None:
    if not pieces:
        return None
    if len(pieces) == 1:
        return pieces[0]
    aux = torch.cat([f.aux for f in pieces]) if pieces[0].aux is not None else None
    final = torch.cat([f.final_hidden for f in pieces]) if pieces[0].final_hidden is not None else None
    return TargetFeatures(start=pieces[0].start, aux=aux, final_hidden=final)
