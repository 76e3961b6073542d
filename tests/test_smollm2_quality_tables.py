"""scripts/studies/smollm2_quality_tables.py: tau and paired tables from eval reports (no decoding here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.studies import smollm2_quality_tables


@pytest.fixture
def sq():
    return smollm2_quality_tables


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


def test_a_later_session_pairs_new_heads_with_stored_records_and_keeps_older_rows(sq, tmp_path):
    """Run dirs do not outlive a session: the records stored by one run of the script are paired with the
    next session's new heads, and table rows with neither reports nor records are carried over as they were."""
    out, stored = tmp_path / "tables.json", tmp_path / "records.json"
    old_row = ["spectrain_default", "0", [1.7, 1.5, 1.9], None, None, 1.4]
    out.write_text(json.dumps({"tables": {"sq_tau": {"columns": ["head", "T", *sq.SETS, "mean"], "formats": [],
                                                     "rows": [old_row]}}}))
    first, second = tmp_path / "s1", tmp_path / "s2"
    _write(first, "-a", [_record("e3_default_rerun", 0, s, [48] * 4, [40] * 4) for s in sq.SETS])
    _write(second, "-b", [_record("e3_lk_packed", 0, s, [48] * 4, [30] * 4) for s in sq.SETS])
    sq.main(["--work", str(first), "--out", str(out), "--records", str(stored)])
    sq.main(["--work", str(second), "--out", str(out), "--records", str(stored)])
    tables = json.loads(out.read_text())["tables"]
    assert [r[0] for r in tables["sq_tau"]["rows"]] == ["spectrain_default", "e3_default_rerun", "e3_lk_packed"]
    assert tables["sq_tau"]["rows"][0] == old_row
    paired = tables["sq_lk_vs_rerun"]["rows"]
    assert [r[:2] for r in paired] == [["e3_lk_packed", "0"]] and paired[0][-2] == pytest.approx(40 / 30)
    assert {r["head"] for r in json.loads(stored.read_text())["records"]} == {"e3_default_rerun", "e3_lk_packed"}
    # decoding a head again replaces its stored records rather than adding to them
    _write(tmp_path / "s3", "-c", [_record("e3_lk_packed", 0, s, [48] * 4, [40] * 4) for s in sq.SETS])
    sq.main(["--work", str(tmp_path / "s3"), "--out", str(out), "--records", str(stored)])
    recs = json.loads(stored.read_text())["records"]
    assert len(recs) == 6 and json.loads(out.read_text())["tables"]["sq_lk_vs_rerun"]["rows"][0][-2] == pytest.approx(1.0)
