"""`spectrain eval`: prompt sets, bad input, report consistency, plots, wandb (offline)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_model

from spectrain.cli import main as cli_main
from spectrain.eval.harness import DecodeConfig, parse_tree
from spectrain.eval.prompts import PROMPT_SETS, PROMPTS_DIR, PromptSet, encode_prompts, load_prompt_set

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["what is two plus two? the answer is four.", "def add(x, y):\n    return x + y"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models on a shared 2-core box: one intra-op thread is ~10x faster than two contended ones.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_tiny_chat_world(d: Path) -> Path:
    """d/target (a saved tiny llama + BPE tokenizer with a chat template) and d/chat.jsonl (24 conversations)."""
    tok = _tiny_tokenizer()
    # 160 positions: the 300-token prompt below cannot fit, the short ones do.
    make_tiny_model("llama", vocab_size=len(tok), max_positions=160).save_pretrained(d / "target")
    tok.save_pretrained(d / "target")
    with open(d / "chat.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"what is {i} plus {i}? add them"},
                {"role": "assistant", "content": f"the answer is {2 * i}"}]}) + "\n")
    return d


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A saved tiny target (model + BPE tokenizer with a chat template), a recipe and two prompt files."""
    d = write_tiny_chat_world(tmp_path_factory.mktemp("eval"))
    (d / "recipe.yaml").write_text(
        f"target:\n  name_or_path: {d / 'target'}\ndata:\n  train_files: [{d / 'chat.jsonl'}]\n"
        "  heldout_fraction: 0.5\ndrafter:\n  kind: ngram\n")
    (d / "ood.jsonl").write_text("\n".join([
        json.dumps({"turns": ["def add(x, y): return x + y. def add(x, y): return"]}),
        "{not json",
        json.dumps({"turns": ["two plus " * 300]}),  # far longer than the context window
        json.dumps({"category": "x"}),  # no prompt text
        json.dumps({"prompt": "what is two plus two? what is two"}),
    ]) + "\n")
    return d


# ---- prompt sets ----------------------------------------------------------------------------------------


