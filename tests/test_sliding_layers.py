"""Models whose layers mix sliding-window and full attention (``config.layer_types``: Gemma 2/3, Qwen2/3
with ``max_window_layers``, GPT-OSS): every layer type gets its own mask (spectrain/decoding/masks.py), so greedy
chains and trees, batch size 1 and batched with rows of different lengths, equal HF ``generate`` far
beyond the window, and sampling stays exact there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_batched_decoding import eagle3, medusa
from test_decoding import OracleTree, hf_greedy
from test_sampling_exact import chi_square_pvalue, e2e_counts, e2e_exact

import spectrain.decoding.batched as batched
import spectrain.decoding.masks as masks
from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.drafters.draft_lm import DraftLMDrafter
from spectrain.drafters.ngram import NgramDrafter
from spectrain.targets.model import FrozenTarget

torch.set_num_threads(1)

WINDOW = 8
MIXED = ["sliding_attention", "full_attention"] * 2
# 30, 17, 9 and 3 tokens, repeats for the n-gram drafter; with 24 new tokens every row passes the window
PROMPTS = [[1] + [20 + i % 7 for i in range(29)], [1, 5, 9, 5, 9, 17, 3, 5, 9, 40, 41, 42, 40, 41, 42, 40, 41],
           [1, 22, 23, 24, 22, 23, 24, 22, 23], [7, 8, 7]]
NEW = 24


def make_windowed_target(arch: str, vocab_size: int = 128, layers: int = 4, hidden: int = 32, window: int = WINDOW,
                         seed: int = 0, layer_types: list[str] | None = None) -> FrozenTarget:
    """A deterministic tiny random target with sliding-window layers (mixed with full ones unless
    ``layer_types`` says otherwise)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, sliding_window=window, tie_word_embeddings=False)
    mixed = layer_types or (MIXED * layers)[:layers]
    cfg, cls = {
        # Gemma 2 runs eager attention (logit soft-capping): the additive-mask path
        "gemma2": lambda: (tf.Gemma2Config(head_dim=8, final_logit_softcapping=None, layer_types=mixed, **common),
                           tf.Gemma2ForCausalLM),
        "gemma3": lambda: (tf.Gemma3TextConfig(head_dim=8, layer_types=mixed, **common), tf.Gemma3ForCausalLM),
        # Qwen2: layers >= max_window_layers slide (full layers first, then sliding ones)
        "qwen2": lambda: (tf.Qwen2Config(use_sliding_window=True, max_window_layers=layers // 2, **common),
                          tf.Qwen2ForCausalLM),
        "qwen3": lambda: (tf.Qwen3Config(head_dim=8, use_sliding_window=True, max_window_layers=layers // 2, **common),
                          tf.Qwen3ForCausalLM),
        "gpt_oss": lambda: (tf.GptOssConfig(head_dim=8, num_local_experts=4, num_experts_per_tok=2, layer_types=mixed,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common),
                            tf.GptOssForCausalLM),
    }[arch]()
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # peaked logits: no near-ties between a k-token pass and one-token steps
        model.get_output_embeddings().weight.mul_(8.0)
    return FrozenTarget(model, tokenizer=None, name_or_path=f"tiny-{arch}-window{window}")


def refs_of(target, prompts=PROMPTS, n=NEW):
    return [hf_greedy(target, p, n, eos=[]) for p in prompts]


def test_fixture_needs_a_mask_per_layer_type(monkeypatch):
    """The window matters here, and one mask for every layer (windowed or not) is not lossless."""
    target = make_windowed_target("qwen2")
    prompts = PROMPTS[:2]
    refs = refs_of(target, prompts)
    target.config.sliding_window = 10_000  # HF's own masks read the config: plain full attention
    assert refs_of(target, prompts) != refs
    target.config.sliding_window = WINDOW
    real = masks.layer_masks
    for kind in ("sliding_attention", "full_attention"):
        def one(*a, kind=kind):
            m = real(*a)
            return m[kind] if isinstance(m, dict) else m

        monkeypatch.setattr(masks, "layer_masks", one)
        monkeypatch.setattr(batched, "layer_masks", one)
        outs = speculative_generate(target, OracleTree(target), prompts, NEW, k=4, eos_token_id=[], tree={})
        assert [o.tokens for o in outs] != refs, kind


def test_layer_masks_per_type_only_beyond_the_window():
    target = make_windowed_target("gemma3")
    P = 20
    pos = torch.arange(P, P + 3)
    m = masks.tree_mask(target, [-1, 0], P, pos)  # the refusal this replaces: a tree past the window
    assert set(m) == {"sliding_attention", "full_attention"}
    assert m["full_attention"].shape == m["sliding_attention"].shape == (1, 1, 3, P + 3)
    assert m["full_attention"][0, 0, :, :P].all()
    assert m["sliding_attention"][0, 0, 0].tolist() == [False] * (P - WINDOW + 1) + [True] * (WINDOW - 1) + [
        True, False, False]  # the root (position P) sees P-7..P
    assert isinstance(masks.tree_mask(target, [-1], 3, torch.arange(3, 5)), torch.Tensor)  # inside the window
    uniform = make_windowed_target("gemma3", layer_types=["sliding_attention"] * 4)
    assert isinstance(masks.tree_mask(uniform, [-1, 0], P, pos), torch.Tensor)
    odd = SimpleNamespace(config=SimpleNamespace(sliding_window=4, layer_types=["chunked_attention", "sliding_attention"],
                                                 _attn_implementation="sdpa"), dtype=torch.float32)
    with pytest.raises(ValueError, match="layer types \\['chunked_attention'\\].*chain drafts"):
        masks.tree_mask(odd, [-1], P, torch.arange(P, P + 2))


def cases(target, arch: str) -> dict:
    """name -> (drafter factory, tree options, batch sizes): chains and trees, accepted paths that are not
    the leading nodes (the oracle tree), untrained EAGLE-3 and Medusa heads (mostly rejected drafts), a
    draft model of the same architecture (its batched cache gets per-layer-type masks too)."""
    return {"draft": (lambda: DraftLMDrafter(make_windowed_target(arch, layers=2, seed=5).model, target), None,
                      (None, 4)),
            "ngram": (NgramDrafter, None, (None, 4)), "ngram-tree": (NgramDrafter, {"topk": 3}, (None, 4)),
            "eagle3": (lambda: eagle3(target), None, (None, 3)),
            "eagle3-tree": (lambda: eagle3(target), {"topk": 3}, (None, 4)),
            "medusa-tree": (lambda: medusa(target), {"topk": 2, "total_tokens": 8}, (None, 4)),
            "oracle-tree": (lambda: OracleTree(target), {}, (None, 4))}


FAST = {"draft": (4,), "ngram": (None, 4), "oracle-tree": (None, 4), "eagle3-tree": (4,), "medusa-tree": (4,)}


def check_greedy(arch: str, only: dict | None = None) -> None:
    target = make_windowed_target(arch)
    refs = refs_of(target)
    assert [o.tokens for o in plain_generate(target, PROMPTS, NEW, eos_token_id=[], batch_size=4)] == refs
    for name, (make, tree, sizes) in cases(target, arch).items():
        for batch_size in sizes if only is None else only.get(name, ()):
            outs = speculative_generate(target, make(), PROMPTS, NEW, k=4, eos_token_id=[], tree=tree,
                                        batch_size=batch_size)
            assert [o.tokens for o in outs] == refs, (name, batch_size)


@pytest.mark.parametrize("arch", ["gemma2", "qwen2"])  # eager and sdpa; sliding layers first and last
def test_greedy_beyond_the_window_equals_generate(arch):
    """Batch size 1 and batched rows of 3 to 30 prompt tokens, 24 new tokens: every row passes the window."""
    check_greedy(arch, FAST)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen2", "qwen3", "gpt_oss"])
def test_every_family_beyond_the_window_equals_generate(arch):
    check_greedy(arch)


def test_uniform_sliding_layers_beyond_the_window():
    target = make_windowed_target("gemma3", layer_types=["sliding_attention"] * 4)
    refs = refs_of(target)
    for tree, bs in ((None, None), ({}, 4)):
        drafter = NgramDrafter() if tree is None else OracleTree(target)
        outs = speculative_generate(target, drafter, PROMPTS, NEW, k=4, eos_token_id=[], tree=tree, batch_size=bs)
        assert [o.tokens for o in outs] == refs


def test_sampling_beyond_the_window_is_exact():
    """Draft-model trees at batch size 8 on a 3-token vocabulary, the prompt twice the window long."""
    from conftest import make_tiny_model

    target = make_windowed_target("gemma3", vocab_size=3, layers=2, hidden=16, window=4)
    draft = make_tiny_model("llama", seed=3, vocab_size=3, layers=1, hidden=16)
    prompt, temp, n = [1, 2, 0, 1, 1, 2, 0, 2], 1.3, 200
    counts, stats = e2e_counts(target, DraftLMDrafter(draft, target), prompt, n, temp, {"topk": 2}, 8)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, e2e_exact(target, prompt, temp), n) > 1e-3
