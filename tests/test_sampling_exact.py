"""Sampling losslessness: the emitted sequences are distributed exactly as the target's own sampling.

Every test enumerates a tiny vocabulary over a short horizon, computes the exact target
distribution of whole sequences, and runs a chi-square goodness-of-fit test on many decoded samples
(fixed seeds, so the outcome is deterministic). Each exactness claim is paired with a deliberately
broken verifier that the same test must reject, so the test is known to have the power to notice.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import make_tiny_model, make_tiny_target

import spectrain.decoding.acceptance as acceptance
import spectrain.decoding.loop as dec
from spectrain.decoding.interface import Proposal
from spectrain.decoding.sampling import Sampler
from spectrain.drafters.draft_lm import DraftLMDrafter

torch.set_num_threads(1)


def chi_square_pvalue(counts: dict, exact: dict, n: int) -> float:
    """Pearson chi-square of counts vs n*exact; cells with expectation < 5 are pooled into one.
    p-value by the Wilson-Hilferty normal approximation (accurate enough at these df, no scipy)."""
    stat, pooled_obs, pooled_exp, df = 0.0, 0.0, 0.0, -1
    for cell, p in exact.items():
        e, o = n * p, counts.get(cell, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            pooled_obs += o
            pooled_exp += e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    assert sum(counts.values()) == n and not (set(counts) - set(exact)), "samples outside the support"
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# ---- synthetic target / draft tables: exercise the verifier itself with many samples ----------------

V, H, T = 4, 3, 1.0


class Table:
    """p(. | prefix) from seeded random logits per prefix; `scale` sets how peaked it is."""

    def __init__(self, salt: int, scale: float):
        self.salt, self.scale, self.memo = salt, scale, {}

    def logits(self, prefix) -> torch.Tensor:
        key = tuple(prefix)
        if key not in self.memo:
            g = torch.Generator().manual_seed(hash((self.salt,) + key) % (2**31))
            self.memo[key] = torch.randn(V, generator=g) * self.scale
        return self.memo[key]


TARGET, DRAFT = Table(1, 1.5), Table(2, 2.5)
SAMPLER_T = Sampler(temperature=T)


def exact_table():
    out = {}
    for seq in itertools.product(range(V), repeat=H):
        prob = 1.0
        for i in range(H):
            prob *= float(SAMPLER_T.probs(TARGET.logits(seq[:i]))[seq[i]])
        out[seq] = prob
    return out


def draw_children(q: torch.Tensor, m: int, mode: str, gen) -> list[int]:
    if mode == "topk":
        return q.topk(m).indices.tolist()
    if mode == "iid":
        return torch.multinomial(q, m, replacement=True, generator=gen).tolist()
    return torch.multinomial(q, m, replacement=False, generator=gen).tolist()  # without replacement


def one_step_chain(seq, n, sampler):
    drafts, qs = [], []
    for _ in range(n):
        q = sampler.probs(DRAFT.logits(seq + drafts))
        drafts.append(int(torch.multinomial(q, 1, generator=sampler.generator)))
        qs.append(q)
    logits = torch.stack([TARGET.logits(seq + drafts[:i]) for i in range(n + 1)])
    prop = Proposal(tokens=torch.tensor(drafts), probs=torch.stack(qs)) if n else None
    return acceptance.accept_chain(logits, prop, sampler)[1]


def one_step_tree(seq, n, sampler, mode, flag):
    """Root gets 3 children, each child 2 children (depth <= n)."""
    toks, parents, probs, prefixes = [], [], [], []

    def expand(parent, prefix, m):
        q = sampler.probs(DRAFT.logits(prefix))
        for x in draw_children(q, m, mode, sampler.generator):
            toks.append(x)
            parents.append(parent)
            probs.append(q)
            prefixes.append(prefix + [x])

    expand(-1, list(seq), 3)
    if n >= 2:
        for i in range(3):
            expand(i, prefixes[i], 2)
    logits = torch.stack([TARGET.logits(seq)] + [TARGET.logits(p) for p in prefixes])
    prop = Proposal(tokens=torch.tensor(toks), parents=torch.tensor(parents),
                    probs=None if mode == "topk" else torch.stack(probs), without_replacement=flag)
    return acceptance.accept_tree(logits, prop, sampler)[1]


def simulate(n_samples: int, k: int, tree_mode: str | None = None, flag: bool = False) -> dict:
    sampler = Sampler(temperature=T, generator=torch.Generator().manual_seed(1234))
    counts: dict = {}
    for _ in range(n_samples):
        seq: list[int] = []
        while len(seq) < H:
            n = min(k, H - len(seq) - 1)
            new = one_step_tree(seq, n, sampler, tree_mode, flag) if tree_mode and n else one_step_chain(seq, n, sampler)
            seq += new
        key = tuple(seq[:H])
        counts[key] = counts.get(key, 0) + 1
    return counts


N_SYNTH = 2000


@pytest.mark.parametrize("case", [("chain", None, False), ("tree-iid", "iid", False),
                                  ("tree-without-replacement", "wor", True), ("tree-topk", "topk", False)])
def test_verifier_is_exact_and_broken_variants_are_caught(case, monkeypatch):
    name, mode, flag = case
    exact = exact_table()
    counts = simulate(N_SYNTH, k=2, tree_mode=mode, flag=flag)
    assert chi_square_pvalue(counts, exact, N_SYNTH) > 1e-3, name
    monkeypatch.setattr(acceptance, "_RESIDUAL_FROM_P", True)  # resample from p instead of the residual
    broken = simulate(N_SYNTH, k=2, tree_mode=mode, flag=flag)
    assert chi_square_pvalue(broken, exact, N_SYNTH) < 1e-6, name


def test_without_replacement_needs_its_flag():
    # Siblings drawn without replacement but verified as if i.i.d.: not lossless, and detectably so.
    exact = exact_table()
    counts = simulate(2 * N_SYNTH, k=2, tree_mode="wor", flag=False)
    assert chi_square_pvalue(counts, exact, 2 * N_SYNTH) < 1e-6


# ---- end to end: real tiny HF models through speculative_generate ---------------------------------

EV, EH = 3, 3


def e2e_exact(target, prompt, temperature):
    seqs = torch.tensor(list(itertools.product(range(EV), repeat=EH)))
    full = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = target.model(full).logits[:, len(prompt) - 1: -1]
    p = Sampler(temperature=temperature).probs(logits).gather(2, seqs[..., None])[..., 0].prod(1)
    return {tuple(s): float(x) for s, x in zip(seqs.tolist(), p)}


def e2e_counts(target, drafter, prompt, n, temperature, tree=None, batch_size=None):
    outs = dec.speculative_generate(target, drafter, [prompt] * n, max_new_tokens=EH, k=2,
                                    temperature=temperature, seed=7, eos_token_id=[], tree=tree, batch_size=batch_size)
    counts: dict = {}
    for o in outs:
        counts[tuple(o.tokens)] = counts.get(tuple(o.tokens), 0) + 1
    return counts, dec.DecodeStats.merge([o.stats for o in outs])


def _e2e_models():
    kw = dict(vocab_size=EV, layers=1, hidden=16)
    return make_tiny_target("llama", **kw), make_tiny_model("llama", seed=3, **kw)


@pytest.mark.parametrize("batch_size", [None, 8])  # 8: rows share each target pass (spectrain/decoding/batched.py)
@pytest.mark.parametrize("tree", [None, {"topk": 2}])
def test_end_to_end_sampling_is_exact(tree, batch_size):
    target, draft = _e2e_models()
    prompt, temp, n = [1, 2], 1.3, 200
    counts, stats = e2e_counts(target, DraftLMDrafter(draft, target), prompt, n, temp, tree, batch_size)
    assert 0.05 < stats.acceptance_rate < 0.95  # both acceptances and rejections happen
    assert chi_square_pvalue(counts, e2e_exact(target, prompt, temp), n) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [None, 16])
def test_end_to_end_broken_residual_is_caught(monkeypatch, batch_size):
    target, draft = _e2e_models()
    prompt, temp, n = [1, 2], 1.3, 1500
    monkeypatch.setattr(acceptance, "_RESIDUAL_FROM_P", True)
    counts, _ = e2e_counts(target, DraftLMDrafter(draft, target), prompt, n, temp, batch_size=batch_size)
    assert chi_square_pvalue(counts, e2e_exact(target, prompt, temp), n) < 1e-4
