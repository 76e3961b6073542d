"""MEASURED verification cost: the time of one target pass over t new tokens with a cached context.

    curve = measure_curve(target, batch=1)            # {1: 0.044, 2: 0.049, 4: 0.088, ...} seconds
    best = pick_chain(alphas, draft_step_s, curve)     # the k with the highest expected speedup

The roofline (spectrain/roofline.py) predicts this cost from peak bandwidth and FLOPs; on a CPU it
misses the small-matrix step (a pass over 4 tokens costs about twice a pass over 1, not the same), so
settings are chosen from this measured curve instead. A chain of k drafted tokens costs one target
pass over k + 1 tokens plus k drafter steps; with alpha_i the measured conditional acceptance,

    E[tau_k] = 1 + sum_{i<=k} prod_{j<=i} alpha_j
    speedup(k) = E[tau_k] * T(1) / (T(k + 1) + k * d)        (d = one drafter step, measured)

and a tree of n nodes and depth D: speedup = tau * T(1) / (T(n + 1) + D * d). T between measured
points is interpolated linearly. Everything is per batch size: measure the curve at the B you decode.
"""

from __future__ import annotations

import statistics
import time

import torch

TOKENS = (1, 2, 4, 8, 16, 32)


@torch.no_grad()
def measure_curve(target, batch: int = 1, context: int = 200, tokens=TOKENS, repeats: int = 5,
                  seed: int = 0) -> dict[int, float]:
    """Median seconds of one target pass over t new tokens per row (B rows, `context` cached tokens)."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (batch, context + max(tokens)), generator=g).to(target.device)
    cache = DynamicCache()
    target.model(ids[:, :context], use_cache=True, **{target._cache_kw: cache})
    out: dict[int, list[float]] = {t: [] for t in tokens}
    for r in range(repeats + 1):  # the first round warms up kernels and allocator; not counted
        for t in tokens:  # interleaved, so a slow moment hits every t alike
            cache.crop(context)
            start = time.perf_counter()
            target.model(ids[:, context:context + t], use_cache=True, **{target._cache_kw: cache})
            if r:
                out[t].append(time.perf_counter() - start)
    cache.crop(context)
    return {t: statistics.median(v) for t, v in out.items()}


def cost_at(curve: dict[int, float], t: int) -> float:
    """T(t), linear between measured points, flat-extrapolated per token beyond the last."""
    pts = sorted(curve.items())
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
        if t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    (t0, c0), (t1, c1) = pts[-2], pts[-1]
    return c1 + (c1 - c0) / (t1 - t0) * (t - t1)


def expected_tau(alphas: list[float], k: int) -> float:
    tau, run = 1.0, 1.0
    for a in alphas[:k]:
        run *= a
        tau += run
    return tau


def chain_speedup(alphas: list[float], k: int, curve: dict[int, float], draft_step_s: float) -> float:
    return expected_tau(alphas, k) * cost_at(curve, 1) / (cost_at(curve, k + 1) + k * draft_step_s)


def tree_speedup(tau: float, nodes: int, depth: int, curve: dict[int, float], draft_step_s: float) -> float:
    return tau * cost_at(curve, 1) / (cost_at(curve, nodes + 1) + depth * draft_step_s)


def pick_chain(alphas: list[float], draft_step_s: float, curve: dict[int, float]) -> tuple[int, dict[int, float]]:
    """(best k, predicted speedup per k) for k = 1..len(alphas)."""
    pred = {k: chain_speedup(alphas, k, curve, draft_step_s) for k in range(1, len(alphas) + 1)}
    return max(pred, key=pred.get), pred


def curve_table(curves: dict[int, dict[int, float]]) -> str:
    """Markdown: one row per batch size, T(t) in ms and relative to T(1)."""
    ts = sorted(next(iter(curves.values())))
    lines = ["| B | " + " | ".join(f"t={t}" for t in ts) + " |", "|---" * (len(ts) + 1) + "|"]
    for b, c in sorted(curves.items()):
        cells = [f"{c[t] * 1e3:.1f} ms ({c[t] / c[ts[0]]:.2f}x)" for t in ts]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
