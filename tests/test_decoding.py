"""Greedy losslessness against HF generate, statistics, the head-drafter feature contract, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, make_tiny_target

from spectrain.decoding.interface import Drafter, Proposal
from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.decoding.stats import DecodeStats
from spectrain.drafters.draft_lm import DraftLMDrafter
from spectrain.drafters.ngram import NgramDrafter

torch.set_num_threads(1)  # tiny models: threads only add contention on the shared CI cores

PROMPTS = [[1, 5, 9, 5, 9, 17, 3, 5, 9], [1, 40], [7], [1, 22, 23, 24, 22, 23, 24, 22, 23, 24, 22, 23, 60, 61, 2]]


def hf_greedy(target, prompt, n, eos=None):
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class OracleTree(Drafter):
    """Knows the target's greedy continuation; puts a wrong branch (with children) first so the accepted
    path is not the leading nodes: exercises the tree mask, tree positions and the cache gather."""

    name = "oracle-tree"
    supports_tree = True

    def __init__(self, target):
        self.target = target

    def propose(self, ctx):
        ids = ctx.tokens.tolist()
        truth = []
        for _ in range(ctx.k):
            truth.append(int(self.target.model(torch.tensor([ids + truth])).logits[0, -1].argmax()))
        V = self.target.vocab_size
        toks, parents = [(truth[0] + 1) % V, (truth[0] + 2) % V], [-1, 0]  # wrong branch with a child
        par = -1
        for j, t in enumerate(truth):
            toks.append(t if j < ctx.k - 1 else (t + 1) % V)  # the deepest node is wrong: bonus comes from it
            parents.append(par)
            par = len(toks) - 1
        return Proposal(tokens=torch.tensor(toks), parents=torch.tensor(parents))


class AlwaysWrong(Drafter):
    name = "wrong"

    def __init__(self, target):
        self.target = target

    def propose(self, ctx):
        best = int(self.target.model(ctx.tokens[None]).logits[0, -1].argmax())
        return Proposal(tokens=torch.tensor([(best + 1) % self.target.vocab_size] * ctx.k))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_greedy_chain_and_tree_equal_generate(arch, tied):
    target = make_tiny_target(arch, tied)
    drafters = {"self": lambda: DraftLMDrafter(make_tiny_model(arch, tied), target),
                "other": lambda: DraftLMDrafter(make_tiny_model(arch, tied, layers=2, seed=5), target),
                "ngram": lambda: NgramDrafter()}
    for prompt in (PROMPTS[0], PROMPTS[2], PROMPTS[3]):  # 9, 1 and 15 tokens
        ref = hf_greedy(target, prompt, 20, eos=2)
        assert plain_generate(target, prompt, 20, eos_token_id=2).tokens == ref
        for name, make in drafters.items():
            out = speculative_generate(target, make(), prompt, 20, k=4, eos_token_id=2)
            assert out.tokens == ref, (name, prompt)
            if name != "self":
                out = speculative_generate(target, make(), prompt, 20, k=3, eos_token_id=2, tree={"topk": 3})
                assert out.tokens == ref, (name, "tree", prompt)
        out = speculative_generate(target, OracleTree(target), prompt, 20, k=4, eos_token_id=2, tree={})
        assert out.tokens == ref
        if len(ref) == 20:
            assert out.stats.tau > 3.0  # the correct path (4 nodes deep, last one wrong) was found


def test_batch_rows_and_padded_tensor():
    target = make_tiny_target("qwen2")
    refs = [hf_greedy(target, p, 16, eos=[]) for p in PROMPTS]
    outs = speculative_generate(target, NgramDrafter(), PROMPTS, 16, k=3, eos_token_id=[])
    assert [o.tokens for o in outs] == refs
    L = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in PROMPTS])  # left padding
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in PROMPTS])
    outs = speculative_generate(target, DraftLMDrafter(make_tiny_model("qwen2"), target), ids, 16, k=3,
                                eos_token_id=[], attention_mask=mask)
    assert [o.tokens for o in outs] == refs
    merged = DecodeStats.merge([o.stats for o in outs])
    assert merged.sequences == len(PROMPTS) and merged.emitted == 16 * len(PROMPTS)


def test_eos_inside_a_draft_truncates():
    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    free = hf_greedy(target, prompt, 20, eos=[])
    eos = free[5]
    stop = free.index(eos)
    assert stop >= 1  # so that eos is drafted after at least one accepted token
    out = speculative_generate(target, DraftLMDrafter(make_tiny_model("llama"), target), prompt, 20, k=6,
                               eos_token_id=eos)
    assert out.tokens == free[: stop + 1] == hf_greedy(target, prompt, 20, eos=eos)
    assert out.stop_reason == "eos"
    assert out.stats.emitted == stop + 1
    # nothing is counted past eos: every emitted token is an accepted draft or one per-pass target token
    assert out.stats.emitted - out.stats.target_passes <= sum(out.stats.accepts) <= out.stats.emitted


def test_sliding_window_chain_and_tree():
    target = make_tiny_target("mistral")
    target.config.sliding_window = 6  # far shorter than prompt + generation
    prompt = PROMPTS[3]
    ref = hf_greedy(target, prompt, 20, eos=[])
    assert plain_generate(target, prompt, 20, eos_token_id=[]).tokens == ref
    assert speculative_generate(target, NgramDrafter(), prompt, 20, k=4, eos_token_id=[]).tokens == ref
    out = speculative_generate(target, OracleTree(target), prompt, 20, k=4, eos_token_id=[], tree={})
    assert out.tokens == ref


def test_eager_attention_tree():
    model = make_tiny_model("llama")
    model.set_attn_implementation("eager")
    from spectrain.targets.model import FrozenTarget

    target = FrozenTarget(model)
    ref = hf_greedy(target, PROMPTS[0], 16, eos=[])
    assert speculative_generate(target, OracleTree(target), PROMPTS[0], 16, k=3, eos_token_id=[],
                                tree={}).tokens == ref


def test_stats_known_acceptance():
    target = make_tiny_target("llama")
    k = 4
    out = speculative_generate(target, DraftLMDrafter(make_tiny_model("llama"), target), PROMPTS[0], 21, k=k,
                               eos_token_id=[])
    s = out.stats
    assert s.alpha == [1.0] * k and s.acceptance_rate == 1.0
    assert s.target_passes == 5 and s.tau == 21 / 5  # 4 full passes of k+1 tokens, then 1 token (budget)
    out = speculative_generate(target, AlwaysWrong(target), PROMPTS[0], 12, k=k, eos_token_id=[])
    s = out.stats
    assert s.alpha[0] == 0.0 and s.attempts[0] == 11 and s.attempts[1:] == [0] * (k - 1)
    assert s.tau == 1.0 and s.acceptance_rate == 0.0 and s.drafted == sum(min(k, 11 - i) for i in range(11))
    d = s.to_dict()
    assert d["alpha"][1] is None and d["tau"] == 1.0
    assert plain_generate(target, PROMPTS[0], 7, eos_token_id=[]).stats.tau == 1.0


class FeatureProbe(Drafter):
    """Fake head drafter: records the features it receives; proposes the target's greedy token + 1 twice
    per step after a correct one, so acceptance varies and both crop paths are exercised."""

    name = "probe"
    supports_tree = True

    def __init__(self, target, aux_layers):
        self.target = target
        self.aux_layers = aux_layers
        self.needs_final_hidden = True

    def begin(self, prompt):
        self.aux, self.final, self.calls = [], [], 0

    def propose(self, ctx):
        f = ctx.features
        have = sum(a.shape[0] for a in self.aux)
        if f is not None:
            assert f.start == have, "features must be contiguous and never repeated"
            self.aux.append(f.aux)
            self.final.append(f.final_hidden)
            have += len(f)
        assert have == len(ctx.tokens) - 1, "features lag the committed tokens by exactly one"
        self.calls += 1
        best = int(self.target.model(ctx.tokens[None]).logits[0, -1].argmax())
        V = self.target.vocab_size
        if ctx.tree is not None:
            return Proposal(tokens=torch.tensor([(best + 1) % V, best, 3]), parents=torch.tensor([-1, -1, 1]))
        return Proposal(tokens=torch.tensor([best, (best + self.calls % 2) % V, 5][: ctx.k]))


@pytest.mark.parametrize("tree", [None, {}])
def test_head_drafter_features_match_recomputation(tree):
    target = make_tiny_target("qwen2")
    layers = target.default_aux_layers()
    probe = FeatureProbe(target, layers)
    prompt = PROMPTS[0]
    out = speculative_generate(target, probe, prompt, 15, k=3, eos_token_id=[], tree=tree)
    seq = torch.tensor([prompt + out.tokens])
    ref = target.forward(seq, aux_layers=layers, want_final_hidden=True)
    aux, final = torch.cat(probe.aux), torch.cat(probe.final)
    n = aux.shape[0]
    assert n >= len(prompt) - 1 + out.stats.target_passes - 1
    want_aux = torch.cat([h[0, :n] for h in ref.aux_hidden], dim=-1)
    torch.testing.assert_close(aux, want_aux, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref.final_hidden[0, :n], atol=1e-4, rtol=1e-4)


def test_bad_inputs():
    target = make_tiny_target("llama", max_positions=32)
    d = NgramDrafter()
    with pytest.raises(ValueError, match="context window"):
        speculative_generate(target, d, list(range(1, 30)), max_new_tokens=8)
    with pytest.raises(ValueError, match="k .*positive"):
        speculative_generate(target, d, [1, 2], k=0)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, d, [1, 2], temperature=-0.5)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            speculative_generate(target, d, [1, 2], top_p=top_p)
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(target, d, [])
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(target, d, [[1, 2], []])
    with pytest.raises(ValueError, match="trees"):
        speculative_generate(target, AlwaysWrong(target), [1, 2], tree={"topk": 2})

    class OutOfVocab(Drafter):
        def propose(self, ctx):
            return Proposal(tokens=torch.tensor([target.vocab_size + 3]))

    with pytest.raises(ValueError, match="outside the target vocabulary"):
        speculative_generate(target, OutOfVocab(), [1, 2], max_new_tokens=4)


REFERENCE = "assets/reference-target"


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.isdir(REFERENCE), reason="reference target not built")
def test_reference_target_greedy_equals_generate():
    from spectrain import load_target

    target = load_target(REFERENCE, device="cpu")
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
               for text in ("What is the capital of France?", "Repeat after me: the cat sat on the mat, the cat")]
    eos = target.model.generation_config.eos_token_id
    for prompt in prompts:
        ref = hf_greedy(target, prompt, 24, eos=eos)
        assert speculative_generate(target, NgramDrafter(), prompt, 24, k=4).tokens == ref
        assert speculative_generate(target, NgramDrafter(), prompt, 24, k=3, tree={"topk": 3}).tokens == ref
        draft = DraftLMDrafter(target.model, target, tokenizer=tok)  # the target drafting itself
        out = speculative_generate(target, draft, prompt, 24, k=3, tree={"topk": 2})
        assert out.tokens == ref and out.stats.alpha[0] == 1.0 and sum(out.stats.accepts) > 0
        assert all(a == 1.0 for a in out.stats.alpha if a == a)  # nan where never reached


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_drafter_without_features_folds_the_prefill_into_the_first_pass(drafter):
    """Plain decoding of N tokens is N model forwards, as HF generate's (the prompt rides on the first verify
    pass), each computing logits only for the rows it judges; a drafter reading features keeps its prefill."""
    target = make_tiny_target()
    calls, widths = [], []
    target.model.model.register_forward_pre_hook(lambda m, a, kw: calls.append((a[0] if a else kw["input_ids"]).shape[1]),
                                                 with_kwargs=True)
    assert not target.upcasts_logits()  # an fp32 target: the model's own head, with logits_to_keep
    target.model.lm_head.register_forward_hook(lambda m, a, o: widths.append(o.shape[1]))
    prompt = PROMPTS[0]
    d = NgramDrafter() if drafter else None
    out = speculative_generate(target, d, torch.tensor(prompt), max_new_tokens=12, k=3, eos_token_id=[])
    passes, heads = list(calls), list(widths)  # before generate's own passes below
    assert out.tokens == hf_greedy(target, prompt, 12, eos=[])
    assert len(passes) == out.stats.target_passes and passes[0] >= len(prompt)  # no separate prefill
    assert heads[0] == passes[0] - (len(prompt) - 1)  # the prompt's own rows computed no logits
    if drafter is None:
        assert out.stats.target_passes == 12 and out.stats.tau == 1.0
