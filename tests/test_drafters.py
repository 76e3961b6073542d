"""n-gram and draft-LM drafters, vocabulary checks, load_drafter dispatch."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model, make_tiny_target

from spectrain import registry
from spectrain.decoding.interface import DraftContext, Drafter
from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.decoding.sampling import Sampler
from spectrain.drafters import load_drafter
from spectrain.drafters.draft_lm import DraftLMDrafter
from spectrain.drafters.ngram import NgramDrafter

torch.set_num_threads(1)


def make_tokenizer(vocab: int = 128, rename: dict | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, vocab)]
    for i, w in (rename or {}).items():
        words[i] = w
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def ctx_for(tokens, k=3, tree=None):
    return DraftContext(tokens=torch.tensor(tokens), k=k, sampler=Sampler(), tree=tree)


def test_ngram_spec_parsing():
    d = NgramDrafter.from_spec("ngram")
    assert (d.max_n, d.min_n, d.k) == (3, 1, None)
    d = load_drafter("ngram:n=4,min_n=2,k=6", target=None)
    assert (d.max_n, d.min_n, d.k) == (4, 2, 6)
    with pytest.raises(ValueError, match="valid: n"):
        NgramDrafter.from_spec("ngram:depth=3")
    with pytest.raises(ValueError, match="integer"):
        NgramDrafter.from_spec("ngram:n=three")
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter.from_spec("ngram:n=1,min_n=2")


def test_ngram_longest_most_recent_match_and_tree():
    toks = [1, 2, 3, 4, 9, 2, 3, 4, 7, 8, 2, 3]
    d = NgramDrafter(max_n=3)
    assert d.propose(ctx_for(toks)).tokens.tolist() == [4, 7, 8]  # "2 3" most recently followed by 4 7 8
    assert NgramDrafter(max_n=3, k=2).propose(ctx_for(toks)).tokens.tolist() == [4, 7]
    # the longer suffix wins over a more recent shorter one
    toks2 = [5, 6, 7, 1, 1, 9, 6, 7, 2, 5, 6, 7]
    assert d.propose(ctx_for(toks2)).tokens.tolist() == [1, 1, 9]
    assert len(d.propose(ctx_for([1, 2, 3, 4]))) == 0  # nothing repeats: no proposal
    tree = d.propose(ctx_for(toks, tree={"topk": 2}))
    assert tree.tokens.tolist() == [4, 7, 8, 9, 2] and tree.parents.tolist() == [-1, 0, 1, 0, 3]


def test_ngram_no_match_falls_back_to_plain_steps():
    target = make_tiny_target("llama")
    prompt = [1, 10, 11, 12]
    out = speculative_generate(target, NgramDrafter(min_n=3), prompt, 10, k=3, eos_token_id=[])
    assert out.tokens == plain_generate(target, prompt, 10, eos_token_id=[]).tokens
    assert out.stats.target_passes >= 1 and out.stats.tau >= 1.0


class CheckedDraft(DraftLMDrafter):
    """Asserts every cached proposal equals the draft model's greedy chain computed from scratch."""

    def propose(self, ctx):
        prop = super().propose(ctx)
        ids = ctx.tokens.tolist()
        for _ in range(ctx.k):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert prop.tokens.tolist() == ids[len(ctx.tokens):]
        return prop


def test_draft_lm_cache_rollback_is_exact():
    target = make_tiny_target("qwen2")
    d = CheckedDraft(make_tiny_model("qwen2", layers=2, seed=4), target)
    out = speculative_generate(target, d, [1, 5, 9, 5, 9], 30, k=3, eos_token_id=[])
    assert 0 < sum(out.stats.accepts) < out.stats.drafted  # both acceptances and rejections happened


def test_vocab_mismatch_is_refused():
    target = make_tiny_target("llama")
    target.tokenizer = make_tokenizer()
    model = make_tiny_model("llama", seed=1)
    DraftLMDrafter(model, target, tokenizer=make_tokenizer())  # same strings: fine
    with pytest.raises(ValueError, match=r"id 7: target 'w7' vs draft 'other'"):
        DraftLMDrafter(model, target, tokenizer=make_tokenizer(rename={7: "other", 9: "x"}))
    with pytest.raises(ValueError, match="120 tokens but the target's has 128"):
        DraftLMDrafter(make_tiny_model("llama", vocab_size=120), target, tokenizer=make_tokenizer(120))
    bare = make_tiny_target("llama")
    with pytest.raises(ValueError, match="64 rows.*128"):
        DraftLMDrafter(make_tiny_model("llama", vocab_size=64), bare)


def test_load_drafter_dispatch(tmp_path, monkeypatch):
    from spectrain.io.integrity import seal

    target = make_tiny_target("llama")
    target.tokenizer = make_tokenizer()
    assert isinstance(load_drafter("ngram", target), NgramDrafter)
    assert "eagle3" in registry.FAMILIES and "medusa" in registry.FAMILIES

    class Fake(Drafter):
        name = "fake"

    seen = {}

    def loader(path, tgt):
        seen["args"] = (path, tgt)
        return Fake()

    fake = registry.Family("fake", "fake drafters", train=registry.TrainSide(head="", features=registry.FeatureSpec()),
                           decode=registry.DecodeSide(drafter=loader))
    monkeypatch.setitem(registry.FAMILIES, "fake", fake)
    run = tmp_path / "run"
    run.mkdir()
    (run / "drafter_config.json").write_text(json.dumps({"kind": "fake"}))
    seal(run)  # load_drafter refuses an unsealed spectrain drafter directory
    assert isinstance(load_drafter(str(run), target), Fake) and seen["args"] == (run, target)
    (run / "drafter_config.json").write_text(json.dumps({"kind": "nope"}))
    seal(run)
    with pytest.raises(ValueError, match="kind='nope'.*eagle3"):
        load_drafter(str(run), target)
    hf = tmp_path / "draft"
    make_tiny_model("llama", layers=2, seed=2).save_pretrained(hf)
    make_tokenizer().save_pretrained(hf)
    d = load_drafter(str(hf), target)
    assert isinstance(d, DraftLMDrafter) and d.tokenizer is not None
    make_tokenizer(rename={3: "<oops>"}).save_pretrained(hf)
    with pytest.raises(ValueError, match="id 3"):
        load_drafter(str(hf), target)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither drafter_config.json"):
        load_drafter(str(empty), target)
    with pytest.raises(FileNotFoundError, match="drafter directory not found"):
        load_drafter(str(tmp_path / "missing"), target)
