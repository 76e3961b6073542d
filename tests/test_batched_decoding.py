"""Batched speculative decoding (batch_size=B): per row exactly what batch size 1 gives.

Greedy rows are compared with HF ``generate`` on each prompt alone (no padding), for every drafter
family, chains and trees, on several architectures; ragged acceptance (rows accepting 0..k tokens in
the same pass), eos in one row mid-batch, prompts of different lengths (1 token included), cache
compaction, sliding windows and eager attention; sampled rows pass the chi-square exactness test.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_tiny_model, make_tiny_target
from test_decoding import PROMPTS, AlwaysWrong, OracleTree, hf_greedy
from test_sampling_exact import chi_square_pvalue, e2e_counts, e2e_exact

import spectrain.decoding.acceptance as acceptance
import spectrain.decoding.batched as batched
import spectrain.decoding.kv_cache as kv_cache
from spectrain.decoding.interface import Drafter, Proposal
from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.decoding.stats import DecodeStats
from spectrain.drafters.draft_lm import DraftLMDrafter
from spectrain.drafters.eagle3.decode import Eagle3Proposer
from spectrain.drafters.eagle3.model import Eagle3Head
from spectrain.drafters.medusa import MedusaHeads, MedusaProposer
from spectrain.drafters.ngram import NgramDrafter
from spectrain.recipe.schema import Recipe

torch.set_num_threads(1)


def eagle3(target, draft_vocab_size=100, seed=0):
    r = Recipe()
    r.drafter.eagle3.draft_vocab_size = min(draft_vocab_size, target.vocab_size)
    torch.manual_seed(seed)
    counts = torch.randint(0, 1000, (target.vocab_size,))
    return Eagle3Proposer(Eagle3Head.from_recipe(r, target, counts), target)


def medusa(target, num_heads=4, perturb=0.3, seed=0):
    r = Recipe()
    r.drafter.kind = "medusa"
    r.drafter.medusa.num_heads = num_heads
    heads = MedusaHeads.from_recipe(r, target, None)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * perturb)
    return MedusaProposer(heads, target)


def families(target, arch):
    """name -> (drafter factory, tree options or None)."""
    return {
        "ngram": (NgramDrafter, None), "ngram-tree": (NgramDrafter, {"topk": 3}),
        "draft": (lambda: DraftLMDrafter(make_tiny_model(arch, layers=2, seed=5), target), None),
        "draft-tree": (lambda: DraftLMDrafter(make_tiny_model(arch, layers=2, seed=5), target), {"topk": 2}),
        "eagle3": (lambda: eagle3(target), None), "eagle3-tree": (lambda: eagle3(target), {"topk": 3, "total_tokens": 10}),
        "medusa": (lambda: medusa(target), None), "medusa-tree": (lambda: medusa(target), {"topk": 2, "total_tokens": 8}),
        "oracle-tree": (lambda: OracleTree(target), {}),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_every_family_greedy_batched_equals_generate(arch):
    target = make_tiny_target(arch)
    refs = [hf_greedy(target, p, 16, eos=2) for p in PROMPTS]  # 9, 2, 1 and 15 prompt tokens
    assert [o.tokens for o in plain_generate(target, PROMPTS, 16, eos_token_id=2, batch_size=4)] == refs
    for name, (make, tree) in families(target, arch).items():
        outs = speculative_generate(target, make(), PROMPTS, 16, k=3, eos_token_id=2, tree=tree, batch_size=3)
        assert [o.tokens for o in outs] == refs, name


def test_batched_stats_equal_unbatched_per_row():
    """Deterministic drafts: every per-row counter is what batch size 1 counts."""
    target = make_tiny_target("qwen2")
    for tree in (None, {"topk": 3}):
        one = speculative_generate(target, NgramDrafter(), PROMPTS, 24, k=4, eos_token_id=[], tree=tree)
        many = speculative_generate(target, NgramDrafter(), PROMPTS, 24, k=4, eos_token_id=[], tree=tree,
                                    batch_size=4)
        for a, b in zip(one, many):
            assert a.tokens == b.tokens
            for key in ("attempts", "accepts", "drafted", "target_passes", "emitted", "prefill_tokens", "sequences"):
                assert getattr(a.stats, key) == getattr(b.stats, key), key
        merged = DecodeStats.merge([o.stats for o in many])
        assert merged.sequences == 4 and merged.emitted == 4 * 24
        assert merged.wall_time_s >= max(o.stats.wall_time_s for o in many) > 0


@pytest.mark.parametrize("tree", [None, {"topk": 3, "total_tokens": 10}])
def test_eagle3_batched_drafts_equal_single_row_drafts(monkeypatch, tree):
    """The batched head cache (ragged ingestion, holes, compaction) and the batched EAGLE-2 trees draft
    what one row alone drafts."""
    import spectrain.decoding.loop as dec

    target = make_tiny_target("llama")
    prop = eagle3(target)
    prompts = [p for p in PROMPTS if len(p) > 1]
    seen: list = []
    rule = "accept_chain" if tree is None else "accept_tree"

    def spy(logits, proposal, sampler):
        parents = None if proposal is None or proposal.is_chain else tuple(proposal.parents.tolist())
        seen.append(None if proposal is None else (tuple(proposal.tokens.tolist()), parents))
        return getattr(acceptance, rule)(logits, proposal, sampler)

    monkeypatch.setattr(dec, rule, spy)
    monkeypatch.setattr(batched, rule, spy)
    speculative_generate(target, prop, prompts, 40, k=4, eos_token_id=[], tree=tree)
    one, seen[:] = list(seen), []
    speculative_generate(target, prop, prompts, 40, k=4, eos_token_id=[], tree=tree, batch_size=3)
    # batch size 1 records row after row, the batch step after step: the same proposals either way
    assert sorted(map(str, one)) == sorted(map(str, seen)) and len(set(one)) > 10


class Ragged(Drafter):
    """Row r (prompt[0] = r) drafts the target's greedy continuation with draft position r+1 wrong,
    so in every pass row r accepts exactly min(r, k) tokens: rows accept 0..k in the same pass."""

    name = "ragged"

    def __init__(self, target):
        self.target = target

    def begin(self, prompt):
        self.wrong_at = int(prompt[0])

    def propose(self, ctx):
        ids = ctx.tokens.tolist()
        truth = []
        for _ in range(ctx.k):
            truth.append(int(self.target.model(torch.tensor([ids + truth])).logits[0, -1].argmax()))
        if self.wrong_at < ctx.k:
            truth[self.wrong_at] = (truth[self.wrong_at] + 1) % self.target.vocab_size
        return Proposal(tokens=torch.tensor(truth))


def test_ragged_acceptance_eos_mid_batch_and_different_lengths():
    target = make_tiny_target("llama")
    k = 3
    prompts = [[r] + list(range(10, 10 + 2 * r + 1)) for r in range(k + 1)]  # 2, 4, 6, 8 tokens
    free = [hf_greedy(target, p, 24, eos=[]) for p in prompts]
    # an eos that row 0 emits early and no other row emits: row 0 leaves the batch mid-way
    eos = next(t for t in free[0][2:] if all(t not in f for f in free[1:]) and t not in free[0][:2])
    refs = [hf_greedy(target, p, 24, eos=eos) for p in prompts]
    assert len(refs[0]) < 24 and all(len(r) == 24 for r in refs[1:])
    outs = speculative_generate(target, Ragged(target), prompts, 24, k=k, eos_token_id=eos, batch_size=4)
    assert [o.tokens for o in outs] == refs
    assert [o.stop_reason for o in outs] == ["eos", "length", "length", "length"]
    for r, o in enumerate(outs):  # row r: positions 1..r always accepted, position r+1 never
        s = o.stats
        assert s.accepts[:r] == s.attempts[:r]
        if r < k:
            assert s.accepts[r] == 0 < s.attempts[r]
    assert outs[3].stats.tau > 3.0 and outs[0].stats.tau == 1.0


def test_compaction_keeps_rows_exact(monkeypatch):
    target = make_tiny_target("mistral")
    calls = []
    real = kv_cache.compact_order

    def spy(slot_pos, *a, **kw):
        order = real(slot_pos, *a, **kw)
        calls.append(order is not None)
        return order

    monkeypatch.setattr(kv_cache, "compact_order", spy)
    refs = [hf_greedy(target, p, 40, eos=[]) for p in PROMPTS]
    outs = speculative_generate(target, AlwaysWrong(target), PROMPTS, 40, k=4, eos_token_id=[], batch_size=4)
    assert [o.tokens for o in outs] == refs
    assert any(calls), "a 40-token run with 4 rejected slots per pass must compact"


def test_sliding_window_and_eager_batched():
    target = make_tiny_target("mistral")
    target.config.sliding_window = 6  # far shorter than prompt + generation
    refs = [hf_greedy(target, p, 20, eos=[]) for p in PROMPTS]
    for d, tree in ((NgramDrafter(), None), (OracleTree(target), {})):
        outs = speculative_generate(target, d, PROMPTS, 20, k=4, eos_token_id=[], tree=tree, batch_size=4)
        assert [o.tokens for o in outs] == refs
    model = make_tiny_model("llama")
    model.set_attn_implementation("eager")
    from spectrain.targets.model import FrozenTarget

    target = FrozenTarget(model)
    refs = [hf_greedy(target, p, 16, eos=[]) for p in PROMPTS]
    outs = speculative_generate(target, OracleTree(target), PROMPTS, 16, k=3, eos_token_id=[], tree={}, batch_size=4)
    assert [o.tokens for o in outs] == refs


def test_bad_batch_size():
    target = make_tiny_target("llama")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            speculative_generate(target, NgramDrafter(), PROMPTS, 4, batch_size=bad)


# ---- sampling: per-row exactness at B > 1 --------------------------------------------------------------


# the draft-model chain and tree at B = 8 (and the broken verifier at B = 16) are parametrized into
# tests/test_sampling_exact.py; EAGLE-3 batches its own sampling, so it is checked here


@pytest.mark.parametrize("tree", [None, {"topk": 2, "total_tokens": 4}])
def test_batched_eagle3_sampling_is_exact_per_row(tree):
    """Batched EAGLE-3 chains and trees sample their own q rows per row: the verifier must see the right ones."""
    target = make_tiny_target("llama", vocab_size=3, layers=2, hidden=16)
    prompt, temp, n = [1, 2, 0], 1.3, 200
    counts, stats = e2e_counts(target, eagle3(target, draft_vocab_size=3, seed=1), prompt, n, temp, tree, 8)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, e2e_exact(target, prompt, temp), n) > 1e-3


# ---- the reference target: B = 8, every family ----------------------------------------------------------

REFERENCE = "assets/reference-target"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(REFERENCE), reason="reference target not built")
def test_reference_target_b8_every_family_equals_plain_greedy():
    from spectrain import load_target
    from spectrain.drafters.draft_lm import layer_subset

    target = load_target(REFERENCE, device="cpu")
    tok = target.tokenizer
    texts = ["What is the capital of France?", "Repeat after me: the cat sat on the mat, the cat",
             "Write a Python function that adds two numbers.", "Summarize: the sun is a star.", "Hi",
             "List three colors.", "Translate 'good morning' into French.", "Explain gravity to a child."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for t in texts]
    eos = target.model.generation_config.eos_token_id
    refs = [hf_greedy(target, p, 24, eos=eos) for p in prompts]
    drafters = {"ngram": (NgramDrafter(), None), "ngram-tree": (NgramDrafter(), {"topk": 3}),
                "eagle3": (eagle3(target, 2048), None), "eagle3-tree": (eagle3(target, 2048), {"topk": 3}),
                "medusa": (medusa(target), None), "medusa-tree": (medusa(target), {"topk": 3, "total_tokens": 12}),
                "draft": (DraftLMDrafter(layer_subset(target, [0, 7]), target, tokenizer=tok), None),
                "plain": (None, None)}
    for name, (d, tree) in drafters.items():
        outs = speculative_generate(target, d, prompts, 24, k=4, tree=tree, batch_size=8)
        assert [o.tokens for o in outs] == refs, name


def noisy_self_draft(arch: str):
    """A copy of the target with a noisy lm_head: accepts some drafts, rejects others."""
    draft = make_tiny_model(arch)
    with torch.no_grad():
        w = draft.get_output_embeddings().weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) * w.std() * 0.4)
    return draft


@pytest.mark.parametrize("family", ["draft", "medusa"])
@pytest.mark.parametrize("tree", [None, {"topk": 2}])
def test_batched_drafters_draft_what_one_row_drafts(family, tree):
    """Draft-model chains share one draft KV cache (rejected drafts become holes), Medusa runs every row's
    heads in one forward: per row the drafts, and so every acceptance counter, equal batch size 1's."""
    target = make_tiny_target("qwen2")
    draft = noisy_self_draft("qwen2")
    make = (lambda: DraftLMDrafter(draft, target)) if family == "draft" else (lambda: medusa(target, 3))
    refs = [hf_greedy(target, p, 30, eos=2) for p in PROMPTS]
    one = speculative_generate(target, make(), PROMPTS, 30, k=3, eos_token_id=2, tree=tree)
    many = speculative_generate(target, make(), PROMPTS, 30, k=3, eos_token_id=2, tree=tree, batch_size=3)
    assert [o.tokens for o in many] == refs
    assert [(o.stats.attempts, o.stats.accepts) for o in many] == [(o.stats.attempts, o.stats.accepts) for o in one]
    rate = DecodeStats.merge([o.stats for o in many]).acceptance_rate
    assert 0.1 < rate < 0.9 if family == "draft" else rate > 0
