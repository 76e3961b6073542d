"""GGUF targets: dequantized once into a cached checkpoint, loaded like any target, fingerprinted as GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

from gguf_fixture import write_tiny_gguf  # noqa: E402

from spectrain.targets import gguf as gguf_target  # noqa: E402
from spectrain.targets.model import load_target  # noqa: E402

SMOLLM2 = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cache(shared_cache, monkeypatch) -> Path:
    """One conversion shared by the module's tests (each conversion costs seconds)."""
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(shared_cache))
    return shared_cache


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_target_is_dequantized_once_and_matches_transformers(tiny_gguf, fresh_cache, monkeypatch):
    from transformers import AutoModelForCausalLM

    target = load_target(str(tiny_gguf), device="cpu")
    assert target.gguf["quant_type"] == "Q8_0" and len(target.gguf["gguf_sha256"]) == 64
    assert target.name_or_path == str(tiny_gguf)  # what the user named is what configs record
    converted = list((fresh_cache / "gguf").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()  # no .tmp-* left behind

    direct = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                  dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    assert torch.allclose(target.model(ids).logits, direct(ids).logits, atol=1e-5)

    def no_second_conversion(*a, **k):
        raise AssertionError("the cached checkpoint should have been reused")

    monkeypatch.setattr(gguf_target, "_convert", no_second_conversion)
    again = load_target(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, device="cpu")  # dir + file form
    assert again.gguf == target.gguf


def test_gguf_fingerprint_names_the_gguf(tiny_gguf, cache):
    from spectrain.targets.fingerprint import target_fingerprint

    target = load_target(str(tiny_gguf), device="cpu")
    plain = load_target(target.load_path, device="cpu")  # the same weights
    plain.gguf = None  # ... seen as an ordinary checkpoint
    assert target_fingerprint(target) != target_fingerprint(plain)


def test_v1_values_of_the_first_gguf_release_still_match(tiny_gguf, cache):
    """Caches and heads written by the first GGUF release hold a v1 value that also hashed the GGUF file;
    they must still be recognised (the SmolLM2 head and feature cache of that release were warned about /
    refused as 'another target' until this was fixed)."""
    import hashlib
    import json

    import torch

    from spectrain.targets.fingerprint import same_target

    target = load_target(str(tiny_gguf), device="cpu")
    h = hashlib.sha256(json.dumps([target.num_layers, target.hidden_size, target.vocab_size]).encode())
    h.update(json.dumps([target.gguf["gguf_sha256"], target.gguf["quant_type"]]).encode())  # that release's formula
    for w in (target.norm.weight, target.lm_head.weight[:64], target.embed_tokens.weight[:64]):
        h.update(w.detach().to(torch.bfloat16).float().numpy().tobytes())
    recorded = h.hexdigest()[:32]
    assert same_target(recorded, target) is True
    plain = load_target(target.load_path, device="cpu")
    plain.gguf = None  # the same weights seen as a plain checkpoint never matched that value
    assert same_target(recorded, plain) is False


def test_gguf_errors_name_the_fix(tiny_gguf, fresh_cache, monkeypatch, tmp_path):
    with pytest.raises(FileNotFoundError, match="spectrain target fetch smollm2-135m"):
        load_target(str(tmp_path / "missing.gguf"), device="cpu")
    with pytest.raises(FileNotFoundError, match="tiny.Q8_0.gguf"):  # the dir's GGUF files are listed
        load_target(str(tiny_gguf.parent), gguf_file="other.gguf", device="cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(ImportError, match="pip install gguf"):
        load_target(str(tiny_gguf), device="cpu")


def test_gguf_without_tokenizer_is_refused(tiny_gguf, fresh_cache, monkeypatch):
    import transformers

    def no_tokenizer(*a, **k):
        raise KeyError("tokenizer.ggml.model")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    with pytest.raises(ValueError, match="carries no tokenizer"):
        gguf_target.resolve_target_path(str(tiny_gguf))
    assert not any((fresh_cache / "gguf").iterdir())  # nothing half-written


def test_eval_cli_on_a_gguf_target(tiny_gguf, cache, tmp_path):
    from spectrain.cli import main

    out = tmp_path / "eval"
    rc = main(["eval", "--target", str(tiny_gguf), "--drafter", "ngram", "--prompts", "mt_bench", "--n", "1",
               "--max-new-tokens", "6", "--temperature", "0", "--k", "2", "--out", str(out)])
    assert rc == 0 and (out / "report.json").is_file()


def test_recipe_takes_a_gguf_target(tiny_gguf, cache):
    from spectrain.cli import main

    assert main(["check", "tiny/medusa", f"target.name_or_path={tiny_gguf}", "data.max_rows=64"]) == 0


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.is_file(), reason="SmolLM2 GGUF absent: `spectrain target fetch smollm2-135m`")
def test_smollm2_greedy_answer():
    target = load_target(str(SMOLLM2), device="cpu")
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    tok = target.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = target.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
