"""DFlash block drafters (spectrain/drafters/dflash/): training moves acceptance, decoding stays lossless (greedy
equality, exact sampling with its broken variant caught), one forward drafts the chain, heads round-trip."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from conftest import make_tiny_target
from test_sampling_exact import EV, chi_square_pvalue, e2e_counts, e2e_exact

import spectrain.decoding.acceptance as acceptance
from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.drafters.dflash import DFlashConfig
from spectrain.drafters.dflash.decode import DFlashProposer
from spectrain.drafters.dflash.model import DFlashHead

torch.set_num_threads(1)


def _recipe(**kw):
    return NS(drafter=NS(sections={"dflash": DFlashConfig(**kw)}, loss="fkl"))


def _trained(target, steps: int = 120, block_size: int = 5):
    """A head distilled on the target's own greedy continuations (what regenerated data is)."""
    torch.manual_seed(0)
    head = DFlashHead.from_recipe(_recipe(block_size=block_size, anchors_per_row=6), target)
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 128, (6,), generator=g).tolist() for _ in range(12)]
    rows = [p + plain_generate(target, torch.tensor(p), max_new_tokens=24, eos_token_id=[]).tokens for p in prompts]
    ids = torch.tensor(rows)
    lm = torch.zeros_like(ids)
    lm[:, 7:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}
    out = target.forward(ids, aux_layers=list(head.aux_layers), want_last_hidden=True, want_logits=False)
    feats = {"aux": torch.cat(out.aux_hidden, -1), "last_hidden": out.last_hidden}
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(steps):
        loss, metrics = head.train_loss(batch, feats, target)
        first = first if first is not None else metrics
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head, prompts, first, metrics


def test_training_lifts_acceptance_and_greedy_decoding_is_the_targets():
    target = make_tiny_target()
    head, prompts, first, last = _trained(target)
    assert last["loss"] < 0.5 * first["loss"] and last["sim_tau"] > first["sim_tau"] + 0.5
    assert {f"acc_{i}" for i in range(4)} <= set(last) and last["tokens"] > 0
    drafter = DFlashProposer(head, target)
    calls = []
    head.register_forward_pre_hook(lambda *a: calls.append(1))
    for p in prompts[:3]:
        plain = plain_generate(target, torch.tensor(p), max_new_tokens=24, eos_token_id=[])
        spec = speculative_generate(target, drafter, torch.tensor(p), max_new_tokens=24, k=4, eos_token_id=[])
        assert spec.tokens == plain.tokens and spec.stats.tau > 1.2
    batched = speculative_generate(target, drafter, prompts[:4], max_new_tokens=24, k=4, eos_token_id=[],
                                   batch_size=4)
    assert [o.tokens for o in batched] == [plain_generate(target, torch.tensor(p), max_new_tokens=24,
                                                          eos_token_id=[]).tokens for p in prompts[:4]]


def test_one_forward_drafts_the_whole_chain_and_k_is_capped_by_the_block():
    target = make_tiny_target()
    head = DFlashHead.from_recipe(_recipe(block_size=4), target)
    drafter = DFlashProposer(head, target)
    seen = []
    for layer in head.layers:
        layer.register_forward_hook(lambda m, a, o: seen.append(o.shape[1]))
    out = speculative_generate(target, drafter, torch.tensor([1, 5, 9, 7, 3]), max_new_tokens=12, k=6,
                               eos_token_id=[])
    # one forward per proposal, each over [last token, mask x 3]: k = 6 capped at B - 1 = 3 (shorter only where
    # the token budget ends)
    assert max(seen) == 4 and len(seen) <= out.stats.target_passes * len(head.layers)
    assert out.stats.drafted <= 3 * out.stats.target_passes


def test_a_saved_head_loads_and_drafts_the_same(tmp_path):
    target = make_tiny_target()
    head = DFlashHead.from_recipe(_recipe(block_size=4, num_layers=2), target)
    head.save_pretrained(tmp_path / "h")
    again = DFlashHead.from_pretrained(tmp_path / "h", target)
    prompt = torch.tensor([1, 5, 9, 7, 3, 4, 4])
    a = speculative_generate(target, DFlashProposer(head, target), prompt, max_new_tokens=10, k=3, eos_token_id=[])
    b = speculative_generate(target, DFlashProposer(again, target), prompt, max_new_tokens=10, k=3, eos_token_id=[])
    assert a.tokens == b.tokens and a.stats.accepts == b.stats.accepts


@pytest.mark.parametrize("bad, msg", [
    ({"block_size": 1}, "drafter.dflash.block_size must be >= 2"),
    ({"decay": 0.0}, "drafter.dflash.decay must be in"),
    ({"anchors_per_row": 0}, "drafter.dflash.anchors_per_row must be >= 1"),
])
def test_bad_settings_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        DFlashConfig(**bad).validate()


def test_a_mask_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="mask_token_id=999 is outside the target's vocabulary"):
        DFlashHead.from_recipe(_recipe(mask_token_id=999), make_tiny_target())


def _e2e(monkeypatch=None):
    target = make_tiny_target("llama", vocab_size=EV, layers=2, hidden=16)
    torch.manual_seed(3)
    head = DFlashHead.from_recipe(_recipe(block_size=3, aux_layers=[0, 1]), target)
    return target, DFlashProposer(head, target)


def test_sampling_is_exact():
    target, drafter = _e2e()
    prompt, temp, n = [1, 2], 1.3, 200
    counts, stats = e2e_counts(target, drafter, prompt, n, temp)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, e2e_exact(target, prompt, temp), n) > 1e-3


@pytest.mark.slow
def test_a_broken_residual_is_caught(monkeypatch):
    target, drafter = _e2e()
    prompt, temp, n = [1, 2], 1.3, 1500
    monkeypatch.setattr(acceptance, "_RESIDUAL_FROM_P", True)
    counts, _ = e2e_counts(target, drafter, prompt, n, temp)
    assert chi_square_pvalue(counts, e2e_exact(target, prompt, temp), n) < 1e-4