def test_shipped_sets_load_with_expected_counts():
    expected = {**{f"spec_bench/{c}": 80 for c in
                   ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")},
                "mt_bench": 80, "gsm8k": 1319, "humaneval": 164}
    assert set(expected) | {"heldout"} == set(PROMPT_SETS)
    for name, count in expected.items():
        ps = load_prompt_set(name)
        assert len(ps.prompts) == count, name
        assert ps.split == "OOD" and not ps.skipped, name
        msgs = ps.prompts[0]
        assert msgs[-1]["role"] == "user" and msgs[-1]["content"].strip(), name
    # HumanEval's user message is the function signature + docstring.
    assert load_prompt_set("humaneval").prompts[0][0]["content"].startswith("from typing import List")
    # --in-domain retags a public set; so does a recipe that trains on the set's own file.
    assert load_prompt_set("gsm8k", in_domain=("gsm8k",)).split == "in-domain"
    recipe = SimpleNamespace(data=SimpleNamespace(train_files=["somewhere/gsm8k_test.jsonl"]))
    assert load_prompt_set("gsm8k", recipe=recipe).split == "in-domain"
    assert load_prompt_set("humaneval", recipe=recipe).split == "OOD"


def test_malformed_lines_are_skipped_and_counted(tmp_path, workdir):
    ps = load_prompt_set(str(workdir / "ood.jsonl"))
    assert len(ps.prompts) == 3
    assert sum(ps.skipped.values()) == 2 and ps.bad_lines == [2, 4]
    # The same through a registered name, with --prompts-dir pointing at a damaged copy.
    lines = (PROMPTS_DIR / "mt_bench_question.jsonl").read_text().splitlines()
    (tmp_path / "mt_bench_question.jsonl").write_text("\n".join(lines[:3] + ["[1, 2", '{"turns": []}'] + lines[3:]))
    ps = load_prompt_set("mt_bench", prompts_dir=tmp_path)
    assert len(ps.prompts) == 80 and sum(ps.skipped.values()) == 2


def test_empty_set_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n" + json.dumps({"turns": [""]}) + "\n")
    with pytest.raises(ValueError, match=r"no usable prompts.*1 x malformed line \(not a JSON.*lines 1, 2"):
        load_prompt_set(str(bad))
    assert cli_main(["eval", "--target", "unused", "--prompts", str(bad)]) == 2
    assert "no usable prompts" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown prompt set 'nope'"):
        load_prompt_set("nope")
    with pytest.raises(ValueError, match="--recipe"):
        load_prompt_set("heldout")


def test_too_long_prompts_are_skipped_or_truncated(workdir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(workdir / "target")
    ps = PromptSet("x", "OOD", [[{"role": "user", "content": "two plus " * 100}],
                                [{"role": "user", "content": "two"}]], source="test")
    ids = encode_prompts(ps, tok, 5, max_len=50)
    assert len(ids) == 1 and ps.skipped == {"prompt too long for the context window": 1}
    assert tok.decode(ids[0]) == "<|user|>two</s><|assistant|>"  # rendered with the chat template
    ps.skipped.clear()
    ids = encode_prompts(ps, tok, 5, max_len=50, max_prompt_tokens=30)
    assert len(ids) == 2 and 25 <= len(ids[0]) <= 30 and ps.truncated == 1 and not ps.skipped
    # The middle of the message is cut; the chat template around it stays intact.
    text = tok.decode(ids[0])
    assert text.startswith("<|user|>two plus") and " ... " in text and text.endswith("plus </s><|assistant|>")
    ps.prompts = ps.prompts[:1]
    with pytest.raises(ValueError, match="every prompt is longer"):
        encode_prompts(ps, tok, 5, max_len=50)


def test_default_mix_drops_a_set_that_cannot_fit_but_a_named_one_fails(workdir):
    from transformers import AutoTokenizer

    from spectrain.eval.harness import _encode_all

    tok = AutoTokenizer.from_pretrained(workdir / "target")

    def sets():
        return [PromptSet("short", "OOD", [[{"role": "user", "content": "two"}]], source="t"),
                PromptSet("long", "OOD", [[{"role": "user", "content": "two plus " * 100}]], source="t")]

    args = SimpleNamespace(prompts=None, n=2, max_prompt_tokens=None, no_chat_template=False)
    kept = sets()
    assert list(_encode_all(kept, tok, 50, args)) == ["short"] and [p.name for p in kept] == ["short"]
    assert args.dropped_sets[0]["name"] == "long" and "--max-prompt-tokens" in args.dropped_sets[0]["reason"]
    args = SimpleNamespace(prompts=["short", "long"], n=2, max_prompt_tokens=None, no_chat_template=False)
    with pytest.raises(ValueError, match="'long': every prompt is longer than the 50 tokens"):
        _encode_all(sets(), tok, 50, args)


@pytest.mark.parametrize("argv, msg", [
    (["--k", "0"], "--k must be >= 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in"),
    (["--n", "0"], "--n must be >= 1"),
    (["--tree", "topk=4,depth=x"], "--tree"),
    (["--cost-ratio", "-0.1"], "--cost-ratio"),
])
def test_bad_arguments_fail_before_loading(argv, msg, capsys):
    assert cli_main(["eval", "--target", "does/not/exist", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_parse_tree():
    assert parse_tree("topk=4,depth=5,total=32") == {"topk": 4, "depth": 5, "total_tokens": 32}
    assert parse_tree("depth=3,topk=2") == {"topk": 2, "depth": 3, "total_tokens": 6}
    with pytest.raises(ValueError, match="needs at least"):
        parse_tree("total=8")


def test_record_formulas():
    from spectrain.decoding.stats import DecodeStats
    from spectrain.eval.report import make_record

    s = DecodeStats(k=2, attempts=[10, 6], accepts=[6, 3], drafted=20, target_passes=10, emitted=19,
                    draft_time_s=1.0, target_time_s=10.0)
    ps = PromptSet("p", "held-out", [[]] * 4, source="t")
    res = {"stats": s, "tokens": 19, "seconds": 2.0, "outputs": [[1]] * 4}
    base = {"tokens": 20, "seconds": 4.0, "outputs": [[1]] * 4}
    r = make_record("d", DecodeConfig(2, None, 0.0), ps, res, base, cost_ratio=None)
    assert r["alpha"] == [0.6, 0.5] and r["tau"] == pytest.approx(1.9) and r["acceptance_rate"] == 9 / 20
    assert r["c"] == pytest.approx(1.0 / (2 * 10.0)) and r["c_source"] == "measured in this run"
    assert r["predicted_speedup"] == pytest.approx(1.9 / (1 + 2 * 0.05))
    assert r["measured_speedup"] == pytest.approx((19 / 2.0) / (20 / 4.0))
    assert r["greedy_identical_to_plain"] == "4/4"
    r = make_record("d", DecodeConfig(3, None, 1.0), ps, res, base, cost_ratio=0.1)
    assert r["c"] == 0.1 and r["c_source"].startswith("user") and len(r["alpha"]) == 3 and r["alpha"][2] is None
    assert r["predicted_speedup"] == pytest.approx(1.9 / 1.3) and "greedy_identical_to_plain" not in r


# ---- end to end ---------------------------------------------------------------------------------------------


def _run(workdir: Path, out: Path, *extra: str) -> dict:
    torch.manual_seed(0)
    argv = ["eval", "--recipe", str(workdir / "recipe.yaml"), "--drafter", "ngram",
            "--prompts", "heldout", "--prompts", str(workdir / "ood.jsonl"), "--n", "2",
            "--max-new-tokens", "8", "--k", "3", "--out", str(out), *extra]
    assert cli_main(argv) == 0
    return json.loads((out / "report.json").read_text())


def test_end_to_end_report(workdir, tmp_path):
    rep = _run(workdir, tmp_path / "out", "--temperature", "0", "--temperature", "1")
    recs, meta = rep["records"], rep["meta"]
    assert [(r["prompt_set"], r["split"], r["temperature"]) for r in recs] == [
        ("heldout", "held-out", 0.0), ("ood", "OOD", 0.0), ("heldout", "held-out", 1.0), ("ood", "OOD", 1.0)]
    for r in recs:
        assert r["n_prompts"] == 2 and len(r["alpha"]) == 3 and r["k"] == 3
        assert r["tau"] == pytest.approx(r["emitted_tokens"] / r["target_passes"]) == pytest.approx(r["tau_decoder"])
        # Each pass emits its accepted tokens plus one; only an eos inside a draft can cut one short.
        passes, acc = r["target_passes"], r["accepted_tokens"]
        assert passes + acc - r["n_prompts"] <= r["emitted_tokens"] <= passes + acc
        assert r["accepted_tokens"] <= r["drafted_tokens"]
        if r["drafted_tokens"]:
            assert r["acceptance_rate"] == pytest.approx(r["accepted_tokens"] / r["drafted_tokens"])
        for a, n, alpha in zip(r["accepts"], r["attempts"], r["alpha"]):
            assert alpha is None if n == 0 else alpha == pytest.approx(a / n)
        assert r["attempts"] == sorted(r["attempts"], reverse=True)  # position i+1 needs position i accepted
        assert r["measured_speedup"] == pytest.approx(r["tokens_per_s"] / r["baseline_tokens_per_s"])
        assert r["predicted_speedup"] == pytest.approx(r["tau"] / (1 + 3 * r["c"]))
        assert r["c_source"] == "measured in this run"
        assert r["tau_ci"][0] <= r["tau"] <= r["tau_ci"][1] and len(r["alpha_ci"]) == 3  # bootstrap over prompts
        assert r["target_mean_tokens"] > 0 and 0 <= r["target_repeated_4gram_share"] <= 1
    greedy = [r for r in recs if r["temperature"] == 0]
    assert all(r["greedy_identical_to_plain"] == "2/2" for r in greedy)  # lossless: same tokens as plain
    assert recs[1]["skipped"] == {"malformed line (not a JSON object)": 1,
                                  "malformed line (no usable prompt text)": 1,
                                  "prompt too long for the context window": 1}
    assert {"target", "versions", "seed", "date_utc", "conventions", "drafters"} <= set(meta)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "tau**: tokens emitted per target forward pass, INCLUDING the bonus" in md and "| heldout | held-out |" in md
    header, rule, row = [ln for ln in md.splitlines() if ln.startswith("| ngram") or ln.startswith("| drafter")
                         or ln.startswith("|---|---|---|---|---|---|---|---|")][:3]
    assert header.count("|") == rule.count("|") == row.count("|")  # every column has a header
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert pngs == ["acceptance_ngram_k=3_T=0.png", "acceptance_ngram_k=3_T=1.png", "tau.png"]
    for p in pngs:
        assert (tmp_path / "out" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_offline_run_writes_files(workdir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    _run(workdir, tmp_path / "out", "--temperature", "0", "--report-to", "wandb", "--cost-ratio", "0.05", "--n", "1")
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    tables = [p.name for p in runs[0].rglob("*.table.json")]
    assert any(n.startswith("report") for n in tables) and any("acceptance" in str(p) for p in runs[0].rglob("*"))


def test_drafter_none_runs_the_plain_baseline_only(workdir, tmp_path):
    out = tmp_path / "plain"
    argv = ["eval", "--target", str(workdir / "target"), "--drafter", "none", "--prompts", str(workdir / "ood.jsonl"),
            "--n", "1", "--max-new-tokens", "4", "--temperature", "0", "--out", str(out)]
    assert cli_main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["records"] == [] and 1 <= rep["meta"]["baselines"][0]["tokens"] <= 4
    assert [b["decoder"] for b in rep["meta"]["baselines"]] == ["spectrain plain loop", "HF generate plain"]
    assert "## Plain decoders" in (out / "report.md").read_text()

