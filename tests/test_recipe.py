"""Recipes: strict schema, typed overrides, derived gradient accumulation, every shipped recipe, `check`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from spectrain.recipe.load import load_recipe, recipe_from_dict
from spectrain.recipe.schema import Recipe
from spectrain.train.check import main as check_main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate" not in p.relative_to(ROOT / "recipes").parts)


def test_recipes_exist():
    assert ROOT / "recipes" / "tiny" / "eagle3.yaml" in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_every_shipped_recipe_validates(path):
    r = load_recipe(path)
    assert isinstance(r, Recipe)
    assert r.training.global_batch_size % r.training.micro_batch_size == 0
    assert recipe_from_dict(r.to_dict()) == r  # the resolved recipe saved in run dirs loads back
    assert yaml.safe_load(r.to_yaml()) == r.to_dict()
    if "tiny" in path.parts:  # CPU recipes must run on a clean clone: their data ships with the repo
        assert all((ROOT / f).exists() for f in r.data.train_files), r.data.train_files


def _write(tmp_path: Path, raw: dict) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize("raw, pattern", [
    ({"trainig": {"lr": 1.0}}, r"unknown key 'trainig' in the top level: did you mean 'training'"),
    ({"training": {"warmup_step": 3}}, r"unknown key 'warmup_step' in section 'training': did you mean 'warmup_steps'"),
    ({"drafter": {"eagle3": {"ttt_step": 3}}}, r"section 'drafter.eagle3': did you mean 'ttt_steps'"),
    ({"training": {"lr": "fast"}}, r"training.lr: expected a number, got 'fast'"),
    ({"training": {"epochs": 1.5}}, r"training.epochs: expected an integer"),
    ({"target": {"trust_remote_code": "yes"}}, r"target.trust_remote_code: expected true or false"),
    ({"target": {"name_or_path": 12}}, r"target.name_or_path: expected a string"),
    ({"drafter": {"kind": "eagle4"}}, r"drafter.kind: 'eagle4' is not one of eagle3, medusa, draft, dflash, ngram"),
    ({"drafter": {"loss": "kl"}}, r"drafter.loss: 'kl' is not one of"),
    ({"tracking": {"report_to": ["jsonl", "mlflow"]}}, r"tracking.report_to\[1\]: 'mlflow' is not one of"),
    ({"drafter": {"eagle3": {"aux_layers": [1, "x"]}}}, r"drafter.eagle3.aux_layers\[1\]: expected an integer"),
    ({"training": "fast"}, r"training: expected a mapping"),
    ({"training": {"global_batch_size": 10, "micro_batch_size": 4}}, r"not divisible by micro_batch_size \(4\)"),
    ({"training": {"lr": 0.0}}, r"training.lr=0.0 must be in \(0, 1\]"),
    ({"data": {"heldout_fraction": 1.0}}, r"heldout_fraction=1.0 must be in \[0, 1\)"),
    ({"drafter": {"ngram": {"min_n": 4, "max_n": 3}}}, r"need 1 <= min_n \(4\) <= max_n \(3\)"),
    ({"drafter": {"draft": {"init": "layers:a"}}}, r"drafter.draft.init='layers:a'"),
    ({"drafter": {"kind": "draft"}}, r"drafter.draft.model is empty"),
    ({"tracking": {"report_to": ["none", "jsonl"]}}, r"'none' cannot be combined"),
])
def test_strict_schema_errors(tmp_path, raw, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_recipe(_write(tmp_path, raw))


def test_error_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"r\.yaml: unknown key"):
        load_recipe(_write(tmp_path, {"ouput_dir": "x"}))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping of sections"):
        load_recipe(tmp_path / "list.yaml")
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")


def test_yaml_float_without_dot():
    # PyYAML reads `1e-4` as a string; a float field must still accept it.
    r = recipe_from_dict(yaml.safe_load("training: {lr: 1e-4}"))
    assert r.training.lr == pytest.approx(1e-4) and isinstance(r.training.lr, float)


def test_overrides_are_typed(tmp_path):
    r = load_recipe(_write(tmp_path, {}), [
        "training.lr=1e-4", "training.epochs=3", "target.trust_remote_code=true",
        "drafter.eagle3.aux_layers=[1,3,5]", "tracking.report_to=none", "target.name_or_path=007",
        "data.train_files=a.jsonl,b.jsonl", "drafter.kind=medusa", "output_dir=runs/x", "training.grad_clip=2",
    ])
    assert r.training.lr == pytest.approx(1e-4) and isinstance(r.training.lr, float)
    assert r.training.epochs == 3 and r.target.trust_remote_code is True
    assert r.drafter.eagle3.aux_layers == [1, 3, 5] and r.tracking.report_to == ["none"]
    assert r.target.name_or_path == "007" and r.data.train_files == ["a.jsonl", "b.jsonl"]
    assert r.drafter.kind == "medusa" and r.output_dir == "runs/x" and r.training.grad_clip == 2.0
    r2 = load_recipe(_write(tmp_path, {}), ["drafter.eagle3.aux_layers=2,4,6", "tracking.report_to=jsonl,wandb",
                                            "drafter.eagle3.aux_layers=", "training.resume_from="])
    assert r2.drafter.eagle3.aux_layers == [] and r2.tracking.report_to == ["jsonl", "wandb"]
    assert r2.training.resume_from == ""


@pytest.mark.parametrize("override, pattern", [
    ("training.lr", r"expected key=value"),
    ("training.lrr=1", r"unknown key 'lrr' in section 'training': did you mean 'lr'"),
    ("trainng.lr=1", r"did you mean 'training'"),
    ("training.epochs=abc", r"training.epochs: expected an integer, got 'abc'"),
    ("training.epochs=2.5", r"expected an integer"),
    ("target.trust_remote_code=maybe", r"expected true or false"),
    ("drafter.kind=eagle4", r"'eagle4' is not one of"),
    ("training=3", r"names a whole section"),
    ("training.lr.x=1", r"'training.lr' is a value, not a section"),
    ("drafter.eagle3.aux_layers=1,x", r"aux_layers\[1\]: expected an integer"),
    ("training.micro_batch_size=3", r"not divisible"),
    ("training.lr=-1", r"must be in \(0, 1\]"),
])
def test_bad_overrides(tmp_path, override, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_recipe(_write(tmp_path, {}), [override])


def test_grad_accum_derived():
    r = recipe_from_dict({"training": {"global_batch_size": 12, "micro_batch_size": 2}})
    assert r.training.grad_accum(1) == 6 and r.training.grad_accum(3) == 2 and r.training.grad_accum(6) == 1
    with pytest.raises(ValueError, match=r"micro_batch_size \(2\) x world size \(4\) = 8"):
        r.training.grad_accum(4)


# ---- `spectrain check` on a tiny local model dir --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from test_data import CHATML, make_tokenizer
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny-target")
    tok = make_tokenizer(CHATML, "<|im_end|>")
    tok.save_pretrained(d)
    LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(d)
    return d


def _check_recipe(tmp_path: Path, model_dir: Path, **training) -> Path:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": "What is two plus two?"},
                                         {"role": "assistant", "content": "Two plus two is four."}]} for i in range(5)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return _write(tmp_path, {"target": {"name_or_path": str(model_dir)},
                             "data": {"train_files": [str(data)], "cache_dir": str(tmp_path / "cache")},
                             "drafter": {"eagle3": {"draft_vocab_size": 100}},
                             "output_dir": str(tmp_path / "run")})


def test_check_ok(tmp_path, tiny_model_dir, capsys):
    assert check_main(str(_check_recipe(tmp_path, tiny_model_dir)), ["training.lr=1e-3"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out.split("---")[0])
    assert resolved["training"]["lr"] == pytest.approx(1e-3) and resolved["drafter"]["kind"] == "eagle3"
    assert "OK target" in out and "8 layers" in out and "chat template present" in out
    assert "first reply under the mask: 'Two plus two is four.<|im_end|>'" in out


@pytest.mark.parametrize("override, pattern", [
    ("drafter.eagle3.draft_vocab_size=100000", r"draft_vocab_size=100000 exceeds the target vocab"),
    ("drafter.eagle3.aux_layers=2,4,8", r"aux_layers \[8\] out of range: the target has 8 layers"),
    ("target.name_or_path=/nonexistent/model", r"target model dir not found: /nonexistent/model"),
    ("target.name_or_path=" + __file__, r"cannot load target config/tokenizer"),
    ("training.lrr=1", r"did you mean 'lr'"),
    ("data.max_length=8", r"no sampled conversation has an assistant token"),
])
def test_check_fails_clearly(tmp_path, tiny_model_dir, capsys, override, pattern):
    assert check_main(str(_check_recipe(tmp_path, tiny_model_dir)), [override]) == 2
    err = capsys.readouterr().err
    assert "spectrain check: FAILED" in err
    import re

    assert re.search(pattern, err), err


def test_check_draft_tokenizer_must_match(tmp_path, tiny_model_dir, capsys):
    from test_data import CHATML, CORPUS, make_tokenizer

    other = tmp_path / "other-draft"
    CORPUS.append("zebra quartz jumping")  # a different training corpus -> a different BPE vocabulary
    try:
        make_tokenizer(CHATML, "<|im_end|>").save_pretrained(other)
    finally:
        CORPUS.pop()
    recipe = str(_check_recipe(tmp_path, tiny_model_dir))
    assert check_main(recipe, ["drafter.kind=draft", f"drafter.draft.model={tiny_model_dir}"]) == 0
    assert check_main(recipe, ["drafter.kind=draft", f"drafter.draft.model={other}"]) == 2
    assert "different tokenizer vocabulary" in capsys.readouterr().err


def test_check_needs_chat_template(tmp_path, tiny_model_dir, capsys):
    import shutil

    d = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for extra in d.glob("chat_template.*"):
        extra.unlink()
    assert check_main(str(_check_recipe(tmp_path, d)), []) == 2
    assert "has no chat template" in capsys.readouterr().err


@pytest.mark.skipif(not (ROOT / "assets" / "reference-target" / "config.json").exists(),
                    reason="bundled reference target not built")
def test_check_tiny_recipe_on_reference_target(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipe paths are relative to the working directory
    assert check_main("recipes/tiny/eagle3.yaml", []) == 0
    out = capsys.readouterr().out
    assert "reference-target: llama, 8 layers" in out and "<|end|>'" in out
