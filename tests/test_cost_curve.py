"""The measured verification cost curve and the chain length it picks."""

from __future__ import annotations

import pytest

from spectrain.eval import cost_curve as cc

# A CPU-like curve: 1-2 tokens cost one step, 4 cost two (the small-matmul step), then slow growth.
CPU = {1: 1.0, 2: 1.1, 4: 2.0, 8: 2.3, 16: 3.2, 32: 3.8}
# A GPU-like (memory-bound) curve: flat up to 16 tokens.
FLAT = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.02, 16: 1.05, 32: 1.3}


@pytest.mark.parametrize("t, want", [(1, 1.0), (2, 1.1), (3, 1.55), (6, 2.15), (32, 3.8), (48, 4.4)],
                         ids=["point", "point2", "between", "between2", "last", "extrapolated"])
def test_cost_at_interpolates(t, want):
    assert cc.cost_at(CPU, t) == pytest.approx(want)


def test_expected_tau_is_the_chain_formula():
    assert cc.expected_tau([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert cc.expected_tau([0.8, 0.5], 1) == pytest.approx(1.8)


@pytest.mark.parametrize("curve, alphas, draft, best", [
    (CPU, [0.8, 0.7, 0.7, 0.7, 0.7], 0.03, 1),   # verification beyond 2 tokens doubles the cost: k = 1
    (FLAT, [0.8, 0.7, 0.7, 0.7, 0.7], 0.03, 5),  # memory-bound: the longest chain pays
    (FLAT, [0.8, 0.7, 0.7, 0.7, 0.7], 0.5, 1),   # an expensive drafter: one token
], ids=["cpu-curve", "flat-curve", "costly-drafter"])
def test_pick_chain_follows_the_measured_costs(curve, alphas, draft, best):
    k, pred = cc.pick_chain(alphas, draft, curve)
    assert k == best and pred[k] == max(pred.values())
    assert pred[1] == pytest.approx(1.8 / (cc.cost_at(curve, 2) + draft))


def test_measure_curve_times_every_length():
    from conftest import make_tiny_target

    curve = cc.measure_curve(make_tiny_target("llama"), batch=2, context=16, tokens=(1, 4), repeats=2)
    assert set(curve) == {1, 4} and all(v > 0 for v in curve.values())
    assert "| 2 |" in cc.curve_table({2: curve})


def test_recommend_compares_predicted_and_measured():
    recs = [{"drafter": "h", "temperature": 0.0, "prompt_set": "s", "config": f"k={k} T=0", "k": k, "tree": None,
             "alpha": [0.9, 0.6, 0.5][:k], "target_passes": 10, "draft_time_s": 0.01 * 10 * k,
             "tau": cc.expected_tau([0.9, 0.6, 0.5], k), "measured_speedup": m}
            for k, m in ((1, 1.6), (3, 1.2))]
    (r,) = cc.recommend(recs, CPU)
    assert r["best_k"] == 1 and r["measured_best"] == "k=1 T=0"
    assert r["draft_step_ms"] == pytest.approx(10.0)
    assert "k=1" in "\n".join(cc.recommend_markdown([r]))


def test_annotate_sweep_predicts_each_batch_size_from_its_own_curve():
    """The crossover predicted from the measured curve at each B (not the roofline): a pass over 2 tokens that
    costs 1.1x at B = 1 but 1.9x at B = 8 turns tau 1.6 from a win into a loss."""
    sweep = {"cells": [{"drafter": "h", "config": "k=1 T=0", "k": 1, "tree": None, "batch_size": b,
                        "tau": 1.6 if b == 1 else 1.5} for b in (1, 8)],
             "crossover": [{"drafter": "h", "config": "k=1 T=0"}]}
    curves = {1: {1: 0.010, 2: 0.011}, 8: {1: 0.020, 2: 0.038}}
    recs = [{"drafter": "h", "config": "k=1 T=0", "k": 1, "target_passes": 10, "draft_time_s": 0.005}]
    cc.annotate_sweep(sweep, curves, recs)
    b1, b8 = sweep["cells"]
    assert b1["predicted_cost_curve"] == pytest.approx(1.6 * 0.010 / (0.011 + 0.0005))
    assert b8["predicted_cost_curve"] == pytest.approx(1.6 * 0.020 / (0.038 + 0.0005))  # tau taken at the smallest B
    assert sweep["crossover"][0]["predicted_cost_curve"] == 1
