"""scripts/studies/data_scaling.py: the runs it plans (steps proportional to rows, resumed, skipped when done),
the eval it asks for, and the table and plot it writes from a report (no training here)."""

from __future__ import annotations

import json

import pytest

from scripts.studies import data_scaling as ds


def _record(drafter, s, temp, alpha, tau):
    return {"drafter": drafter, "prompt_set": s, "temperature": temp, "k": 2, "alpha": alpha, "tau": tau,
            "alpha_ci": [[x - 0.1, x + 0.1] for x in alpha], "tau_ci": [tau - 0.2, tau + 0.2]}


def test_plans_one_run_per_size_and_resumes_or_skips(tmp_path, monkeypatch):
    cmds = []
    monkeypatch.setattr(ds, "sh", lambda cmd, log, threads: cmds.append(cmd))
    done, part = tmp_path / "rows600", tmp_path / "rows1500"
    for d in (done / "best", done / "last", part / "last"):
        d.mkdir(parents=True)
    (done / "metrics.jsonl").write_text(json.dumps({"event": "end", "wall_s": 5}) + "\n")
    ds.main(["--work", str(tmp_path), "--sizes", "600,1500,3000", "--epochs", "2", "--stage", "train",
             "--set", "training.lr=2e-3", "training.adam_betas=[0.9,0.95]"])
    assert len(cmds) == 2  # 600 finished: skipped
    assert "data.max_rows=1500" in cmds[0] and "training.resume_from=auto" in cmds[0]
    assert "data.max_rows=3000" in cmds[1] and "training.resume_from=auto" not in cmds[1]
    assert all("training.epochs=2" in c and "training.max_steps=0" in c for c in cmds)
    assert all("training.lr=2e-3" in c and "training.adam_betas=[0.9,0.95]" in c for c in cmds)  # --set, every size


def test_eval_decodes_every_size_and_ngram_then_tabulates(tmp_path, monkeypatch):
    cmds = []
    monkeypatch.setattr(ds, "sh", lambda cmd, log, threads: cmds.append(cmd))
    for n, acc in ((600, 0.3), (3000, 0.5)):
        (tmp_path / f"rows{n}" / "best").mkdir(parents=True)
        (tmp_path / f"rows{n}" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
            {"step": 10, "loss": 1.0}, {"step": 10, "split": "heldout", "eval/acc_0": acc},
            {"step": 10, "event": "end", "wall_s": 12.5})) + "\n")
    heads = tmp_path / "heads"
    recs = [_record(str(heads / "rows600"), "heldout", 0.0, [0.4, 0.3], 1.5),
            _record(str(heads / "rows3000"), "heldout", 0.0, [0.6, 0.5], 1.9),
            _record("ngram", "heldout", 0.0, [0.45, 0.3], 1.6)]
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(json.dumps({"records": recs}))
    ds.main(["--work", str(tmp_path), "--sizes", "600,3000", "--k", "2", "--sets", "heldout", "--stage", "eval"])
    cmd = cmds[0]
    assert cmd[cmd.index("--drafter") + 1] == str(heads / "rows600") and "ngram" in cmd
    assert "data.max_rows" not in " ".join(cmd)  # the full data's held-out split for every size
    assert (heads / "rows3000").resolve() == (tmp_path / "rows3000" / "best").resolve()
    md = (tmp_path / "scaling.md").read_text()
    assert "| 3000 | 10 | 12 | 0.500 |" in md or "| 3000 | 10 | 13 | 0.500 |" in md
    assert "| heldout | 3000 | 0.60 [0.50, 0.70] | 0.50 [0.40, 0.60] | 1.90 [1.70, 2.10] |" in md
    assert "| heldout | ngram | 0.45" in md
    stored = json.loads((tmp_path / "scaling.json").read_text())["tables"]
    assert set(stored) == {"train", "T0"} and len(stored["T0"]["rows"]) == 3
    assert (tmp_path / "scaling.png").stat().st_size > 1000


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit, match="comma list"):
        ds.main(["--work", "/tmp/x", "--sizes", "600,lots"])
    with pytest.raises(SystemExit, match="positive"):
        ds.main(["--work", "/tmp/x", "--sizes", "0"])


def test_store_writes_tables_gen_tables_renders(tmp_path, monkeypatch):
    """--store NAME: eval/reference/NAME.json holds NAME_train, NAME_T0, ... in gen_tables' stored form."""
    from scripts import gen_tables

    monkeypatch.setattr(ds, "ROOT", tmp_path)
    (tmp_path / "eval" / "reference").mkdir(parents=True)
    work = tmp_path / "w"
    (work / "rows600" / "best").mkdir(parents=True)
    (work / "rows600" / "metrics.jsonl").write_text(json.dumps({"event": "end", "wall_s": 3}) + "\n")
    (work / "eval").mkdir()
    recs = [_record(str(work / "heads" / "rows600"), "heldout", t, [0.4, 0.3], 1.5) for t in (0.0, 1.0)]
    recs[1]["tau_ci"] = None  # a record without an interval prints its bare value
    recs[1]["alpha"][1], recs[1]["alpha_ci"][1] = None, [None, None]  # position 2 never reached: "-"
    (work / "eval" / "report.json").write_text(json.dumps({"records": recs}))
    ds.main(["--work", str(work), "--sizes", "600", "--k", "2", "--sets", "heldout", "--stage", "table",
             "--store", "ds_test"])
    doc = json.loads((tmp_path / "eval" / "reference" / "ds_test.json").read_text())
    assert set(doc["tables"]) == {"ds_test_train", "ds_test_T0", "ds_test_T1"}
    t1 = gen_tables.stored(doc["tables"]["ds_test_T1"])
    assert "| heldout | 600 | 0.40 [0.30, 0.50] | - | 1.50 |" in t1
