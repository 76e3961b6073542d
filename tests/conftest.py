"""Shared fixtures: tiny random HF models of several architectures, built in-process (no hub)."""

from __future__ import annotations

import pytest
import torch

# Tiny models on a shared 2-core machine: one thread is ~10x faster than two contended ones.
torch.set_num_threads(1)

ARCHS = ("llama", "qwen2", "mistral")


def make_tiny_model(arch: str = "llama", tied: bool = False, vocab_size: int = 128, layers: int = 8,
                    hidden: int = 32, seed: int = 0, max_positions: int = 256):
    """A deterministic random causal LM. 8 layers so EAGLE-3's low/mid/high layers are distinct."""
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    cfg = cls[0](vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=max_positions, tie_word_embeddings=tied,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    # Random init gives near-uniform logits; sharpen them so greedy/sampling tests see peaked,
    # realistic distributions (and ties are impossible).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def make_tiny_target(arch: str = "llama", tied: bool = False, **kw):
    from spectrain.targets.model import FrozenTarget

    return FrozenTarget(make_tiny_model(arch, tied, **kw), tokenizer=None, name_or_path=f"tiny-{arch}")


@pytest.fixture(autouse=True, scope="session")
def _auto_dtype_is_fp32():
    """`dtype: auto` on a native-bf16 CPU times both dtypes and may pick either (the reference target's passes
    cost about the same), so a test's exact-equality claim would hang on timing noise. Tests see a CPU without
    native bf16 (auto -> fp32, nothing timed); tests of the decision itself pass `cpuinfo=` explicitly. Session
    scope: module-scoped targets load before any function-scoped patch, and one loaded in bf16 beside an fp32
    one parts at near-ties (test_regen_server did on an AVX-512 BF16 CPU)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("spectrain.targets.auto_dtype.read_cpuinfo", lambda: "")
        yield


@pytest.fixture(params=ARCHS)
def tiny_target(request):
    return make_tiny_target(request.param)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
