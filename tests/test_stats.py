"""spectrain.eval.stats: bootstrap intervals over prompts, paired differences, target-loop statistics; and the
eval record fields built from them."""

from __future__ import annotations

import pytest

from spectrain.eval import stats


def test_ratio_ci_brackets_the_ratio_and_shrinks_with_more_prompts():
    tokens, passes = [10, 30, 8, 20, 12, 25], [8, 10, 7, 9, 9, 10]
    lo, hi = stats.ratio_ci(tokens, passes)
    point = sum(tokens) / sum(passes)
    assert lo < point < hi
    wide = hi - lo
    lo4, hi4 = stats.ratio_ci(tokens * 4, passes * 4)  # the same prompts, 4x as many
    assert lo4 < point < hi4 and (hi4 - lo4) < 0.7 * wide
    assert stats.ratio_ci([6, 9, 3], [2, 3, 1]) == pytest.approx([3.0, 3.0])  # every prompt has tau 3
    assert stats.ratio_ci([], []) == [None, None]
    with pytest.raises(ValueError, match="same"):
        stats.ratio_ci([1, 2], [1])


def test_alpha_columns_with_a_position_never_verified():
    acc = [[3, 0, 0], [1, 1, 0], [2, 0, 0]]
    att = [[4, 1, 0], [2, 1, 0], [4, 0, 0]]
    ci = stats.ratio_ci(acc, att)
    assert len(ci) == 3 and ci[0][0] <= 0.6 <= ci[0][1] and ci[2] == [None, None]
    out = stats.decode_intervals([9, 7, 8], [5, 4, 4], acc, att, [15, 12, 12], k=4)
    assert len(out["alpha_ci"]) == 4 and out["per_prompt"] == {"tokens": [9, 7, 8], "passes": [5, 4, 4]}
    assert out["tau_ci"][0] <= 24 / 13 <= out["tau_ci"][1] and out["ci_level"] == 0.95


