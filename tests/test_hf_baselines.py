"""HF generate baselines in the eval grid (spectrain/eval/hf_baselines.py): plain, prompt lookup, assisted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_tiny_model
from test_evaluate import one_thread, write_tiny_chat_world  # noqa: F401  (one_thread: autouse, 1 torch thread)

from spectrain.cli import main as cli_main
from spectrain.eval.hf_baselines import parse_hf_spec


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    d = write_tiny_chat_world(tmp_path_factory.mktemp("hf"))
    vocab = json.loads((d / "target" / "config.json").read_text())["vocab_size"]
    make_tiny_model("llama", vocab_size=vocab, max_positions=160, layers=2, seed=3).save_pretrained(d / "draft")
    (d / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in [
        "what is two plus two? what is two plus two? what is", "def add(x, y): return x + y. def add(x, y):"]) + "\n")
    return d


def _eval(world: Path, out: Path, *drafters: str, temps=("0",)) -> list[dict]:
    argv = ["eval", "--target", str(world / "target"), "--prompts", str(world / "prompts.jsonl"), "--n", "2",
            "--max-new-tokens", "12", "--k", "3", "--out", str(out)]
    for d in drafters:
        argv += ["--drafter", d]
    for t in temps:
        argv += ["--temperature", t]
    assert cli_main(argv) == 0
    return json.loads((out / "report.json").read_text())["records"]


def test_hf_rows_are_lossless_and_their_counters_add_up(world, tmp_path):
    recs = _eval(world, tmp_path / "o", "hf:plain", "hf:prompt-lookup", f"hf:assisted={world / 'draft'}",
                 temps=("0", "1"))
    by = {(r["drafter"].split("=")[0], r["temperature"]): r for r in recs}
    assert set(by) == {(d, t) for d in ("hf:plain", "hf:prompt-lookup", "hf:assisted") for t in (0.0, 1.0)}
    for (d, t), r in by.items():
        if t == 0:
            assert r["greedy_identical_to_plain"] == "2/2", d  # HF's greedy is the target's greedy
        # Each pass emits its accepted drafts plus one token (HF's prefill pass included).
        assert r["emitted_tokens"] == r["target_passes"] + r["accepted_tokens"], d
        assert r["accepted_tokens"] <= r["drafted_tokens"] and r["attempts"] == sorted(r["attempts"], reverse=True)
    plain = by[("hf:plain", 0.0)]
    assert plain["config"] == "plain T=0" and plain["tau"] == 1.0 and plain["drafted_tokens"] == 0
    assisted = by[("hf:assisted", 0.0)]
    assert assisted["drafted_tokens"] > 0 and assisted["k"] == 3 and len(assisted["alpha"]) == 3
    assert not any(r["speedup_above_tau"] for r in recs)  # HF is another loop: no tau bound on its speedup


def test_assisted_with_the_target_itself_accepts_everything(world, tmp_path):
    """The assistant = the target: at T=0 every drafted token must be counted accepted (the hook's bookkeeping)."""
    (r,) = _eval(world, tmp_path / "o", f"hf:assisted={world / 'target'}")
    assert r["drafted_tokens"] > 0 and r["accepted_tokens"] == r["drafted_tokens"]
    assert all(a == 1.0 for a in r["alpha"] if a is not None) and r["tau"] > 2


@pytest.mark.parametrize("spec", ["hf:assist", "hf:assisted", "hf:plain=x", "hf:"])
def test_bad_hf_specs_name_the_choices(spec, capsys):
    with pytest.raises(ValueError, match="hf:plain, hf:prompt-lookup, hf:assisted=DRAFT_MODEL_DIR"):
        parse_hf_spec(spec)
    assert cli_main(["eval", "--target", "x", "--drafter", spec, "--out", "/tmp/never-written-hf"]) != 0
    assert "hf:assisted=DRAFT_MODEL_DIR" in capsys.readouterr().err


def test_assisted_needs_a_separate_draft_model(world, tmp_path, capsys):
    assert cli_main(["eval", "--target", str(world / "target"), "--drafter", "hf:assisted=ngram",
                     "--prompts", str(world / "prompts.jsonl"), "--n", "1", "--out", str(tmp_path / "o")]) != 0
    assert "needs a separate draft model" in capsys.readouterr().err
