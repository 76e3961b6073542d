"""Lossless speculative decoding: chain and tree drafts, greedy and sampling, target KV-cache reuse.

One verification pass per step. Invariant: the target cache holds ``tokens[:-1]`` (every committed
token except the newest). A step feeds ``[tokens[-1]] + drafted nodes`` at positions
``P + depth`` (P = len(tokens) - 1; a chain has depth 1..n), so logits row 0 is the target's
distribution for the first drafted position and the row of node i is the distribution after it.
After acceptance the cache keeps the root plus the accepted path (a crop for chains, a gather for
trees), which restores the invariant. The prefill feeds ``prompt[:-1]`` and emits nothing. Where the drafter reads
no target features and drafts chains (plain decoding, n-gram, draft models) there is no separate prefill: the first
step's pass feeds the whole prompt plus the first draft (as HF ``generate`` does), which saves a pass per prompt.
Either way every counted target pass emits >= 1 token and plain decoding has tau = 1 exactly.

Acceptance rules (greedy, and exact sampling with residuals): spectrain/decoding/acceptance.py.

Batches: ``input_ids`` may be 1-D (one prompt -> ``SpecOutput``) or 2-D / a list of lists (-> a list of
``SpecOutput``, one per row, with one shared random generator; padding is removed with
``attention_mask`` when given). By default rows are decoded one after another; ``batch_size=B``
decodes B rows at once with one target pass per step for all of them (spectrain/decoding/batched.py), each
row's output exactly what batch size 1 gives. Aggregate with ``DecodeStats.merge``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from spectrain.decoding import kv_cache
from spectrain.decoding.acceptance import accept_chain, accept_tree
from spectrain.decoding.batched import generate_batched
from spectrain.decoding.interface import DraftContext, Drafter, TargetFeatures
from spectrain.decoding.masks import tree_mask
from spectrain.decoding.sampling import Sampler
from spectrain.decoding.stats import DecodeStats, SpecOutput
from spectrain.decoding.step import (
    clip_proposal,
    concat_features,
    cut_at_stop,
    depths,
    features_at,
    now,
    record_step,
    resolve_eos,
    timed,
)
from spectrain.decoding.validate import check_generate_args, positive_int
from spectrain.registry import FeatureSpec

__all__ = ["DecodeStats", "SpecOutput", "plain_generate", "speculative_generate"]


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
    ``batch_size``: None = rows one after another; B = B rows per target pass (spectrain/decoding/batched.py).
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
    eos = resolve_eos(target, eos_token_id)
    if batch_size is not None:
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


# ---------------------------------------------------------------------------------------------
# the loop


def _generate_one(target, drafter, prompt: list[int], max_new: int, k: int, sampler: Sampler,
                  eos: set[int], tree: dict | None) -> SpecOutput:
    dev = target.device
    stats = DecodeStats(k=k, sequences=1, prefill_tokens=len(prompt))
    stats._grow(k)
    spec = drafter.features() if drafter is not None else FeatureSpec()
    aux_layers, want_final = list(spec.aux_layers), spec.final_hidden
    want_feats = bool(aux_layers) or want_final
    tokens = list(prompt)
    # A plain DynamicCache (full-attention layers only) so that any prefix can be cropped or gathered;
    # sliding-window models still get their window from the attention mask.
    cache = DynamicCache()
    pending: list[TargetFeatures] = []
    t_start = now(dev)
    if drafter is not None:
        with timed(dev, stats.add_draft):
            drafter.begin(torch.tensor(prompt, device=dev))
    # Drafters that read the prompt's features need them before the first draft: a pass of its own. Otherwise the
    # prompt rides on the first verify pass (trees keep the prefill: their mask assumes a cached prefix).
    fold = not want_feats and tree is None
    uncached = len(tokens) - 1 if fold else 0  # committed tokens the cache does not hold yet, besides the last
    if len(tokens) > 1 and not fold:
        with timed(dev, stats.add_target):
            out = target.forward(torch.tensor([tokens[:-1]], device=dev), cache=cache, aux_layers=aux_layers,
                                 want_final_hidden=want_final, want_logits=False, use_cache=True)
            cache = out.cache
            if want_feats:
                pending.append(features_at(out, 0, list(range(len(tokens) - 1))))
    emitted: list[int] = []
    stop = "length"
    while len(emitted) < max_new:
        depth_limit = min(k, max_new - len(emitted) - 1)  # never draft past the token budget
        proposal, keep_idx = None, []
        if drafter is not None and depth_limit > 0:  # draft
            with timed(dev, stats.add_draft):
                ctx = DraftContext(tokens=torch.tensor(tokens, device=dev), k=depth_limit, sampler=sampler,
                                   features=concat_features(pending), tree=tree)
                pending = []
                proposal, keep_idx = clip_proposal(drafter.propose(ctx), depth_limit, target.vocab_size)
        with timed(dev, stats.add_target):  # verify in one pass, accept, roll the cache back to the accepted path
            path, new, outcomes, out = _verify(target, cache, tokens, proposal, sampler, aux_layers, want_final,
                                               uncached)
            uncached = 0
            path, new, outcomes, eos_hit = cut_at_stop(path, new, outcomes, max_new - len(emitted), eos)
            stop = eos_hit or stop
            P = len(tokens) - 1
            kv_cache.keep_path(cache, P + 1, path)
            if want_feats:
                pending.append(features_at(out, P, [0] + [1 + i for i in path]))
        record_step(stats, proposal, outcomes, new)
        tokens.extend(new)
        emitted.extend(new)
        if proposal is not None:  # commit: the drafter keeps the accepted nodes' state
            with timed(dev, stats.add_draft):
                drafter.commit([keep_idx[i] for i in path])
        if stop == "eos":
            break
    stats.wall_time_s = now(dev) - t_start
    return SpecOutput(tokens=emitted, stats=stats, stop_reason=stop)


# ---------------------------------------------------------------------------------------------
# verification


def _verify(target, cache, tokens, proposal, sampler, aux_layers, want_final, uncached: int = 0):
    """One target pass over [last token] + nodes (preceded by the ``uncached`` committed tokens before it, on a
    folded prefill). Returns (accepted node indices root->leaf, emitted tokens, per-depth outcomes, target output)."""
    dev = target.device
    P = len(tokens) - 1
    start = P - uncached
    n = len(proposal) if proposal is not None else 0
    ids = torch.tensor(tokens[start:], device=dev)
    mask = None
    if n == 0:
        pos = torch.arange(start, P + 1, device=dev)
    else:
        ids = torch.cat([ids, proposal.tokens.to(dev)])
        if proposal.is_chain:
            pos = torch.arange(start, P + n + 1, device=dev)
        else:
            depth = torch.tensor([0] + depths(proposal.parents.tolist()), device=dev)
            pos = P + depth
            mask = tree_mask(target, proposal.parents.tolist(), P, pos)
    out = target.forward(ids[None], position_ids=pos[None], attention_mask=mask, cache=cache,
                         aux_layers=aux_layers, want_final_hidden=want_final, use_cache=True, logits_from=uncached)
    logits = out.logits[0]
    if proposal is None or proposal.is_chain:
        path, new, outcomes = accept_chain(logits, proposal, sampler)
    else:
        path, new, outcomes = accept_tree(logits, proposal, sampler)
    return path, new, outcomes, out
