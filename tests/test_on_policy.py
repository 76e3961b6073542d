"""On-policy distillation for the separate draft model (training.on_policy; spectrain/train/on_policy.py)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import make_tiny_model, make_tiny_target
from safetensors.torch import load_file
from test_draft_train import loop_recipe
from test_train import losses, make_rows

from spectrain.decoding.sampling import Sampler
from spectrain.recipe.load import recipe_from_dict
from spectrain.train import loop as T
from spectrain.train.on_policy import is_on_policy_step, prompt_of, sample_continuations

torch.set_num_threads(1)


def _recipe(out, fraction=1.0, refresh_every=1, **training):
    r = loop_recipe(out, **training)
    r.training.on_policy.fraction, r.training.on_policy.refresh_every = fraction, refresh_every
    r.training.on_policy.max_new_tokens = 6
    return r


def _records(out):
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r and "split" not in r]


# ---- recipe -----------------------------------------------------------------------------------------------


def test_recipe_keys_are_typed_validated_and_unknown_ones_rejected():
    base = {"drafter": {"kind": "draft", "draft": {"init": "layers:0,1"}}}
    r = recipe_from_dict(base, ["training.on_policy.fraction=0.5", "training.on_policy.temperature=0.7"])
    assert (r.training.on_policy.fraction, r.training.on_policy.temperature) == (0.5, 0.7)
    with pytest.raises(ValueError, match="did you mean 'fraction'"):
        recipe_from_dict(base, ["training.on_policy.fracton=0.5"])
    for bad, msg in [("fraction=1.5", "in \\[0, 1\\]"), ("temperature=-1", ">= 0"), ("max_new_tokens=0", ">= 1"),
                     ("refresh_every=0", ">= 1")]:
        with pytest.raises(ValueError, match=f"training.on_policy.{bad.split('=')[0]}.*{msg}"):
            recipe_from_dict(base, [f"training.on_policy.{bad}"])
    with pytest.raises(ValueError, match="drafter.kind=draft"):
        recipe_from_dict({}, ["training.on_policy.fraction=0.5"])  # EAGLE-3 has its own rollout option
    with pytest.raises(ValueError, match="hard_ce would train the student on its own samples"):
        recipe_from_dict({**base, "drafter": {**base["drafter"], "loss": "hard_ce"}}, ["training.on_policy.fraction=1"])


def test_an_option_switched_off_leaves_the_recipe_hash_unchanged():
    from spectrain.train.run_dir import recipe_hash

    r = recipe_from_dict({})
    d = r.to_dict()
    old = {**d, "training": {k: v for k, v in d["training"].items() if k != "on_policy"}}  # before the option
    assert recipe_hash(d) == recipe_hash(old)
    r.training.on_policy.fraction = 0.5
    assert recipe_hash(r.to_dict()) != recipe_hash(old)


# ---- pure pieces ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_on_policy_steps_are_evenly_spaced_at_the_fraction(fraction):
    on = [is_on_policy_step(s, fraction) for s in range(40)]
    assert sum(on) == round(40 * fraction)
    if fraction == 0.5:
        assert on[:4] == [False, True, False, True]


def test_prompt_is_the_row_up_to_its_first_trained_token():
    assert prompt_of({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}) == [5, 6]
    assert prompt_of({"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]}) == [5, 6, 7]
    assert prompt_of({"input_ids": [5, 6, 7], "loss_mask": [1, 1, 1]}) == [5]  # at least one token


def test_batched_left_padded_sampling_equals_hf_generate_row_by_row():
    model = make_tiny_model("llama", layers=2, seed=3)
    prompts = [[1, 5, 9, 17, 33, 5, 9], [1, 44], [1, 7, 7, 8, 3]]
    got = sample_continuations(model, prompts, 10, Sampler(), 128, eos=set(), pad_id=0)
    for p, g in zip(prompts, got):
        want = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
        assert g == want
    # an eos ends a row's continuation (kept), the others go on
    eos = {got[0][3]}
    cut = sample_continuations(model, prompts, 10, Sampler(), 128, eos=eos, pad_id=0)
    assert cut[0] == got[0][: got[0].index(got[0][3]) + 1]
    # sampling: reproducible from the generator's seed alone
    draws = [sample_continuations(model, prompts, 8, Sampler(1.0, generator=torch.Generator().manual_seed(7)),
                                  128, set(), 0) for _ in range(2)]
    assert draws[0] == draws[1] and draws[0] != got


# ---- the loop -----------------------------------------------------------------------------------------------


def test_rollout_steps_train_on_every_generated_position_and_lower_the_loss(tmp_path):
    T.train(_recipe(tmp_path / "run", fraction=0.5, max_steps=12, eval_every=0, checkpoint_every=0),
            target=make_tiny_target("llama"), train_rows=make_rows(8), heldout_rows=None)
    recs = _records(tmp_path / "run")
    on = [r for r in recs if r["on_policy"] == 1.0]
    assert [r["step"] for r in on] == [2, 4, 6, 8, 10, 12]
    for r in on:  # the loss counts exactly the sampled tokens: every generated position is scored and trained
        assert r["loss_tokens"] == r["gen_tokens"] > 0 and r["gen_s"] > 0 and 0 < r["gen_frac"] < 1
    assert all(r["gen_s"] == r["gen_tokens"] == 0 for r in recs if r["on_policy"] == 0.0)
    assert sum(r["loss"] for r in on[-2:]) < sum(r["loss"] for r in on[:2]), [r["loss"] for r in on]


@pytest.mark.parametrize("fraction,refresh", [(0.5, 1), (1.0, 3)])
def test_sigterm_then_resume_equals_the_uninterrupted_run(tmp_path, fraction, refresh):
    def run(out, stop_at=None, **kw):
        def preempt(r, rec):
            if r.state["step"] == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)

        return T.train(_recipe(out, fraction, refresh, max_steps=7, checkpoint_every=3, eval_every=0, **kw),
                       target=make_tiny_target("llama"), train_rows=make_rows(12), heldout_rows=None,
                       on_step=preempt if stop_at else None)

    run(tmp_path / "full")
    # stopped at step 5: with refresh_every 3 step 5 still samples from the snapshot taken at step 3
    assert run(tmp_path / "split", stop_at=5)["interrupted_by"] == signal.SIGTERM
    if refresh > 1:
        assert (tmp_path / "split" / "step-5" / "on_policy_sampler.safetensors").is_file()
    assert run(tmp_path / "split", resume_from="auto")["steps_this_run"] == 2
    a, b = _records(tmp_path / "full"), _records(tmp_path / "split")
    assert [(r["step"], r["loss"], r["gen_tokens"]) for r in a] == [(r["step"], r["loss"], r["gen_tokens"]) for r in b]
    wa, wb = (load_file(str(tmp_path / d / "last" / "model.safetensors")) for d in ("full", "split"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_stale_snapshot_samples_other_continuations_than_the_current_student(tmp_path):
    """refresh_every is not a no-op: between refreshes the rollouts come from the older weights."""
    kw = dict(max_steps=4, eval_every=0, checkpoint_every=0)
    T.train(_recipe(tmp_path / "a", 1.0, 1, **kw), target=make_tiny_target("llama"), train_rows=make_rows(8),
            heldout_rows=None)
    T.train(_recipe(tmp_path / "b", 1.0, 4, **kw), target=make_tiny_target("llama"), train_rows=make_rows(8),
            heldout_rows=None)
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert a[0] == b[0] and a[1:] != b[1:]
