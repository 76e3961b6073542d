"""Statistics for eval reports: 95% intervals (bootstrap over prompts for tau, Wilson for alpha_i), and how much
the target loops.

Pure functions on plain numbers (no models), used by spectrain.eval.report.

- Intervals: prompts are the unit of resampling. tau = sum(tokens) / sum(passes) and alpha_i =
  sum(accepts_i) / sum(attempts_i) are ratios of sums over prompts, so each bootstrap replicate draws
  n prompts with replacement and recomputes the same ratio; the interval is the 2.5th and 97.5th
  percentile of the replicates (fixed seed: a report is reproducible). With few prompts or a position
  that was rarely verified the interval is wide, which is the point.
- alpha_i is a proportion (accepts of verifications at position i), so its interval is the Wilson score
  interval of the pooled counts (``wilson_ci``): the percentile bootstrap collapses to [0, 0] or [1, 1]
  when every verification of a position failed or succeeded (a position verified once with 0 accepts
  showed ``0.00 [0.00, 0.00]``), Wilson gives [0, 0.79] there. It treats verifications as independent,
  so where prompts differ a lot it is narrower than a bootstrap over prompts would be.
- Paired differences: two drafters decoded on the same prompts differ by a per-prompt amount;
  resampling prompts jointly (``paired_diff_ci``) gives a much tighter interval for the difference
  than comparing the two marginal intervals.
- Loops: a target that repeats itself under greedy decoding is easy to draft for (any drafter that
  copies the recent past is accepted), so acceptance on such a set says more about the target than
  about the drafter. ``repeated_ngram_share`` is the share of an output's 4-grams that already
  occurred earlier in the same output; a set is flagged when the share over its outputs is >=
  LOOP_FLAG.
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np

N_BOOT = 2000
LEVEL = 0.95
LOOP_FLAG = 0.5  # repeated 4-gram share at which loops dominate a prompt set's target outputs


def _percentiles(reps: np.ndarray, level: float) -> tuple[list[float | None], list[float | None]]:
    """(lo, hi) per column of reps [B, k]; None where every replicate is undefined (nan)."""
    lo, hi = np.full(reps.shape[1], np.nan), np.full(reps.shape[1], np.nan)
    ok = np.isfinite(reps).any(0)
    if ok.any():
        lo[ok], hi[ok] = np.nanpercentile(reps[:, ok], [50 * (1 - level), 50 * (1 + level)], axis=0)
    return ([None if not np.isfinite(x) else float(x) for x in lo],
            [None if not np.isfinite(x) else float(x) for x in hi])


def ratio_ci(num, den, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0):
    """Bootstrap interval of sum(num) / sum(den) over prompts. num, den: [n] or [n, k] (one ratio per
    column). Returns [lo, hi] (1-D input) or a list of [lo, hi] per column; None bounds where undefined."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if num.shape != den.shape or num.ndim not in (1, 2):
        raise ValueError(f"ratio_ci: num {num.shape} and den {den.shape} must be the same [n] or [n, k] shape")
    n = num.shape[0]
    if n == 0:
        return [None, None] if num.ndim == 1 else [[None, None]] * num.shape[1]
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = num[idx].sum(1) / den[idx].sum(1)  # [B] or [B, k]
    reps = reps.reshape(n_boot, -1)
    reps[~np.isfinite(reps)] = np.nan
    lo, hi = _percentiles(reps, level)
    return [lo[0], hi[0]] if num.ndim == 1 else [[a, b] for a, b in zip(lo, hi)]


def wilson_ci(successes, trials, level: float = LEVEL) -> list[float | None]:
    """Wilson score interval [lo, hi] of successes / trials ([None, None] when trials == 0)."""
    n, k = float(trials), float(successes)
    if n <= 0:
        return [None, None]
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = k / n
    centre, half = p + z * z / (2 * n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    den = 1 + z * z / n
    return [max(0.0, float((centre - half) / den)), min(1.0, float((centre + half) / den))]


def paired_diff_ci(num_a, den_a, num_b, den_b, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0):
    """(point, [lo, hi]) of sum(num_a)/sum(den_a) - sum(num_b)/sum(den_b), prompts resampled jointly."""
    a = [np.asarray(x, dtype=float) for x in (num_a, den_a, num_b, den_b)]
    n = a[0].shape[0]
    if any(x.shape != (n,) for x in a) or n == 0:
        raise ValueError("paired_diff_ci: four [n] arrays over the same n >= 1 prompts")
    point = a[0].sum() / a[1].sum() - a[2].sum() / a[3].sum()
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    reps = a[0][idx].sum(1) / a[1][idx].sum(1) - a[2][idx].sum(1) / a[3][idx].sum(1)
    lo, hi = _percentiles(reps[:, None], level)
    return float(point), [lo[0], hi[0]]


def decode_intervals(tokens: list[int], passes: list[int], accepts: list[list[int]], attempts: list[list[int]],
                     drafted: list[int], k: int = 0) -> dict:
    """Per-prompt counters of one (drafter, config, prompt set) cell -> 95% intervals of tau (bootstrap), every
    alpha_i (i = 1..max(k, longest record); Wilson on the pooled counts) and the acceptance rate (bootstrap),
    plus the per-prompt tau counters for paired comparisons."""
    k = max(k, *(len(a) for a in attempts)) if attempts else k
    acc = np.array([list(a) + [0] * (k - len(a)) for a in accepts], dtype=float).reshape(len(accepts), k)
    att = np.array([list(a) + [0] * (k - len(a)) for a in attempts], dtype=float).reshape(len(attempts), k)
    return {"tau_ci": ratio_ci(tokens, passes),
            "alpha_ci": [wilson_ci(a, n) for a, n in zip(acc.sum(0), att.sum(0))] if k else [],
            "acceptance_rate_ci": ratio_ci(acc.sum(1), drafted),
            "per_prompt": {"tokens": list(map(int, tokens)), "passes": list(map(int, passes))},
            "ci_level": LEVEL, "ci_method": f"tau, acceptance rate: percentile bootstrap over prompts, {N_BOOT} "
                                            "replicates, seed 0; alpha_i: Wilson score interval of the pooled counts"}


def repeated_ngram_share(tokens: list[int], n: int = 4) -> tuple[int, int]:
    """(repeated, total) n-grams of one output: repeated = occurrences of an n-gram seen earlier in it."""
    seen: set[tuple[int, ...]] = set()
    rep = total = 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        total += 1
        rep += g in seen
        seen.add(g)
    return rep, total


def loop_stats(outputs: list[list[int]], n: int = 4) -> dict:
    """How the target's own outputs of a prompt set look: mean length and the repeated n-gram share."""
    counts = [repeated_ngram_share(list(o), n) for o in outputs]
    rep, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    share = rep / total if total else None
    return {"target_mean_tokens": float(np.mean([len(o) for o in outputs])) if outputs else None,
            f"target_repeated_{n}gram_share": share,
            "target_loops_dominate": share is not None and share >= LOOP_FLAG}


def fmt_value(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def fmt_ci(x, ci, nd: int = 2) -> str:
    """'1.74 [1.60, 1.90]': a value with its 95% interval (just the value when there is none)."""
    if x is None or not ci or ci[0] is None:
        return fmt_value(x, nd)
    return f"{x:.{nd}f} [{ci[0]:.{nd}f}, {ci[1]:.{nd}f}]"
