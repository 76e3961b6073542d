"""`spectrain eval --repeats N`: plain and speculative decodes alternate prompt by prompt, N times; tokens and
acceptance come from the first repeat, the speedup is the median of the paired per-repeat ratios; the progress
bar counts tokens (prompt + new) per decode, so long prompts weigh more."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import spectrain.eval.harness as harness
from spectrain.decoding.stats import DecodeStats
from spectrain.eval.harness import DecodeConfig, progress_total, run_cells
from spectrain.eval.prompts import PromptSet
from spectrain.eval.report import make_record


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, n):
        self.n += n

    def set_postfix_str(self, _):
        pass


def test_repeats_alternate_and_the_speedup_is_the_median_of_paired_ratios(monkeypatch):
    calls, clock = [], iter([1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # plain, spec, ...

    def fake(kind):
        def fn(**kw):
            calls.append((kind, kw["seed"]))
            return SimpleNamespace(tokens=[1, 2, 3, 4], stats=DecodeStats(k=2, attempts=[2, 1], accepts=[1, 1],
                                                                         drafted=4, target_passes=2, emitted=4))
        return fn

    monkeypatch.setattr(harness, "plain_generate", fake("plain"))  # the names the harness decodes with
    monkeypatch.setattr(harness, "speculative_generate", fake("spec"))
    def timed(fn, **kw):
        return fn(**kw), next(clock)

    monkeypatch.setattr(harness, "timed", timed)
    target = SimpleNamespace(device="cpu")
    ps = PromptSet("p", "OOD", [[], []], "t")
    encoded = {"p": [[5] * 6, [5] * 2]}
    plan = {"d": [DecodeConfig(2, None, 0.0)]}
    args = SimpleNamespace(temperature=[0.0], max_new_tokens=4, top_p=1.0, top_k=0, seed=0, repeats=3)
    bar = Bar()
    cells = run_cells(target, {"d": object()}, plan, [ps], encoded, args, bar)
    assert calls == [("plain", 0), ("spec", 0)] * 3 + [("plain", 1), ("spec", 1)] * 3  # alternating, per prompt
    assert bar.n == progress_total(encoded, plan, args) == ((6 + 4) + (2 + 4)) * 2 * 3  # tokens, not prompts
    base, spec = cells[("plain", "T=0", "p")], cells[("d", "k=2 T=0", "p")]
    assert base["tokens"] == spec["tokens"] == 8 and len(spec["stats"]) == 2  # counted once, not per repeat
    assert base["rep_seconds"] == [2.0, 5.0, 2.0] and spec["rep_seconds"] == [2.0, 2.0, 2.0]
    assert base["seconds"] == 2.0  # the median repeat: the slow first plain run does not set the speedup
    spec["prompt_stats"], spec["stats"] = spec["stats"], DecodeStats.merge(spec["stats"])
    rec = make_record("d", DecodeConfig(2, None, 0.0), ps, spec, base, None)
    assert rec["measured_speedup_repeats"] == pytest.approx([1.0, 2.5, 1.0])
    assert rec["measured_speedup"] == pytest.approx(1.0) and rec["speedup_above_tau"] is False


def test_bad_repeats_refused(capsys):
    from spectrain.cli import main

    assert main(["eval", "--target", "does/not/exist", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
