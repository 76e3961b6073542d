"""The pieces of one speculative step that the single-row loop (``loop``) and the batched loop (``batched``)
share: draft -> clip to the token budget -> verify in one target pass -> accept -> cut at eos / budget ->
record -> hand the accepted positions' features to the drafter. Also the counters (``DecodeStats``) and the
timing context manager both loops charge their draft and target time through."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from spectrain.decoding.interface import Proposal, TargetFeatures


@dataclass
class DecodeStats:
    """Counters of one or more decoded sequences (metric conventions: docs/evaluation.md)."""

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

    def add_draft(self, seconds: float) -> None:
        self.draft_time_s += seconds

    def add_target(self, seconds: float) -> None:
        self.target_time_s += seconds

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
