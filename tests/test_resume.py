"""Exact resume: a run interrupted (SIGTERM) at step s and resumed equals an uninterrupted run, bitwise."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file
from test_train import fake, losses, make_rows, tiny_recipe  # noqa: F401  (fake is a fixture)

from spectrain import registry
from spectrain.train import loop as T

REAL_EAGLE3 = registry.FAMILIES["eagle3"]

torch.set_num_threads(1)


def _run(out, stop_at=None, **training):
    """Train on fresh copies of the same target/data; optionally SIGTERM ourselves after step `stop_at`."""

    def preempt(run, rec):
        if run.state["step"] == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    recipe = tiny_recipe(out, **training)
    return T.train(recipe, target=make_tiny_target("llama"), train_rows=make_rows(20),
                   heldout_rows=make_rows(4, seed=1), on_step=preempt if stop_at else None)


def _weights(run_dir):
    return load_file(str(run_dir / "last" / "model.safetensors"))


@pytest.mark.parametrize("drafter", ["eagle3", "fake-dropout"])
def test_sigterm_then_resume_is_bitwise_identical(tmp_path, drafter, fake):  # noqa: F811
    if drafter == "eagle3":
        registry.FAMILIES["eagle3"] = REAL_EAGLE3  # the real head (the fixture's monkeypatch restores the fake afterwards)
    else:
        fake.dropout = 0.3  # consumes the global torch RNG: exactness needs the RNG states restored
    # 20 rows / global batch 4 = 5 steps per epoch, so 9 steps cross an epoch boundary (reshuffle)
    kw = dict(max_steps=9, checkpoint_every=4, eval_every=3)
    full = _run(tmp_path / "full", **kw)
    assert full["interrupted_by"] is None
    first = _run(tmp_path / "split", stop_at=6, **kw)  # mid-epoch 2, between two checkpoints
    assert first["interrupted_by"] == signal.SIGTERM and first["step"] == 6
    assert (tmp_path / "split" / "last").resolve().name == "step-6"
    rest = _run(tmp_path / "split", resume_from="auto", **kw)
    assert rest["steps_this_run"] == 3 and rest["step"] == 9
    a, b = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert [s for s, _ in b] == list(range(1, 10))  # the resumed run appends; no duplicated steps
    assert a == b, f"loss sequences differ:\n{a}\n{b}"
    wa, wb = _weights(tmp_path / "full"), _weights(tmp_path / "split")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ea = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    eb = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    key = "eval/sim_tau_proxy"
    assert [r[key] for r in ea if key in r] == [r[key] for r in eb if key in r]


def test_resume_from_explicit_path_and_auto_without_checkpoint(tmp_path, fake):  # noqa: F811
    s = _run(tmp_path / "fresh", resume_from="auto", max_steps=4)  # auto on an empty dir: a fresh start
    assert s["steps_this_run"] == 4
    s = _run(tmp_path / "other", resume_from=str(tmp_path / "fresh" / "step-3"), max_steps=4)
    assert s["steps_this_run"] == 1 and s["step"] == 4


def test_resume_with_a_different_recipe_is_refused(tmp_path, fake):  # noqa: F811
    _run(tmp_path / "run", max_steps=4)
    with pytest.raises(ValueError, match=r"different recipe(.|\n)*training.lr"):
        _run(tmp_path / "run", max_steps=4, resume_from="auto", lr=1e-4)
    # fields that do not change the computation may differ
    s = _run(tmp_path / "branch", max_steps=4, resume_from=str(tmp_path / "run" / "step-3"), eval_every=1,
             checkpoint_every=1, keep_checkpoints=3)
    assert s["steps_this_run"] == 1
    # ...but not into the run's own dir, where step-4 (a later, good checkpoint) would be overwritten
    with pytest.raises(ValueError, match="later checkpoints"):
        _run(tmp_path / "run", max_steps=4, resume_from=str(tmp_path / "run" / "step-3"))


def test_resume_from_a_missing_dir_is_a_clear_error(tmp_path, fake):  # noqa: F811
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        _run(tmp_path / "run", resume_from=str(tmp_path / "nope"))


def test_atomic_checkpoint_leaves_no_partial_dir(tmp_path, fake, monkeypatch):  # noqa: F811
    """A failed write of step-N removes its temp dir (a killed one is removed by the next start); resume=auto
    picks the previous checkpoint."""
    from spectrain.train import checkpoint as ckpt

    real = ckpt.save_checkpoint
    calls = []

    def crash_second(acc, drafter, out, state, keep, **kw):
        calls.append(state["step"])
        if len(calls) == 2:
            drafter.save_pretrained = None  # makes the write fail half-way (after accelerate's state)
        return real(acc, drafter, out, state, keep, **kw)

    monkeypatch.setattr(ckpt, "save_checkpoint", crash_second)
    with pytest.raises(TypeError):
        _run(tmp_path / "run", max_steps=6, checkpoint_every=2)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-2"] and not (run / ".tmp-step-4").exists()
    (run / ".tmp-step-4" / "accelerate").mkdir(parents=True)  # what a kill -9 mid-save leaves
    monkeypatch.setattr(ckpt, "save_checkpoint", real)
    s = _run(run, max_steps=6, checkpoint_every=2, resume_from="auto")
    assert s["steps_this_run"] == 4 and not (run / ".tmp-step-4").exists()


def test_fresh_run_into_a_used_output_dir_is_refused(tmp_path, fake):  # noqa: F811
    _run(tmp_path / "run", max_steps=3)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        _run(tmp_path / "run", max_steps=3)
