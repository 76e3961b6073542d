"""EAGLE-2's dynamic tree is written once (spectrain/drafters/eagle3/tree.py): for the same row, the single-row
proposer and the batched one (several rows, one head forward per depth) grow the same tree, node for node:
tokens, parents and, when sampling, the q row each node was drawn from."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from test_batched_decoding import eagle3
from test_decoding import PROMPTS

from spectrain.decoding.interface import DraftContext, TargetFeatures
from spectrain.decoding.sampling import Sampler

torch.set_num_threads(1)


def _contexts(target, prop, prompts, sampler, tree, k):
    """First-step contexts: each prompt with the target's aux features of all but its newest token."""
    out = []
    for p in prompts:
        ids = torch.tensor(p)
        feats = target.forward(ids[None, :-1], aux_layers=prop.aux_layers, want_logits=False)
        aux = torch.cat(feats.aux_hidden, -1)[0]
        out.append(DraftContext(tokens=ids, k=k, sampler=sampler, features=TargetFeatures(0, aux=aux), tree=tree))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_single_row_and_batched_trees_are_the_same_tree(temperature):
    target = make_tiny_target("llama")
    prop = eagle3(target)
    prompts = [p for p in PROMPTS if len(p) > 1][:3]
    tree = {"topk": 3, "total_tokens": 10}

    def sampler():
        return Sampler(temperature, generator=torch.Generator().manual_seed(7))

    one = []
    for ctx in _contexts(target, prop, prompts, sampler(), tree, 4):
        prop.begin(ctx.tokens)
        one.append(prop.propose(ctx))
    # greedy: all rows in one batch; sampled: rows share one generator and a batch draws depth by depth across
    # its rows, so the same stream reaches the same tree only for a batch of one row
    groups = [prompts] if temperature == 0 else [[p] for p in prompts]
    many, s = [], sampler()
    for group in groups:
        prop.begin_batch([torch.tensor(p) for p in group])
        many += prop.propose_batch(_contexts(target, prop, group, s, tree, 4))
    for a, b in zip(one, many, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert len(a.tokens) == 10 and not a.is_chain
        assert (a.probs is None) == (b.probs is None) == (temperature == 0)
        if a.probs is not None:
            torch.testing.assert_close(a.probs, b.probs, rtol=0, atol=1e-6)
