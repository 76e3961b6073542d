"""`spectrain compare` refuses what is not comparable: other settings tau depends on (one line listing each
difference), impossible counts and per-prompt lists of different lengths (naming the file and the field);
harmless differences are printed above the table."""

from __future__ import annotations

import json

import pytest

from spectrain.cli import main as cli_main

IDS = ["x", "y", "z"]
META = {"target": "assets/reference-target", "target_architecture": "LlamaForCausalLM", "target_parameters": 1000,
        "max_new_tokens": 64, "dtype": "float32", "top_p": 1.0, "top_k": 0, "seed": 0, "device": "cpu",
        "n_per_set": 3, "command": "spectrain eval --target assets/reference-target --drafter ngram",
        "prompt_sets": [{"name": "heldout", "split": "held-out", "source": "data/heldout.jsonl", "n_prompts": 3}]}


def rec(tokens=(10, 12, 9), passes=(9, 10, 8), ids=IDS, **kw):
    per = {"tokens": list(tokens), "passes": list(passes)}
    if ids is not None:
        per["ids"] = list(ids)
    return {"drafter": "ngram", "config": "k=3 T=0", "prompt_set": "heldout", "split": "held-out",
            "per_prompt": per, **kw}


def write(tmp_path, name, meta=None, records=None):
    d = tmp_path / name
    d.mkdir()
    (d / "report.json").write_text(json.dumps({"meta": {**META, **(meta or {})}, "records": records or [rec()]}))
    return d


def run(capsys, a, b) -> tuple[int, str, str]:
    rc = cli_main(["compare", str(a), str(b)])
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def refused(capsys, a, b) -> str:
    rc, out, err = run(capsys, a, b)
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err and "verdict" not in out
    return err


@pytest.mark.parametrize("change, shown", [
    ({"max_new_tokens": 128}, "max_new_tokens 64 vs 128"),
    ({"dtype": "bfloat16"}, "dtype float32 vs bfloat16"),
    ({"target_parameters": 2000}, "target parameters 1000 vs 2000"),
    ({"target": "models/other-model"}, "target assets/reference-target vs models/other-model"),
    ({"command": META["command"] + " --no-chat-template"}, "chat template use the target's vs none (--no-chat-template)"),
    ({"top_p": 0.9}, "top_p 1.0 vs 0.9"),
])
def test_settings_tau_depends_on_are_refused(tmp_path, capsys, change, shown):
    err = refused(capsys, write(tmp_path, "a"), write(tmp_path, "b", change))
    assert "not comparable" in err and shown in err


def test_fingerprints_decide_and_every_difference_is_listed(tmp_path, capsys):
    a = write(tmp_path, "a", {"target_fingerprint": "v2-aaa"})
    b = write(tmp_path, "b", {"target_fingerprint": "v2-bbb", "max_new_tokens": 32, "dtype": "bfloat16"})
    err = refused(capsys, a, b)
    assert all(x in err for x in ("target fingerprint v2-aaa vs v2-bbb", "max_new_tokens 64 vs 32", "dtype float32"))
    # the same fingerprint under another name: the same target, shown
    b = write(tmp_path, "c", {"target_fingerprint": "v2-aaa", "target": "/elsewhere/copy"})
    rc, out, _ = run(capsys, a, b)
    assert rc == 0 and "note: target assets/reference-target vs /elsewhere/copy" in out


def test_a_recorded_chat_template_is_compared(tmp_path, capsys):
    a, b = write(tmp_path, "a", {"chat_template": "sha256:aa"}), write(tmp_path, "b", {"chat_template": "sha256:bb"})
    assert "chat template sha256:aa vs sha256:bb" in refused(capsys, a, b)
    rc, out, _ = run(capsys, a, write(tmp_path, "c"))  # recorded by one report only: shown as unchecked
    assert rc == 0 and "note: chat template recorded only by A (sha256:aa): not checked" in out


def test_harmless_differences_are_printed_above_the_table(tmp_path, capsys):
    a = write(tmp_path, "a")
    b = write(tmp_path, "b", {"seed": 1, "target": "/abs/path/assets/reference-target", "prompt_sets": [
        {"name": "heldout", "split": "held-out", "source": "other/heldout.jsonl", "n_prompts": 5}]})
    rc, out, _ = run(capsys, a, b)
    assert rc == 0
    notes, table = out.index("note: seed 0 vs 1"), out.index("| config |")
    assert notes < table and "prompt set heldout: source data/heldout.jsonl vs other/heldout.jsonl" in out
    assert "note: target assets/reference-target vs /abs/path/assets/reference-target" in out


def test_another_prompt_set_paired_by_position_is_refused(tmp_path, capsys):
    a = write(tmp_path, "a", records=[rec(ids=None)])
    b = write(tmp_path, "b", {"prompt_sets": [{"name": "heldout", "source": "other.jsonl", "n_prompts": 3}]},
              records=[rec(ids=None)])
    assert "prompt set heldout: source data/heldout.jsonl vs other.jsonl" in refused(capsys, a, b)


@pytest.mark.parametrize("tokens, passes, field, says", [
    ([10, float("nan"), 9], [9, 10, 8], "records[0].per_prompt.tokens[1]", "is nan"),
    ([10, 12, 9], [9, float("inf"), 8], "records[0].per_prompt.passes[1]", "is inf"),
    ([10, -12, 9], [9, 10, 8], "records[0].per_prompt.tokens[1]", "whole number >= 0"),
    ([10, 12.5, 9], [9, 10, 8], "records[0].per_prompt.tokens[1]", "whole number >= 0"),
    ([10, "12", 9], [9, 10, 8], "records[0].per_prompt.tokens[1]", "not a number"),
    ([10, 12, 9], [9, 0, 8], "records[0].per_prompt.passes[1]", "is 0 while tokens[1] is 12"),
    ([10, 12, 9], [9, 10], "records[0].per_prompt", "lists disagree in length (tokens has 3, passes has 2, ids has 3"),
])
def test_impossible_counts_are_refused_naming_file_and_field(tmp_path, capsys, tokens, passes, field, says):
    good = write(tmp_path, "good")
    bad = write(tmp_path, "bad", records=[rec(tokens, passes)])
    err = refused(capsys, good, bad)
    assert f"{bad / 'report.json'}: {field} " in err and says in err


def test_a_missing_field_and_mismatched_ids_are_named(tmp_path, capsys):
    good = write(tmp_path, "good")
    r = rec()
    del r["config"]
    assert "records[0].config is missing" in refused(capsys, good, write(tmp_path, "noconfig", records=[r]))
    short_ids = write(tmp_path, "ids", records=[rec(ids=["x", "y"])])
    assert "records[0].per_prompt lists disagree in length" in refused(capsys, short_ids, good)
