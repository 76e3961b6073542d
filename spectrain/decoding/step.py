"""The pieces of one speculative step that the single-row loop (``loop``) and the batched loop (``batched``)
share: draft -> clip to the token budget -> verify in one target pass -> accept -> cut at eos / budget ->
record -> hand the accepted positions' features to the drafter; the timing context manager both loops charge
their draft and target time through. The counters live in ``decoding/stats.py``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from spectrain.decoding.interface import Proposal, TargetFeatures
from spectrain.decoding.stats import DecodeStats


def now(device: torch.device) -> float:
    if device.type == "cuda":  # the split between draft and target time needs finished kernels
        torch.cuda.synchronize(device)
    return time.perf_counter()


def resolve_eos(target, eos_token_id) -> set[int]:
    """The stop ids: the given ones, else the target's generation_config / config / tokenizer eos (none: never stop)."""
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


@contextmanager
def timed(device: torch.device, charge: Callable[[float], None]) -> Iterator[None]:
    """Time the block (with finished kernels on CUDA) and hand its seconds to ``charge``."""
    t0 = now(device)
    yield
    charge(now(device) - t0)


def clip_proposal(proposal: Proposal, depth_limit: int, vocab: int) -> tuple[Proposal | None, list[int]]:
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
    depth = depths(parents)
    keep = [i for i, d in enumerate(depth) if d <= depth_limit]
    if len(keep) == len(parents):
        return proposal, keep
    remap = {old: new for new, old in enumerate(keep)}
    new_parents = torch.tensor([remap[parents[i]] if parents[i] >= 0 else -1 for i in keep])
    idx = torch.tensor(keep, device=toks.device)
    probs = proposal.probs[idx] if proposal.probs is not None else None
    return Proposal(tokens=toks[idx], parents=new_parents, probs=probs,
                    without_replacement=proposal.without_replacement), keep


def depths(parents: list[int]) -> list[int]:
    depth = []
    for i, p in enumerate(parents):
        if p >= i or p < -1:
            raise ValueError(f"tree proposal node {i} has parent {p}: parents must precede their children "
                             "(-1 = the last committed token)")
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def cut_at_stop(path, new, outcomes, room: int, eos: set[int]):
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


def record_step(stats: DecodeStats, proposal, outcomes: list[bool], new: list[int]) -> None:
    stats.target_passes += 1
    stats.drafted += len(proposal) if proposal is not None else 0
    stats.record(outcomes)
    stats.emitted += len(new)


def features_at(out, start: int, rows: list[int], b: int = 0) -> TargetFeatures:
    """Feature rows `rows` (query indices) of batch row `b` of a target output."""
    idx = torch.tensor(rows, device=(out.aux_hidden[0] if out.aux_hidden else out.final_hidden).device)
    aux = torch.cat([h[b] for h in out.aux_hidden], dim=-1).index_select(0, idx) if out.aux_hidden else None
    final = out.final_hidden[b].index_select(0, idx) if out.final_hidden is not None else None
    return TargetFeatures(start=start, aux=aux, final_hidden=final)


def concat_features(pieces: list[TargetFeatures]) -> TargetFeatures | None:
    if not pieces:
        return None
    if len(pieces) == 1:
        return pieces[0]
    aux = torch.cat([f.aux for f in pieces]) if pieces[0].aux is not None else None
    final = torch.cat([f.final_hidden for f in pieces]) if pieces[0].final_hidden is not None else None
    return TargetFeatures(start=pieces[0].start, aux=aux, final_hidden=final)
