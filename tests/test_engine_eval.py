"""The engine grid's arithmetic without the engine: counters -> spectrain's metrics, conformance, prediction."""

from __future__ import annotations

import pytest

from spectrain.engines.server import Completion
from spectrain.eval import conformance
from spectrain.eval.engine import _predict, _stats, engine_markdown, one_prediction, resolve_drafter


def _completion(**kw) -> Completion:
    base = dict(tokens=list(range(16)), text="", predicted_n=16, predicted_per_second=100.0, predicted_ms=160.0)
    return Completion(**{**base, **kw})


def test_engine_counters_become_conditional_acceptance():
    # 5 steps of k = 3: per position accepted on 4, 2, 1 steps -> alpha = 4/5, 2/4, 1/2
    s = _stats(_completion(drafts=5, draft_n=15, draft_n_accepted=7, accepted_per_pos=[4, 2, 1]), 3)
    assert s.attempts == [5, 4, 2] and s.accepts == [4, 2, 1]
    assert s.alpha == [0.8, 0.5, 0.5]
    # 16 tokens: 1 from the prefill pass, 5 steps emitting 5 + 7, then 3 steps without a draft
    assert s.target_passes == 1 + 5 + 3 and s.emitted == 16


def test_a_drafter_that_never_drafts_has_tau_one():
    s = _stats(_completion(), 2)
    assert s.tau == 1.0 and s.attempts == [0, 0]


def test_prediction_uses_the_cost_curve_and_the_drafts_own_time():
    rec = {"tau": 2.0, "target_passes": 10, "draft_time_s": 0.02}  # 2 ms of drafting per step
    curve = {1: 0.010, 3: 0.014}
    assert _predict(rec, curve, 2) == pytest.approx(2.0 * 0.010 / (0.014 + 0.002))
    assert _predict(rec, curve, 5) is None  # no cost measured for t = 6


def test_an_engine_record_has_one_prediction_the_cost_curves_and_its_column_says_so():
    """The harness's tau / (1 + k c) (here 2 / 1.2 = 1.67x) is replaced by the curve's 1.25x, not shown beside it."""
    rec = {"drafter": "exports/e3", "config": "k=2 T=0", "prompt_set": "mt_bench", "alpha": [0.7, 0.4], "tau": 2.0,
           "c": 0.1, "target_passes": 10, "draft_time_s": 0.02, "predicted_speedup": 2.0 / 1.2,
           "measured_speedup": 1.1}
    one_prediction(rec, {1: 0.010, 3: 0.014}, 2)
    assert rec["predicted_speedup"] == pytest.approx(1.25)
    assert [key for key in rec if key.startswith("predicted_speedup")] == ["predicted_speedup"]
    md = engine_markdown({"engine": "b1", "cost_curve": {"depth": 64, "seconds": {"1": 0.010, "3": 0.014}}}, [rec])
    head, _, row = md.strip().splitlines()[-3:]
    assert [c.strip() for c in head.split("|") if "predicted" in c] == ["predicted (measured cost curve)",
                                                                        "measured / predicted"]
    assert "| 1.25x | 1.10x | 0.88 |" in row and "1.67" not in md


def _rec(alpha, ci, drafter="runs/x", k=2, t=0.0, s="mt_bench"):
    return {"drafter": drafter, "prompt_set": s, "k": k, "temperature": t, "alpha": alpha, "alpha_ci": ci,
            "attempts": [10] * len(alpha), "tau": 1.5}


def test_conformance_flags_an_engine_alpha_outside_spectrains_interval():
    own = [_rec([0.4, 0.3], [[0.3, 0.5], [0.2, 0.4]]), _rec([0.9], [[0.8, 1.0]], drafter="ngram")]
    engine = [_rec([0.45, 0.6], [None, None], drafter="exports/e3"), _rec([0.1], [None], drafter="ngram")]
    rows = conformance.alpha_rows(own, engine)
    assert [(r["position"], r["inside"]) for r in rows] == [(1, True), (2, False)]  # n-gram rows not paired
    assert "NO" in conformance.markdown(rows, None)


def test_greedy_agreement_counts_identical_answers_and_shared_prefixes():
    g = conformance.greedy_agreement([[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 9, 3]])
    assert g["identical"] == 1 and g["shared_prefix"] == [3, 1]


