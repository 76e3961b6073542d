"""`spectrain compare`: cells matched by (config, prompt set), prompts by id, a paired interval and a verdict."""

from __future__ import annotations

import json

import pytest

from spectrain.cli import main as cli_main
from spectrain.eval import compare as C


def rec(drafter, tokens, passes, ids, prompt_set="heldout", config="k=3 T=0"):
    return {"drafter": drafter, "config": config, "prompt_set": prompt_set, "split": "held-out",
            "per_prompt": {"tokens": tokens, "passes": passes, "ids": ids}}


def write(path, records):
    path.mkdir(parents=True)
    (path / "report.json").write_text(json.dumps({"meta": {}, "records": records}))
    return path


def test_pairs_by_id_not_by_position(tmp_path):
    ids = [f"p{i}" for i in range(12)]
    a = [rec("runs/a/best", [20] * 12, [10] * 12, ids)]  # tau 2.0 everywhere
    # B decoded the prompts in another order, plus one prompt A never saw; each prompt gains 0.5 tau
    order = list(reversed(range(12)))
    b = [rec("runs/b/best", [25] * 12 + [100], [10] * 12 + [10], [ids[i] for i in order] + ["new"])]
    (row,) = C.compare({"records": a}, {"records": b})
    assert row["n"] == 12 and row["matched_by"] == "id"
    assert row["tau_a"] == 2.0 and row["tau_b"] == 2.5 and row["diff"] == pytest.approx(0.5)
    assert row["ci"][0] == pytest.approx(0.5) and C.verdict([row]).startswith("verdict: B is better")


def test_verdict_no_difference_and_mixed():
    same = {"diff": 0.01, "ci": [-0.1, 0.12]}
    assert "no clear difference" in C.verdict([same])
    assert "mixed" in C.verdict([{"diff": 0.3, "ci": [0.1, 0.5]}, {"diff": -0.3, "ci": [-0.5, -0.1]}])
    assert "A is better" in C.verdict([{"diff": -0.3, "ci": [-0.5, -0.1]}, same])


def test_cli_and_bad_input(tmp_path, capsys):
    ids = ["x", "y", "z"]
    a = write(tmp_path / "eval-a", [rec("ngram", [10, 12, 9], [9, 10, 8], ids),
                                    rec("ngram", [10, 12, 9], [9, 10, 8], ids, prompt_set="humaneval")])
    b = write(tmp_path / "eval-b", [rec("runs/b/best", [20, 24, 18], [9, 10, 8], ids),
                                    rec("runs/b/best", [20, 24, 18], [9, 10, 8], ids, config="k=5 T=0")])
    assert cli_main(["compare", str(a), str(b / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "| k=3 T=0 | heldout | held-out | 3 |" in out and "humaneval" not in out  # only shared cells
    assert out.strip().splitlines()[-1].startswith("verdict: B is better")
    two = write(tmp_path / "two", [rec("d1", [1], [1], ["x"]), rec("d2", [1], [1], ["x"])])
    with pytest.raises(ValueError, match="holds 2 drafters.*--drafter-a"):
        C.compare(C.load_report(two), C.load_report(b))
    assert C.compare(C.load_report(two), C.load_report(b), drafter_a="d2")[0]["n"] == 1
    with pytest.raises(ValueError, match="share no"):
        C.compare(C.load_report(b), {"records": [rec("z", [1], [1], ["q"], prompt_set="other")]})
    assert cli_main(["compare", str(tmp_path / "nowhere"), str(b)]) == 2
    assert "no report.json" in capsys.readouterr().err
