"""scripts/smollm2_quality_tables.py: tau and paired tables from eval reports (no decoding here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script


@pytest.fixture
def sq():
    return load_script("smollm2_quality_tables")


def _record(head: str, temp: int, pset: str, tokens: list[int], passes: list[int]) -> dict:
    tau = sum(tokens) / sum(passes)
    return {"drafter": f"runs/study16/heads/{head}", "config": f"k=3 T={temp}", "prompt_set": pset, "split": "x",
            "tau": tau, "tau_ci": [tau - 0.1, tau + 0.1],
            "per_prompt": {"tokens": tokens, "passes": passes, "ids": [f"p{i}" for i in range(len(tokens))]}}


def _write(work: Path, tag: str, recs: list[dict]) -> None:
    (work / f"eval300{tag}").mkdir(parents=True)
    (work / f"eval300{tag}" / "report.json").write_text(json.dumps({"records": recs}))


def test_paired_table_is_head_minus_reference_with_mean_and_lowest_ratio(sq, tmp_path):
    ref = [_record("speculators_default", t, s, [48] * 4, [40] * 4) for t in (0, 1) for s in sq.SETS]
    # spectrain: 2x the reference's tau on heldout, equal elsewhere; only T=0 decoded
    ours = [_record("spectrain_default", 0, s, [48] * 4, [20 if s == "heldout" else 40] * 4) for s in sq.SETS]
    _write(tmp_path, "-a", ref)
    _write(tmp_path, "-b", ours)
    recs = sq.records(tmp_path)
    t = sq.paired_table(recs, "speculators_default", ["spectrain_default", "absent_head"])
    assert [r[:2] for r in t["rows"]] == [["spectrain_default", "0"]]  # only shared cells, absent heads skipped
    row = t["rows"][0]
    assert row[2][0] == pytest.approx(2.4 - 1.2) and row[3][0] == pytest.approx(0.0)
    assert row[-2] == pytest.approx((2 + 1 + 1) / 3) and row[-1] == pytest.approx(1.0)
    tau = sq.tau_table(recs)
    cells = {tuple(r[:2]): r for r in tau["rows"]}
    assert cells[("spectrain_default", "0")][2][0] == pytest.approx(2.4)
    assert cells[("spectrain_default", "1")][2:] == [None] * 4  # not decoded at T=1: no cells, no mean
    assert sq.paired_table(recs, "missing_reference", ["spectrain_default"]) is None


def test_no_reports_is_a_clear_error(sq, tmp_path):
    with pytest.raises(SystemExit, match="no eval300"):
        sq.main(["--work", str(tmp_path), "--out", str(tmp_path / "x.json")])


def test_training_table_skips_runs_that_have_not_ended(sq, tmp_path):
    def run(path: Path, ended: bool) -> None:
        path.mkdir(parents=True)
        recs = [{"step": s, "loss": 1.0, "tokens": 100 * s} for s in (1, 2)]
        recs += [{"step": 2, "split": "heldout", "eval/acc_0": 0.3, "eval/sim_tau_t1": 1.2}]
        recs += [{"event": "end", "wall_s": 7.0}] if ended else []
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (path / "cpu_times.json").write_text(json.dumps([9.0, 2.0, 4.0]))

    run(tmp_path / "lr1e-3/eagle3-fkl-300", ended=True)
    run(tmp_path / "lr1e-3/eagle3-rollout0.5-300", ended=False)  # still training: no end record
    rows = {r[0]: r for r in sq.training_table(tmp_path)["rows"]}
    assert "e3_lr1e-3_rollout0.5" not in rows
    # steps, tokens / step, wall s, CPU s / step (the first step's warm-up left out), acc_0, T=1 proxy
    assert rows["e3_lr1e-3_fkl"][2:] == [2, 150.0, 7.0, 3.0, 0.3, 1.2]