def test_bad_drafters_and_reports_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a spectrain eval report"):
        conformance.load_records(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="neither"):
        resolve_drafter(str(tmp_path), "t.gguf", tmp_path)


@pytest.mark.parametrize("quant,weights", [("Q8_0", "q8_0"), ("F32", "f32")])
def test_a_draft_gguf_is_served_as_a_draft_lm_with_its_weight_type_recorded(tmp_path, quant, weights):
    from gguf_fixture import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "draft.gguf", quant=quant)
    d = resolve_drafter(str(path), "t.gguf", tmp_path)
    assert (d.model, d.spec_type, d.weight_type) == (path, "draft-simple", weights)


# ---- what `eval --engine` refuses, honours and records (fake llama-server + fake llama-bench, a tiny GGUF) --------

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import fake_llama_server as fake  # noqa: E402

from spectrain import registry  # noqa: E402
from spectrain.cli import main as cli_main  # noqa: E402
from spectrain.engines import llama_cpp  # noqa: E402
from spectrain.eval import engine as E  # noqa: E402
from spectrain.io.integrity import IntegrityError, seal  # noqa: E402

BENCH = """#!{python}
import json, sys
a = sys.argv[1:]
open({log!r}, "a").write(json.dumps(a) + "\\n")
print(json.dumps([{{"n_prompt": int(t), "avg_ns": 1e6 * (1 + 0.2 * int(t))}} for t in a[a.index("-p") + 1].split(",")]))
"""


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A fake engine (llama-server + llama-bench) that `require()` returns, and a tiny GGUF target (context 512)."""
    from gguf_fixture import write_tiny_gguf

    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECTRAIN_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    engine = fake.install(tmp_path / "engine")
    bench = engine.binary("llama-bench")
    bench.write_text(BENCH.format(python=sys.executable, log=str(tmp_path / "bench.log")))
    bench.chmod(0o755)
    (engine.root / "build.json").write_text(json.dumps({"options": {}, "build_seconds": 1.0, "jobs": 1}))
    monkeypatch.setattr(llama_cpp, "require", lambda: engine)
    return engine, write_tiny_gguf(tmp_path / "target.gguf")


def _eval(gguf: Path, *extra: str) -> int:
    return cli_main(["eval", "--engine", "llama.cpp", "--target", str(gguf), "--drafter", "ngram", "--k", "1",
                     "--max-new-tokens", "4", *extra])


def _one_line(err: str, *words: str) -> None:
    lines = [x for x in err.strip().splitlines() if "error" in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), err


@pytest.mark.parametrize("flags", [["--tree", "topk=2,depth=2,total=4"], ["--batch-size", "2"], ["--cost-curve"],
                                   ["--dtype", "float32"], ["--cost-ratio", "0.1"], ["--device", "cpu"],
                                   ["--gpu", "h100"], ["--sweep-repeats", "2"], ["--report-to", "tensorboard"]])
def test_options_the_engine_cannot_honour_are_refused_before_anything(flags, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(llama_cpp, "require", lambda: pytest.fail("the engine was asked for"))
    monkeypatch.chdir(tmp_path)
    assert _eval(tmp_path / "t.gguf", *flags) == 2
    _one_line(capsys.readouterr().err, f"{flags[0]} is not supported with --engine llama.cpp", "without --engine")


def test_top_p_top_k_and_repeats_reach_the_engine_and_long_prompts_are_skipped(served, tmp_path, capsys):
    engine, gguf = served
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n"
                               for text in ["Say hi.", "word " * 600, "Count to three."]))
    out = tmp_path / "ev"
    assert _eval(gguf, "--prompts", str(prompts), "--temperature", "1", "--top-p", "0.9", "--top-k", "5",
                 "--repeats", "2", "--n", "2", "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert "note: p: 1 prompts longer than" in err and "context of 512" in err
    completions = [r for r in fake.requests(engine.root) if "n_predict" in r]
    assert len(completions) == 2 * 2 * 2  # 2 prompts x (plain + k=1) x 2 repeats
    assert {(r["top_k"], r["top_p"], r["min_p"], r["temperature"]) for r in completions} == {(5, 0.9, 0.0, 1.0)}
    rep = json.loads((out / "report.json").read_text())
    assert (rep["meta"]["top_p"], rep["meta"]["top_k"], rep["meta"]["repeats"]) == (0.9, 5, 2)
    assert rep["meta"]["engine_context"] == 512
    (rec,) = rep["records"]
    assert rec["drafter"] == "ngram" and len(rec["measured_speedup_repeats"]) == 2 and rec["n_prompts"] == 2
    assert rec["skipped"] == {"prompt too long for the context window": 1}
    depth = json.loads((tmp_path / "bench.log").read_text().splitlines()[0])
    assert int(depth[depth.index("-d") + 1]) <= 512 - 16  # never an absurd depth


def _checkpoint(d: Path, sealed: bool = True) -> Path:
    d.mkdir(parents=True)
    (d / "drafter_config.json").write_text(json.dumps({"kind": "eagle3"}))
    import torch
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    if sealed:
        seal(d)
    return d


@pytest.fixture
def fake_export(monkeypatch):
    """The llama.cpp exporter replaced by one writing a tiny draft GGUF (no converter here)."""
    from gguf_fixture import write_tiny_gguf

    def export(src, out, target):
        out.mkdir(parents=True)
        write_tiny_gguf(out / "model.gguf")

    real = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda ref: export if "llama_cpp" in ref else real(ref))


def test_a_run_is_named_by_what_the_user_gave_not_its_temporary_export(tmp_path, fake_export):
    ckpt = _checkpoint(tmp_path / "run" / "best")
    d = E.resolve_drafter(str(tmp_path / "run"), "t.gguf", tmp_path / "work")
    assert d.name == str(tmp_path / "run") and d.model.parent.parent == tmp_path / "work"
    assert ckpt.is_dir()


def test_a_checkpoint_plain_eval_refuses_is_not_exported_or_served(tmp_path, fake_export):
    unsealed = _checkpoint(tmp_path / "u", sealed=False)
    with pytest.raises(IntegrityError, match="no SHA256SUMS"):
        E.resolve_drafter(str(unsealed), "t.gguf", tmp_path / "w")
    damaged = _checkpoint(tmp_path / "d")
    (damaged / "drafter_config.json").write_text(json.dumps({"kind": "eagle3", "edited": True}))
    with pytest.raises(IntegrityError, match="drafter_config.json is corrupt"):
        E.resolve_drafter(str(damaged), "t.gguf", tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_an_export_whose_manifest_fails_is_not_served(tmp_path):
    from gguf_fixture import write_tiny_gguf

    export = tmp_path / "exp"
    export.mkdir()
    write_tiny_gguf(export / "model.gguf")
    seal(export)
    assert E.resolve_drafter(str(export), "t.gguf", tmp_path).model == export / "model.gguf"
    with open(export / "model.gguf", "ab") as f:
        f.write(b"\0")
    for spec in (export, export / "model.gguf"):
        with pytest.raises(IntegrityError, match="model.gguf is corrupt"):
            E.resolve_drafter(str(spec), "t.gguf", tmp_path)


def _report(path: Path, target: str, sets=("mt_bench",)) -> Path:
    path.write_text(json.dumps({"meta": {"target": target}, "records": [
        {"drafter": "runs/x", "prompt_set": s, "k": 1, "temperature": 0.0, "alpha": [0.5], "attempts": [4]}
        for s in sets]}))
    return path


def test_conform_to_refuses_another_targets_report_and_one_without_a_shared_set(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(llama_cpp, "require", lambda: pytest.fail("the engine was asked for"))
    monkeypatch.chdir(tmp_path)
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF one")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF two")
    for rep, words in ((_report(tmp_path / "a.json", str(other)), ["evaluated the target", str(other)]),
                       (_report(tmp_path / "b.json", "models/elsewhere/x.gguf"), ["evaluated the target"]),
                       (_report(tmp_path / "c.json", str(gguf), sets=("humaneval",)), ["no prompt set", "humaneval"])):
        assert _eval(gguf, "--prompts", "mt_bench", "--conform-to", str(rep)) == 2
        _one_line(capsys.readouterr().err, *words)
    copy = tmp_path / "copy" / "t.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    for same in (str(gguf), str(copy), "gone/elsewhere/t.gguf"):  # the file, a copy, a report made elsewhere
        E.check_conform_to(_report(tmp_path / "ok.json", same), gguf, ["mt_bench"])
    assert os.path.exists(gguf)
