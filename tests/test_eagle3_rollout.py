"""EAGLE-3 draft-path rollouts (drafter.eagle3.rollout; spectrain/drafters/eagle3/rollout.py)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import make_tiny_target
from test_train import losses, make_rows, tiny_recipe

from spectrain.drafters.eagle3.rollout import Rollout, first_divergence, verify_nodes
from spectrain.recipe.load import recipe_from_dict
from spectrain.train import loop as T
from spectrain.train.setup import drafter_class
from spectrain.train.sources import OnlineSource

torch.set_num_threads(1)


def test_verify_pass_equals_a_target_forward_over_each_drafted_prefix():
    target = make_tiny_target("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 12), generator=g)
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, 9:] = 0  # right padding
    anchors = torch.tensor([[2, 5], [4, -1]])
    nodes = torch.randint(3, 128, (2, 2, 3), generator=g)
    got = verify_nodes(target, ids, am, anchors, nodes)
    for b, a in [(0, 0), (0, 1), (1, 0)]:
        t = int(anchors[b, a])
        for j in range(3):
            seq = torch.cat([ids[b, : t + 2], nodes[b, a, : j + 1]])[None]
            want = target.forward(seq, want_last_hidden=True, want_logits=False).last_hidden[0, -1]
            torch.testing.assert_close(got[b, a, j], want, atol=1e-5, rtol=1e-5)


def test_first_divergence():
    d = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3]])
    assert first_divergence(d, torch.tensor([[1, 2, 3]] * 3)).tolist() == [3, 1, 0]


def _head_and_batch():
    target = make_tiny_target("llama")
    recipe = tiny_recipe("unused")
    recipe.drafter.eagle3.rollout.anchors = 64  # every anchor
    rows = make_rows(4)
    from spectrain.data.dataset import token_frequencies

    head = drafter_class("eagle3").from_recipe(recipe, target, token_frequencies(rows, target.vocab_size))
    src = OnlineSource(rows, target, 0, "cpu")
    src.bind(head.feature_spec())
    batch, feats = src.get([0, 1, 2, 3])
    return head, target, batch, feats


def test_a_rollout_that_drafts_the_data_tokens_is_plain_ttt(monkeypatch):
    """With drafts forced onto the data path, every substituted teacher is the data's: the losses agree, so the
    substitution indexing (anchor t, step i -> node i-1 -> p_{t+1+i}) is right."""
    head, target, batch, feats = _head_and_batch()
    with torch.no_grad():
        plain = head.train_loss(batch, feats, target)

    def feed_data(self, i, prev_logits, data_tok):
        self.drafts.append(data_tok[torch.arange(len(self.anchors))[:, None], self.anchors.clamp_min(0)])
        return data_tok

    monkeypatch.setattr(Rollout, "feed", feed_data)
    with torch.no_grad():
        rolled = head.train_loss({**batch, "rollout_seed": 0}, feats, target)
    assert rolled[0].item() == pytest.approx(plain[0].item(), rel=1e-5)
    for k in ("acc_1", "acc_2", "acc_t1_2"):
        assert rolled[1][k] == pytest.approx(plain[1][k], rel=1e-5)


def test_a_real_rollout_changes_the_later_steps_only():
    head, target, batch, feats = _head_and_batch()
    with torch.no_grad():
        plain = head.train_loss(batch, feats, target)[1]
        rolled = head.train_loss({**batch, "rollout_seed": 0}, feats, target)[1]
    assert rolled["loss_0"] == pytest.approx(plain["loss_0"], rel=1e-6)  # step 0 has no draft of its own to feed
    assert rolled["loss_1"] != pytest.approx(plain["loss_1"], rel=1e-3)
    assert 0.0 <= rolled["rollout_div_step"] <= 2 and 0.0 <= rolled["rollout_off_path"] <= 1


def test_recipe_validation():
    with pytest.raises(ValueError, match="did you mean 'anchors'"):
        recipe_from_dict({}, ["drafter.eagle3.rollout.anchor=4"])
    with pytest.raises(ValueError, match="training.packing=false"):
        recipe_from_dict({"training": {"packing": True}}, ["drafter.eagle3.rollout.fraction=0.5"])
    with pytest.raises(ValueError, match="ttt_steps >= 2"):
        recipe_from_dict({}, ["drafter.eagle3.rollout.fraction=0.5", "drafter.eagle3.ttt_steps=1"])
    with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
        recipe_from_dict({}, ["drafter.eagle3.rollout.fraction=2"])


def _run(out, stop_at=None, **training):
    def preempt(run, rec):
        if run.state["step"] == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    r = tiny_recipe(out, **training)
    r.drafter.eagle3.rollout.fraction, r.drafter.eagle3.rollout.anchors = 0.5, 4
    r.drafter.eagle3.rollout.temperature = 1.0  # sampled drafts: the generator must be reproduced too
    return T.train(r, target=make_tiny_target("llama"), train_rows=make_rows(12), heldout_rows=None,
                   on_step=preempt if stop_at else None)


def test_rollout_training_logs_its_metrics_and_resumes_exactly(tmp_path):
    kw = dict(max_steps=6, checkpoint_every=2, eval_every=0)
    _run(tmp_path / "full", **kw)
    recs = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["on_policy"] for r in steps] == [0.0, 1.0] * 3
    assert all(("rollout_off_path" in r) == (r["on_policy"] == 1.0) for r in steps)
    assert _run(tmp_path / "split", stop_at=3, **kw)["interrupted_by"] == signal.SIGTERM
    assert _run(tmp_path / "split", resume_from="auto", **kw)["steps_this_run"] == 3
    assert losses(tmp_path / "full") == losses(tmp_path / "split")
