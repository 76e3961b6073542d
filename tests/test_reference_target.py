"""The bundled reference target loads offline with plain transformers, chats, and stops at <|end|>."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# SPECTRAIN_REFERENCE_TARGET lets a fresh build be checked before it replaces the bundled one.
REF = Path(os.environ.get("SPECTRAIN_REFERENCE_TARGET",
                         Path(__file__).resolve().parents[1] / "assets" / "reference-target"))

pytestmark = pytest.mark.skipif(
    not (REF / "config.json").exists(),
    reason=f"{REF} is absent: build it with `python scripts/build_reference_target.py` (~45 min on 2 CPU cores)",
)


@pytest.fixture(scope="module")
def ref():
    # No network: the target must load from the directory alone.
    old = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(REF)
        model = AutoModelForCausalLM.from_pretrained(REF).eval()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return model, tok


def test_architecture_and_size(ref):
    model, tok = ref
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers >= 8  # EAGLE-3's default aux layers 2, N//2, N-3 must be distinct
    n = cfg.num_hidden_layers
    assert len({2, n // 2, n - 3}) == 3
    assert cfg.vocab_size == len(tok) == 8192
    size = sum(f.stat().st_size for f in REF.iterdir() if f.is_file())
    assert size < 40 * 2**20, f"reference target is {size / 2**20:.1f} MB; keep it under 40 MB"


def test_special_tokens_and_eos(ref):
    model, tok = ref
    end = tok.convert_tokens_to_ids("<|end|>")
    assert tok.eos_token == "<|end|>" and tok.eos_token_id == end
    assert model.generation_config.eos_token_id == end
    assert tok.pad_token_id is not None and model.generation_config.pad_token_id == tok.pad_token_id
    for t in ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, f"{t} must be a single special token, got {ids}"


def test_chat_template_renders_and_ends_with_assistant_prompt(ref):
    _, tok = ref
    cfg = json.loads((REF / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg, "the chat template must live in tokenizer_config.json"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n"
                    "<|assistant|>\nHello!<|end|>\n<|user|>\nName a colour.<|end|>\n<|assistant|>\n")
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly
    enc = tok.apply_chat_template(msgs[:3], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(masked) == "Hello!<|end|>"


def test_greedy_generate_stops_at_end_of_turn(ref):
    model, tok = ref
    torch.manual_seed(0)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  tokenize=True, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert new and new[-1] == tok.eos_token_id, "the trained target should end its answer with <|end|>"
    text = tok.decode(new, skip_special_tokens=True).strip()
    assert text, "empty answer"
    # Greedy decoding is deterministic.
    again = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False)
    assert torch.equal(out, again)
