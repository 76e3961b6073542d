"""scripts/studies/quality_study.py: the speculators reference runs it plans and the tables it writes (no training here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.studies import quality_study

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def qs():
    return quality_study


def _planned(qs, tmp_path, monkeypatch, steps: int, train_rows: int, **flags) -> list[list[str]]:
    """The commands speculators() would run for a study whose rows and hidden states already exist."""
    rows = tmp_path / f"rows{steps}"
    rows.mkdir()
    (rows / "rows.jsonl").write_text("{}\n")
    (rows / "rows_meta.json").write_text(json.dumps({"train": {"rows": train_rows}, "heldout": {"rows": 64}}))
    (tmp_path / f"spec-data{steps}").mkdir()
    (tmp_path / f"spec-data{steps}" / "harness_meta.json").write_text("{}")
    cmds = []
    monkeypatch.setattr(qs, "sh", lambda cmd, log, threads: cmds.append(cmd))
    qs.speculators(qs.main.__globals__["argparse"].Namespace(spec_venv="/venv", anchor="/anchor", work=tmp_path,
                                                             steps=steps, threads=1, **flags))
    return cmds


def test_speculators_runs_default_layout_at_each_extra_lr(qs, tmp_path, monkeypatch):
    cmds = _planned(qs, tmp_path, monkeypatch, 200, 1600, spec_default=True, spec_default_lrs=["2e-3"],
                    speculators=True)
    runs = {c[c.index("--run-dir") + 1]: c for c in cmds if "--run-dir" in c}
    assert set(runs) == {str(tmp_path / n) for n in ("spec200", "spec200_norms", "spec200_norms_lr2e-3")}
    lr = {Path(k).name: c[c.index("--lr") + 1] for k, c in runs.items()}
    assert lr == {"spec200": "1e-3", "spec200_norms": "1e-3", "spec200_norms_lr2e-3": "2e-3"}
    assert "--no-norm-output" in runs[str(tmp_path / "spec200")]  # the equal-layer reference only
    assert not any("--no-norm-output" in runs[str(tmp_path / n)] for n in ("spec200_norms", "spec200_norms_lr2e-3"))
    assert f"{1600.5 / 1664:.8f}" in runs[str(tmp_path / "spec200")]  # validation = exactly the held-out rows


def _record(head: str, temp: float, tokens: list[int], passes: list[int]) -> dict:
    return {"drafter": f"/w/heads200/{head}", "prompt_set": "heldout", "temperature": temp,
            "tau": sum(tokens) / sum(passes), "tau_ci": [1.0, 3.0],
            "per_prompt": {"tokens": tokens, "passes": passes}}


def test_tables_merge_runs_and_compare_with_each_reference(qs, tmp_path):
    (tmp_path / "eval200a").mkdir()
    (tmp_path / "eval200b").mkdir()
    recs_a = [_record("mine", 0.0, [20, 20, 20], [10, 10, 10]), _record("ref", 0.0, [20, 20, 20], [20, 20, 20])]
    recs_b = [_record("ref_lr", 0.0, [20, 20, 20], [8, 8, 8]), _record("mine", 0.0, [1, 1, 1], [1, 1, 1])]
    (tmp_path / "eval200a" / "report.json").write_text(json.dumps({"records": recs_a}))
    (tmp_path / "eval200b" / "report.json").write_text(json.dumps({"records": recs_b}))
    a = qs.main.__globals__["argparse"].Namespace(work=tmp_path, steps=200, refs=["ref", "ref_lr"])
    text = qs.table(a)
    assert "| mine | 2.00 [1.00, 3.00] | 2.000 |" in text  # the first run's cell wins over the later duplicate
    assert "tau(head) - tau(ref) [paired" in text and "tau(head) - tau(ref_lr) [paired" in text
    rows = [line for line in text.splitlines() if line.startswith("| mine | ")]
    assert any(r.startswith("| mine | +1.00 [") and r.endswith("| 2.000 |") for r in rows), text  # 2.0 vs 1.0
    assert any(r.startswith("| mine | -0.50 [") and r.endswith("| 0.800 |") for r in rows), text  # 2.0 vs 2.5


def test_speculators_default_alone_skips_the_equal_layer_run(qs, tmp_path, monkeypatch):
    cmds = _planned(qs, tmp_path, monkeypatch, 800, 6400, spec_default=True, spec_default_lrs=[], speculators=False)
    assert [c[c.index("--run-dir") + 1] for c in cmds if "--run-dir" in c] == [str(tmp_path / "spec800_norms")]
    assert not any("to_spectrain.py" in " ".join(c) for c in cmds)
