"""MEASURED verification cost: the time of one target pass over t new tokens with a cached context.

    curve = measure_curve(target, batch=1)            # {1: 0.044, 2: 0.049, 4: 0.088, ...} seconds
    best = pick_chain(alphas, draft_step_s, curve)     # the k with the highest expected speedup

The roofline (spectrain/eval/roofline.py) predicts this cost from peak bandwidth and FLOPs; on a CPU it
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

from spectrain.eval.roofline import crossover
from spectrain.targets.auto_dtype import verify_pass_seconds

TOKENS = (1, 2, 4, 8, 16, 32)


def measure_curve(target, batch: int = 1, context: int = 200, tokens=TOKENS, repeats: int = 5,
                  seed: int = 0) -> dict[int, float]:
    """Median seconds of one target pass over t new tokens per row (B rows, `context` cached)."""
    return verify_pass_seconds(target, tokens, batch, context, repeats, seed)


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


def draft_step_seconds(rec: dict) -> float | None:
    """Seconds of one drafter step in an eval record (draft time per verification pass / depth)."""
    passes, k = rec.get("target_passes") or 0, rec.get("k") or 0
    return rec["draft_time_s"] / (passes * k) if passes and k else None


def annotate_sweep(sweep: dict, curves: dict[int, dict[int, float]], records: list[dict]) -> None:
    """The batch-size sweep predicted from the MEASURED cost curve at each B instead of the roofline (in place):
    speedup = tau * T_B(1) / (T_B(n + 1) + depth * d), tau at the smallest B, d = the drafter step measured at
    B = 1 in the eval grid (a drafter step at larger B costs more, so this leans optimistic there)."""
    steps: dict[tuple, list[float]] = {}
    for r in records:
        d = draft_step_seconds(r)
        if d is not None:
            steps.setdefault((r["drafter"], r["config"]), []).append(d)
    first: dict[tuple, dict] = {}
    for c in sweep["cells"]:
        first.setdefault((c["drafter"], c["config"]), c)
    for c in sweep["cells"]:
        key, curve = (c["drafter"], c["config"]), curves.get(c["batch_size"])
        tau = first[key]["tau"]
        if curve is None or tau is None:
            continue
        d = statistics.mean(steps.get(key, [0.0]))
        nodes, depth = (c["tree"]["total_tokens"], c["tree"]["depth"]) if c["tree"] else (c["k"], c["k"])
        c["predicted_cost_curve"] = tree_speedup(tau, nodes, depth, curve, d)
    for row in sweep.get("crossover", []):
        cs = [c for c in sweep["cells"] if (c["drafter"], c["config"]) == (row["drafter"], row["config"])]
        row["predicted_cost_curve"] = crossover([c["batch_size"] for c in cs],
                                                [c.get("predicted_cost_curve") for c in cs])


def recommend(records: list[dict], curve: dict[int, float], max_k: int = 8) -> list[dict]:
    """Per (drafter, T, prompt set): the chain length the measured curve and the measured alpha_i / drafter
    cost predict to be fastest, beside each evaluated setting's predicted and measured speedup."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["drafter"], r["temperature"], r["prompt_set"]), []).append(r)
    out = []
    for (drafter, temp, ps), recs in groups.items():
        chains = [r for r in recs if not r.get("tree")]
        if not chains:
            continue
        longest = max(chains, key=lambda r: r["k"])  # the most positions measured
        alphas = [a if a is not None else 0.0 for a in longest["alpha"]][:max_k]
        d = draft_step_seconds(longest) or 0.0
        best_k, pred = pick_chain(alphas, d, curve)
        rows = []
        for r in recs:
            t = r.get("tree")
            p = (pred.get(r["k"]) if not t else
                 tree_speedup(r["tau"] or 1.0, t["total_tokens"], t["depth"], curve, draft_step_seconds(r) or 0.0))
            rows.append({"config": r["config"], "predicted": p, "measured": r.get("measured_speedup")})
        measured_best = max(rows, key=lambda x: x["measured"] or 0.0)["config"]
        out.append({"drafter": drafter, "temperature": temp, "prompt_set": ps, "alphas": alphas,
                    "draft_step_ms": d * 1e3, "best_k": best_k, "predicted_by_k": pred, "settings": rows,
                    "measured_best": measured_best})
    return out


def recommend_markdown(recs: list[dict]) -> list[str]:
    lines = ["| drafter | T | prompt set | drafter step | pick (measured curve) | setting: predicted / measured speedup "
             "| measured best |", "|---|---|---|---|---|---|---|"]
    for r in recs:
        cells = "; ".join(f"{s['config'].split(' T=')[0]}: {_x(s['predicted'])} / {_x(s['measured'])}"
                          for s in r["settings"])
        lines.append(f"| {r['drafter']} | {r['temperature']:g} | {r['prompt_set']} | {r['draft_step_ms']:.1f} ms "
                     f"| k={r['best_k']} ({_x(r['predicted_by_k'][r['best_k']])}) | {cells} "
                     f"| {r['measured_best'].split(' T=')[0]} |")
    return lines


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"
