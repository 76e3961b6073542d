"""A 16-bit target's screened logits (spectrain/targets/logits.py): the full fp32 head's argmax at the 16-bit
head's cost. The bound must hold, the argmax must match on targets whose bf16 logits tie often, and a screen that
ignores the bound must be caught by the same check."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.drafters.ngram import NgramDrafter
from spectrain.targets import logits as tl
from spectrain.targets.model import FrozenTarget


def _tie_prone(tied: bool = False, seed: int = 0):
    """A bf16 target with logits of ~20-50 (SmolLM2's range), where bf16's spacing is 0.125-0.25: bf16 logits
    tie, and their argmax parts from the fp32 head's, at some positions (untied)."""
    model = make_tiny_model(hidden=64, vocab_size=512, tied=tied, seed=seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0 if not tied else 0.5)
    return FrozenTarget(model.to(torch.bfloat16))


def _states(target, n_rows: int = 6, length: int = 40) -> torch.Tensor:
    ids = torch.randint(3, 512, (n_rows, length), generator=torch.Generator().manual_seed(1))
    return target.forward(ids, want_last_hidden=True, want_logits=False).last_hidden


@pytest.mark.parametrize("tied", [False, True])
def test_screened_logits_take_the_fp32_heads_argmax_and_its_values_where_it_matters(tied):
    target = _tie_prone(tied)
    head = tl.TargetHead(target.norm, target.lm_head)
    h = _states(target)
    full, screened, native = (head.logits(h, m) for m in ("fp32", "screened", "native"))
    if not tied:  # the case the screen exists for: bf16's own argmax is not the fp32 head's
        assert not torch.equal(native.argmax(-1), full.argmax(-1))
    assert torch.equal(screened.argmax(-1), full.argmax(-1))
    n32 = head.norm32(h.float())
    nb = n32.to(torch.bfloat16)
    bound = head.error_bound(native, n32, nb)
    assert ((native - full).abs() <= bound).all()  # the bound the screen rests on
    top = full.argmax(-1, keepdim=True)
    assert torch.allclose(screened.gather(-1, top), full.gather(-1, top), atol=1e-4)  # exact where it decides


def test_a_screen_without_the_bound_is_caught(monkeypatch):
    """The deliberately broken variant: the screen refines nothing (the 16-bit head's argmax, ties included)."""
    target = _tie_prone()
    head = tl.TargetHead(target.norm, target.lm_head)
    h = _states(target, n_rows=16)
    full = head.logits(h, "fp32")
    monkeypatch.setattr(tl.TargetHead, "refine", lambda self, lb, *a: lb)
    broken = head.logits(h, "screened")
    assert not torch.equal(broken.argmax(-1), full.argmax(-1))


def test_modes_fp32_and_native_are_the_full_heads_and_an_unknown_mode_is_refused():
    target = _tie_prone()
    ids = torch.tensor([[5, 6, 7]])
    out = target.forward(ids, want_last_hidden=True, logits_mode="fp32")
    n32 = tl.TargetHead(target.norm, target.lm_head).norm32(out.last_hidden.float())
    assert torch.allclose(out.logits, n32 @ target.lm_head.weight.float().T, atol=1e-4)
    native = FrozenTarget(target.model, logits="native")
    assert not native.upcasts_logits() and torch.equal(native.forward(ids).logits, target.model(ids).logits)
    with pytest.raises(ValueError, match="logits='fast': use one of screened, fp32, native"):
        FrozenTarget(target.model, logits="fast")
    with pytest.raises(ValueError, match="unknown logits mode 'x'"):
        tl.TargetHead(target.norm, target.lm_head).logits(out.last_hidden, "x")


def test_every_greedy_step_takes_the_fp32_heads_argmax_of_its_own_pass(monkeypatch):
    """Plain and speculative decoding on the screened head: every logits row the decoder judged has the argmax
    the full fp32 head gives on the same hidden state (recorded inside the passes: no kernel-path slack)."""
    target = _tie_prone()
    seen = []
    real = FrozenTarget.fp32_head_logits

    def record(self, last_hidden, mode=None):
        out = real(self, last_hidden, mode)
        seen.append((last_hidden, out))
        return out

    monkeypatch.setattr(FrozenTarget, "fp32_head_logits", record)
    prompt = torch.tensor([5, 9, 33, 7, 120, 41, 5, 9, 33])
    plain_generate(target, prompt, max_new_tokens=24, eos_token_id=[])
    speculative_generate(target, NgramDrafter(), prompt, max_new_tokens=24, k=4, eos_token_id=[])
    head = tl.TargetHead(target.norm, target.lm_head)
    assert len(seen) > 24 and any(h.shape[1] > 1 for h, _ in seen)  # one-token and multi-token passes
    for h, logits in seen:
        assert torch.equal(logits.argmax(-1), head.logits(h, "fp32").argmax(-1))
