"""The engine grid's arithmetic without the engine: counters -> spectrain's metrics, conformance, prediction."""

from __future__ import annotations

import pytest

from spectrain.engines.server import Completion
from spectrain.eval import conformance
from spectrain.eval.engine import _predict, _stats, engine_markdown, one_prediction, resolve_drafter


def _completion(**kw) -> Completion:
    base = dict(tokens=list(range(16)), text="", predicted_n=16, predicted_per_second=100.0, predicted_ms=160.0)
    return Completion(**{**base, **kw})


def test_engine_counters_become_conditional_acceptance():
    # 5 steps of k = 3: per position accepted on 4, 2, 1 steps -> alpha = 4/5, 2/4, 1/2
    s = _stats(_completion(drafts=5, draft_n=15, draft_n_accepted=7, accepted_per_pos=[4, 2, 1]), 3)
    assert s.attempts == [5, 4, 2] and s.accepts == [4, 2, 1]
    assert s.alpha == [0.8, 0.5, 0.5]
    # 16 tokens: 1 from the prefill pass, 5 steps emitting 5 + 7, then 3 steps without a draft
    assert s.target_passes == 1 + 5 + 3 and s.emitted == 16


def test_a_drafter_that_never_drafts_has_tau_one():
    s = _stats(_completion(), 2)
    assert s.tau == 1.0 and s.attempts == [0, 0]


def test_prediction_uses_the_cost_curve_and_the_drafts_own_time():
    rec = {"tau": 2.0, "target_passes": 10, "draft_time_s": 0.02}  # 2 ms of drafting per step
    curve = {1: 0.010, 3: 0.014}
    assert _predict(rec, curve, 2) == pytest.approx(2.0 * 0.010 / (0.014 + 0.002))
    assert _predict(rec, curve, 5) is None  # no cost measured for t = 6


def test_an_engine_record_has_one_prediction_the_cost_curves_and_its_column_says_so():
    """The harness's tau / (1 + k c) (here 2 / 1.2 = 1.67x) is replaced by the curve's 1.25x, not shown beside it."""
    rec = {"drafter": "exports/e3", "config": "k=2 T=0", "prompt_set": "mt_bench", "alpha": [0.7, 0.4], "tau": 2.0,
           "c": 0.1, "target_passes": 10, "draft_time_s": 0.02, "predicted_speedup": 2.0 / 1.2,
           "measured_speedup": 1.1}
    one_prediction(rec, {1: 0.010, 3: 0.014}, 2)
    assert rec["predicted_speedup"] == pytest.approx(1.25)
    assert [key for key in rec if key.startswith("predicted_speedup")] == ["predicted_speedup"]
    md = engine_markdown({"engine": "b1", "cost_curve": {"depth": 64, "seconds": {"1": 0.010, "3": 0.014}}}, [rec])
    head, _, row = md.strip().splitlines()[-3:]
    assert [c.strip() for c in head.split("|") if "predicted" in c] == ["predicted (measured cost curve)",
                                                                        "measured / predicted"]
    assert "| 1.25x | 1.10x | 0.88 |" in row and "1.67" not in md


def _rec(alpha, ci, drafter="runs/x", k=2, t=0.0, s="mt_bench"):
    return {"drafter": drafter, "prompt_set": s, "k": k, "temperature": t, "alpha": alpha, "alpha_ci": ci,
            "attempts": [10] * len(alpha), "tau": 1.5}


def test_conformance_flags_an_engine_alpha_outside_spectrains_interval():
    own = [_rec([0.4, 0.3], [[0.3, 0.5], [0.2, 0.4]]), _rec([0.9], [[0.8, 1.0]], drafter="ngram")]
    engine = [_rec([0.45, 0.6], [None, None], drafter="exports/e3"), _rec([0.1], [None], drafter="ngram")]
    rows = conformance.alpha_rows(own, engine)
    assert [(r["position"], r["inside"]) for r in rows] == [(1, True), (2, False)]  # n-gram rows not paired
    assert "NO" in conformance.markdown(rows, None)


def test_greedy_agreement_counts_identical_answers_and_shared_prefixes():
    g = conformance.greedy_agreement([[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 9, 3]])
    assert g["identical"] == 1 and g["shared_prefix"] == [3, 1]


def test_bad_drafters_and_reports_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a spectrain eval report"):
        conformance.load_records(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="neither"):
        resolve_drafter(str(tmp_path), "t.gguf", tmp_path)


@pytest.mark.parametrize("quant,weights", [("Q8_0", "q8_0"), ("F32", "f32")])
def test_a_draft_gguf_is_served_as_a_draft_lm_with_its_weight_type_recorded(tmp_path, quant, weights):
    from gguf_fixture import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "draft.gguf", quant=quant)
    d = resolve_drafter(str(path), "t.gguf", tmp_path)
    assert (d.model, d.spec_type, d.weight_type) == (path, "draft-simple", weights)