def test_wilson_alpha_intervals_do_not_collapse_at_0_and_1():
    assert stats.wilson_ci(0, 1) == [0.0, pytest.approx(0.7935, abs=1e-4)]  # bootstrap: [0, 0]
    lo, hi = stats.wilson_ci(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7225, abs=1e-4)
    lo, hi = stats.wilson_ci(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert stats.wilson_ci(0, 0) == [None, None]
    out = stats.decode_intervals([3], [2], [[0]], [[1]], [1], k=1)  # one verification, rejected
    assert out["alpha_ci"][0][0] == 0.0 and out["alpha_ci"][0][1] > 0.7 and "Wilson" in out["ci_method"]


def test_paired_difference_is_tighter_than_the_marginals():
    passes = [10, 10, 10, 10, 10, 10, 10, 10]
    a = [12, 30, 15, 25, 11, 28, 14, 26]  # prompts differ a lot ...
    b = [x - 1 for x in a]  # ... but b is always 1 token behind a
    point, (lo, hi) = stats.paired_diff_ci(a, passes, b, passes)
    assert point == pytest.approx(0.1) and lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
    la, ha = stats.ratio_ci(a, passes)
    assert ha - la > 0.5  # marginal intervals overlap although b is worse on every prompt
    with pytest.raises(ValueError, match="same n"):
        stats.paired_diff_ci(a, passes, b[:3], passes[:3])


def test_repeated_4grams_and_the_loop_flag():
    loop = [5, 6, 7, 8] * 6  # 21 4-grams, 4 distinct
    assert stats.repeated_ngram_share(loop) == (17, 21)
    assert stats.repeated_ngram_share([1, 2, 3]) == (0, 0)
    assert stats.repeated_ngram_share(list(range(10))) == (0, 7)
    s = stats.loop_stats([loop, list(range(10))])
    assert s["target_mean_tokens"] == 17.0 and s["target_repeated_4gram_share"] == pytest.approx(17 / 28)
    assert s["target_loops_dominate"] is True
    assert stats.loop_stats([list(range(30))])["target_loops_dominate"] is False


def test_record_carries_intervals_and_loop_columns():
    from spectrain.decoding.stats import DecodeStats
    from spectrain.eval.harness import DecodeConfig
    from spectrain.eval.prompts import PromptSet
    from spectrain.eval.report import interval_table, make_record, summary_table

    per = [DecodeStats(k=2, attempts=[4, 2], accepts=[2, 1], drafted=8, target_passes=4, emitted=7),
           DecodeStats(k=2, attempts=[6, 4], accepts=[4, 2], drafted=12, target_passes=6, emitted=12)]
    merged = DecodeStats.merge(per)
    res = {"stats": merged, "prompt_stats": per, "tokens": 19, "seconds": 1.0, "outputs": [[1] * 7, [2] * 12]}
    base = {"tokens": 19, "seconds": 1.0, "outputs": [[1, 2, 3, 4] * 3, [9] * 7]}
    r = make_record("d", DecodeConfig(2, None, 1.0), PromptSet("p", "OOD", [[]] * 2, "t"), res, base, None)
    assert r["tau_ci"][0] <= r["tau"] <= r["tau_ci"][1] and len(r["alpha_ci"]) == 2
    assert r["target_mean_tokens"] == 9.5 and r["target_repeated_4gram_share"] == pytest.approx(8 / 13)
    assert r["target_loops_dominate"] is True
    row = summary_table([r], {}).splitlines()[2]
    assert f"{r['tau']:.2f} [{r['tau_ci'][0]:.2f}, {r['tau_ci'][1]:.2f}]" in row and "62% LOOPS" in row
    assert "0.60 [" in interval_table([r])


def test_speedup_above_tau_is_flagged_and_plot_labels_are_unique(capsys):
    from spectrain.decoding.stats import DecodeStats
    from spectrain.eval.harness import DecodeConfig
    from spectrain.eval.plots import plot_labels
    from spectrain.eval.prompts import PromptSet
    from spectrain.eval.report import make_record, summary_table

    per = [DecodeStats(k=2, attempts=[4, 2], accepts=[2, 1], drafted=8, target_passes=4, emitted=7)]
    res = {"stats": DecodeStats.merge(per), "prompt_stats": per, "tokens": 7, "seconds": 1.0, "outputs": [[1] * 7]}
    slow_plain = {"tokens": 7, "seconds": 3.0, "outputs": [[1] * 7]}  # tau 1.75, speedup 3x: impossible
    r = make_record("runs/a/best", DecodeConfig(2, None, 0.0), PromptSet("p", "OOD", [[]], "t"), res, slow_plain,
                    None)
    assert r["speedup_above_tau"] is True and "exceeds tau 1.75" in capsys.readouterr().err
    table = summary_table([r], {})
    assert "3.00x > tau!" in table and "FLAG: runs/a/best k=2 T=0 p: measured speedup 3.00x" in table
    fair = make_record("d", DecodeConfig(2, None, 0.0), PromptSet("p", "OOD", [[]], "t"), res,
                       {**slow_plain, "seconds": 1.5}, None)
    assert fair["speedup_above_tau"] is False and "FLAG" not in summary_table([fair], {})
    labels = plot_labels(["runs/a/best", "runs/b/best", "ngram", "x/a/best", "y/a/best"])
    assert labels["runs/b/best"] == "b/best" and labels["ngram"] == "ngram"
    assert len(set(labels.values())) == 5 and labels["x/a/best"] == "x/a/best"


def test_speedup_is_against_the_faster_plain_decoder_and_both_are_stated():
    from spectrain.decoding.stats import DecodeStats
    from spectrain.eval.harness import DecodeConfig
    from spectrain.eval.prompts import PromptSet
    from spectrain.eval.report import make_record, summary_table

    per = [DecodeStats(k=2, attempts=[4, 2], accepts=[2, 1], drafted=8, target_passes=4, emitted=7)]
    res = {"stats": DecodeStats.merge(per), "prompt_stats": per, "tokens": 7, "seconds": 1.0, "outputs": [[1] * 7],
           "rep_seconds": [1.0, 1.2]}
    own = {"tokens": 7, "seconds": 1.5, "outputs": [[1] * 7], "rep_seconds": [1.5, 1.5]}
    hf = {"tokens": 7, "seconds": 1.2, "outputs": [[1] * 7], "rep_seconds": [1.2, 1.2]}
    ps = PromptSet("p", "OOD", [[]], "t")
    r = make_record("d", DecodeConfig(2, None, 0.0), ps, res, own, None, hf)
    assert r["fastest_plain"] == "HF generate plain" and r["baseline_tokens_per_s"] == pytest.approx(7 / 1.2)
    assert r["measured_speedup_vs_spectrain_plain"] == pytest.approx((1.5 / 1.0 + 1.5 / 1.2) / 2)
    assert r["measured_speedup"] == r["measured_speedup_vs_hf_plain"] == pytest.approx((1.2 + 1.0) / 2)
    assert r["measured_speedup_repeats"] == pytest.approx([1.2, 1.0])
    assert "5.8 (HF)" in summary_table([r], {})
    slow_hf = make_record("d", DecodeConfig(2, None, 0.0), ps, res, own, None, {**hf, "seconds": 3.0,
                                                                                   "rep_seconds": [3.0, 3.0]})
    assert slow_hf["fastest_plain"] == "spectrain plain loop"
    assert slow_hf["measured_speedup"] == slow_hf["measured_speedup_vs_spectrain_plain"]
    alone = make_record("d", DecodeConfig(2, None, 0.0), ps, res, own, None)  # --no-hf-plain
    assert alone["fastest_plain"] == "spectrain plain loop" and "measured_speedup_vs_hf_plain" not in alone
