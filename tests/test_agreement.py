"""`spectrain agreement`: the target teacher-forced on regenerated greedy answers. Its own answers agree at every
token; a changed token is a disagreement with a large margin; only greedy rows count; bad input is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectrain.cli import main as cli_main
from spectrain.data import agreement as ag
from spectrain.data import regenerate as rg
from spectrain.data.generate import RegenConfig

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "assets" / "reference-target"


@pytest.fixture(scope="module")
def regen(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("agreement")
    rows = [json.loads(line) for line in (ROOT / "data/train/chat_mix_messages.jsonl").open()][:10]
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = root / "recipe.yaml"
    recipe.write_text(f"target: {{name_or_path: {REF}}}\ndata: {{train_files: [{data}]}}\n")
    out = root / "mixed.jsonl"
    rg.regenerate(str(recipe), [], out, RegenConfig(max_new_tokens=12, batch_size=4, temperature=[0.0, 3.0], seed=5))
    return {"root": root, "recipe": recipe, "out": out}


def _summary(regen, path: Path, *extra: str, capsys=None) -> dict:
    js = regen["root"] / f"{path.stem}.json"
    assert cli_main(["agreement", str(regen["recipe"]), str(path), "--out", str(js), *extra]) == 0
    return json.loads(js.read_text())


def test_the_targets_own_greedy_answers_agree_everywhere(regen):
    rows = [json.loads(line) for line in regen["out"].read_text().splitlines()]
    greedy = [r for r in rows if r["temperature"] == 0]
    assert greedy and len(greedy) < len(rows)  # the mix has both kinds; only the greedy ones are checked
    s = _summary(regen, regen["out"])
    assert s["rows"] + s["rows_not_round_tripping"] == len(greedy) and s["rows"] >= 3
    assert s["token_agreement"] == 1.0 and s["rows_all_agree"] == s["rows"] and s["disagreements"] == 0


def test_a_changed_answer_is_a_disagreement_with_a_large_margin(regen):
    rows = [json.loads(line) for line in regen["out"].read_text().splitlines()]
    for r in rows:  # a confident greedy answer replaced by text the target would not write
        if r["temperature"] == 0:
            r["messages"][1]["content"] = "zebra zebra zebra"
            break
    bad = regen["root"] / "changed.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = _summary(regen, bad)
    assert s["token_agreement"] < 1.0 and s["rows_all_agree"] == s["rows"] - 1
    assert s["disagreements"] >= 1 and s["median_margin"] > 1.0


def test_files_without_temperatures_need_all_and_bad_input_is_named(regen, capsys):
    rows = [json.loads(line) for line in regen["out"].read_text().splitlines()]
    plain = regen["root"] / "plain.jsonl"
    plain.write_text("".join(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n" for r in rows))
    with pytest.raises(ValueError, match="no row records its temperature.*--all"):
        ag.greedy_rows(str(plain), False, 10)
    assert len(ag.greedy_rows(str(plain), True, 10)) == len(rows)
    assert cli_main(["agreement", str(regen["recipe"]), str(regen["root"] / "missing.jsonl")]) != 0
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert cli_main(["agreement", str(regen["recipe"]), str(plain), "--n", "0"]) != 0
    assert "--n 0: must be > 0" in capsys.readouterr().err


def test_out_never_replaces_an_input_a_checkpoint_a_runs_records_or_writes_through_a_link(tmp_path, capsys):
    """--out is checked before the target loads: each refusal is one line and leaves every file as it was."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    regen_file = tmp_path / "regen.jsonl"
    regen_file.write_text(data.read_text())
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"target: {{name_or_path: {REF}}}\ndata: {{train_files: [{data}]}}\n")
    (tmp_path / "hardlink.jsonl").hardlink_to(regen_file)
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / "run_info.json").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "best" / "drafter_config.json").write_text("{}")
    (run / "best" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "link.json").symlink_to(tmp_path / "mine.json")
    (tmp_path / "mine.json").write_text("a user's file")
    before = {p: (p.readlink() if p.is_symlink() else p.read_bytes()) for p in tmp_path.rglob("*") if not p.is_dir()}
    for out, why in ((regen_file, "is the regenerated file"), (tmp_path / "hardlink.jsonl", "is the regenerated file"),
                     (recipe, "is the recipe"), (data, "is the data file"),
                     (run / "best" / "model.safetensors", "a checkpoint directory"),
                     (run / "metrics.jsonl", "own metrics.jsonl"), (tmp_path / "link.json", "is a symbolic link")):
        assert cli_main(["agreement", str(recipe), str(regen_file), "--all", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], (out, err)
    assert before == {p: (p.readlink() if p.is_symlink() else p.read_bytes()) for p in tmp_path.rglob("*")
                      if not p.is_dir()}
