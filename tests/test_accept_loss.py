"""Acceptance-shaped losses (drafter.loss accept / lk) for EAGLE-3 and Medusa, and the T=1 acceptance proxy
(acc_t1_i = mean sum_v min(p, q) per TTT step / head, sim_tau_t1) every family logs whatever the loss."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import make_tiny_target
from test_train import losses, make_rows

from spectrain.recipe.load import recipe_from_dict
from spectrain.train import loop as T
from spectrain.train.setup import drafter_class

torch.set_num_threads(1)


def _recipe(out, kind: str, loss: str, vocab: int = 64, max_steps: int = 10):
    drafter = {"kind": kind, "loss": loss, "eagle3": {"draft_vocab_size": vocab, "ttt_steps": 3},
               "medusa": {"num_heads": 3, "num_resblocks": 1}}
    t = {"global_batch_size": 4, "micro_batch_size": 4, "max_steps": max_steps, "warmup_steps": 0,
         "eval_every": max_steps, "checkpoint_every": 100, "lr": 1e-2, "schedule": "constant"}
    return recipe_from_dict({"drafter": drafter, "training": t, "tracking": {"report_to": ["jsonl"]},
                             "output_dir": str(out)})


def _records(out):
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r and "split" not in r], [r for r in recs if r.get("split") == "heldout"]


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
@pytest.mark.parametrize("loss", ["accept", "lk"])
def test_acceptance_loss_trains_and_the_t1_proxy_is_logged(tmp_path, kind, loss):
    rows = make_rows(4)  # one global batch, seen every step: the loss on it must fall
    T.train(_recipe(tmp_path / "run", kind, loss), target=make_tiny_target("llama"), train_rows=rows,
            heldout_rows=make_rows(4, seed=1))
    train, ev = _records(tmp_path / "run")
    assert len(train) == 10
    assert train[-1]["loss"] < 0.9 * train[0]["loss"], [r["loss"] for r in train]
    assert train[-1]["acc_t1_0"] > train[0]["acc_t1_0"]
    for rec, pre in ((train[-1], ""), (ev[-1], "eval/")):
        assert all(0.0 <= rec[f"{pre}acc_t1_{i}"] <= 1.0 for i in range(3))
        assert 1.0 <= rec[f"{pre}sim_tau_t1"] <= 4.0


def _eagle3_metrics(vocab: int):
    from spectrain.train.sources import OnlineSource

    target = make_tiny_target("llama")
    recipe = _recipe("unused", "eagle3", "accept", vocab=vocab)
    rows = make_rows(4)
    from spectrain.data.dataset import token_frequencies

    drafter = drafter_class("eagle3").from_recipe(recipe, target, token_frequencies(rows, target.vocab_size))
    src = OnlineSource(rows, target, 0, "cpu")
    src.bind(drafter.feature_spec())
    batch, feats = src.get([0, 1, 2, 3])
    with torch.no_grad():
        return drafter.train_loss(batch, feats, target)[1]


def test_eagle3_acceptance_proxy_uses_the_full_target_distribution():
    # full draft vocab: restricted == full p, so the proxy is exactly 1 - the accept loss of each step
    m = _eagle3_metrics(128)
    for i in range(3):
        assert m[f"acc_t1_{i}"] == pytest.approx(1.0 - m[f"loss_{i}"], abs=1e-5)
    # a reduced vocab renormalises p for the loss; the proxy keeps p's mass outside the vocab as rejected
    m = _eagle3_metrics(16)
    assert all(m[f"acc_t1_{i}"] < 1.0 - m[f"loss_{i}"] for i in range(3))


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_lk_run_interrupted_then_resumed_equals_the_uninterrupted_run(tmp_path, kind):
    """LK's lambda is computed from the micro-batch's own overlap (no state outside the weights and Adam), so a
    SIGTERM + resume must reproduce every step's loss bitwise."""

    def run(out, stop_at=None, resume=False):
        r = _recipe(out, kind, "lk", max_steps=6)
        r.training.checkpoint_every, r.training.eval_every, r.training.global_batch_size = 2, 0, 4
        r.training.micro_batch_size = 2
        if resume:
            r.training.resume_from = "auto"

        def preempt(run_, rec):
            if run_.state["step"] == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)

        return T.train(r, target=make_tiny_target("llama"), train_rows=make_rows(12), heldout_rows=None,
                       on_step=preempt if stop_at else None)

    run(tmp_path / "full")
    assert run(tmp_path / "split", stop_at=3)["interrupted_by"] == signal.SIGTERM
    assert run(tmp_path / "split", resume=True)["steps_this_run"] == 3
    assert losses(tmp_path / "full") == losses(tmp_path / "split")
