"""On-policy distillation under DDP (2 CPU processes, gloo): each rank rolls out its own micro-batches, and the
run equals one process with gradient accumulation (the rollouts are seeded per global micro-batch)."""

from __future__ import annotations

import json

import pytest
from test_distributed import (
    TOL,
    _run,
    build_tiny_assets,
    load_drafter_weights,
    max_weight_diff,
    write_recipe,
)

ON_POLICY = ["drafter.kind=draft", "drafter.draft.init=layers:0,7", "training.on_policy.fraction=0.5",
             "training.on_policy.max_new_tokens=8", "training.on_policy.temperature=1.0"]


@pytest.mark.slow
def test_ddp_on_policy_two_processes_match_one_process(tmp_path):
    assets = (tmp_path, build_tiny_assets(tmp_path, 40))
    recipe = write_recipe(tmp_path, assets[1], "op", max_steps=4)
    one = _run(assets, recipe, "single", "python", 1, ON_POLICY)
    two = _run(assets, recipe, "ddp", "torchrun", 2, ON_POLICY, env={"ACCELERATE_USE_CPU": "1"})
    assert [r["world"] for r in two["records"]] == [2, 2]
    diff, key = max_weight_diff(load_drafter_weights(one["out"]), load_drafter_weights(two["out"]))
    assert diff <= TOL, f"{key} differs by {diff:.3g}"
    recs = [[json.loads(x) for x in (r["out"] / "metrics.jsonl").read_text().splitlines()] for r in (one, two)]
    m1, m2 = ([m for m in rs if "loss" in m and "split" not in m] for rs in recs)
    assert [m["on_policy"] for m in m2] == [0.0, 1.0, 0.0, 1.0]
    for a, b in zip(m1, m2):  # the same rollouts: generated tokens counted over both ranks
        assert a["gen_tokens"] == b["gen_tokens"] and abs(a["loss"] - b["loss"]) < 1e-6
    assert m2[1]["gen_tokens"] > 0


# EAGLE-3 draft-path rollouts with the LK loss, and Medusa with the acceptance loss: the rollout anchors and the
# sampled drafts are seeded per global micro-batch, and lambda (LK) is per micro-batch, so 2 ranks equal 1 process
ROLLOUT_LK = ["training.packing=false", "drafter.loss=lk", "drafter.eagle3.rollout.fraction=0.5",
              "drafter.eagle3.rollout.anchors=4", "drafter.eagle3.rollout.temperature=1.0"]
MEDUSA_ACCEPT = ["drafter.kind=medusa", "drafter.medusa.num_heads=2", "drafter.medusa.num_resblocks=1",
                 "drafter.loss=accept"]


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [("rollout_lk", ROLLOUT_LK), ("medusa_accept", MEDUSA_ACCEPT)])
def test_ddp_acceptance_loss_and_eagle3_rollouts_two_processes_match_one_process(tmp_path, name, extra):
    assets = (tmp_path, build_tiny_assets(tmp_path, 40))
    recipe = write_recipe(tmp_path, assets[1], name, max_steps=4)
    one = _run(assets, recipe, "single", "python", 1, extra)
    two = _run(assets, recipe, "ddp", "torchrun", 2, extra, env={"ACCELERATE_USE_CPU": "1"})
    diff, key = max_weight_diff(load_drafter_weights(one["out"]), load_drafter_weights(two["out"]))
    assert diff <= TOL, f"{key} differs by {diff:.3g}"
    recs = [[json.loads(x) for x in (r["out"] / "metrics.jsonl").read_text().splitlines()] for r in (one, two)]
    m1, m2 = ([m for m in rs if "loss" in m and "split" not in m] for rs in recs)
    assert len(m1) == len(m2) == 4
    for a, b in zip(m1, m2):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["acc_t1_0"] - b["acc_t1_0"]) < 1e-5
    if name == "rollout_lk":
        assert [m["on_policy"] for m in m2] == [0.0, 1.0, 0.0, 1.0]
        assert m2[1]["rollout_off_path"] == m1[1]["rollout_off_path"]
