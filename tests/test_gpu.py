"""The few checks that need CUDA, behind the ``gpu`` marker (tests/conftest.py skips them without a GPU; CI has
none). The longer GPU run is scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.drafters.ngram import NgramDrafter
from spectrain.targets.model import FrozenTarget
from spectrain.train.distributed import resolve_precision

pytestmark = pytest.mark.gpu


def test_precision_auto_is_bf16_on_a_bf16_gpu():
    assert resolve_precision("auto") == ("bf16" if torch.cuda.is_bf16_supported() else "no")
    assert resolve_precision("fp16") == "fp16"  # refused on CPU only


def test_greedy_speculative_equals_plain_on_cuda():
    target = FrozenTarget(make_tiny_model("llama").to("cuda"), tokenizer=None, name_or_path="tiny-llama")
    prompts = [[1, 5, 9, 5, 9, 5], [3, 4, 3, 4, 3]]
    plain = plain_generate(target, prompts, 16, eos_token_id=[])
    spec = speculative_generate(target, NgramDrafter(), prompts, 16, k=4, eos_token_id=[])
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
