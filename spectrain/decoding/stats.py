"""The decode counters: ``DecodeStats`` (attempts and accepts per draft position, passes, time) and
``SpecOutput`` (one decoded sequence with its counters). Metric conventions: docs/evaluation.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
