"""Trackers: training namespaces, bookkeeping in the config, one wandb run across a resume; eval scalars
per (drafter, decode, prompt set) read back from the offline wandb run and from tensorboard files."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch
from conftest import make_tiny_target
from test_evaluate import workdir  # noqa: F401  (a fixture: tiny target, recipe, prompt files)
from test_train import fake, make_rows, tiny_recipe  # noqa: F401  (fake is a fixture)
from wandb_offline import read_run

from spectrain.cli import main as cli_main
from spectrain.eval.tracking import cell_key, drafter_label, scalars
from spectrain.train import loop as T
from spectrain.train.tracking import metric_key, split_record

torch.set_num_threads(1)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)


def test_metric_keys_and_bookkeeping():
    assert [metric_key(k) for k in ("loss", "acc_2", "sim_tau", "lr", "tokens_per_s", "eval/acc_0", "epoch", "step")] \
        == ["train/loss", "train/acc_2", "train/sim_tau_proxy", "train/lr", "train/tokens_per_s", "eval/acc_0",
            None, None]
    metrics, book = split_record({"step": 3, "split": "heldout", "heldout_rows": 13, "eval/sim_tau_proxy": 1.5,
                                  "eval/acc_0": 0.25, "wall_s": 2.0, "skipped": 1, "interrupted_by": None,
                                  "eval/loss_tokens": 99.0})
    assert metrics == {"eval/sim_tau_proxy": 1.5, "eval/acc_0": 0.25, "train/skipped": 1}
    assert book == {"run/heldout_rows": 13, "run/wall_s": 2.0, "run/heldout_loss_tokens": 99.0}


def _records():
    base = {"k": 3, "tree": None, "temperature": 0.0, "n_prompts": 2, "tau": 1.8, "acceptance_rate": 0.3,
            "measured_speedup": 0.9, "predicted_speedup": 1.5, "tokens_per_s": 100.0}
    return [{**base, "drafter": "ngram", "prompt_set": "heldout", "split": "held-out", "alpha": [0.5, 0.4, None]},
            {**base, "drafter": "ngram", "prompt_set": "spec_bench/rag", "split": "OOD", "alpha": [0.6, None, None],
             "tree": {"topk": 4, "depth": 3, "total_tokens": 8}, "temperature": 1.0}]


def test_eval_scalar_keys(tmp_path):
    recs = _records()
    assert cell_key(recs[0]) == "k3_T0/heldout/heldout"  # no drafter in the key: it is the run's attribute
    assert cell_key(recs[1]) == "tree4x3x8_T1/ood/spec_bench-rag"
    s = scalars(recs)
    assert s["tau/k3_T0/heldout/heldout"] == 1.8 and s["alpha_2/k3_T0/heldout/heldout"] == 0.4
    assert "alpha_3/k3_T0/heldout/heldout" not in s  # never verified: no made-up zero
    assert s["predicted_speedup/tree4x3x8_T1/ood/spec_bench-rag"] == 1.5
    run = tmp_path / "my-run"
    (run / "best").mkdir(parents=True)
    (run / "run_info.json").write_text("{}")
    assert drafter_label(str(run / "best")) == "my-run-best" and drafter_label(str(run)) == "my-run"


def _read_finished(run_dir, wait_s: float = 30.0):
    """read_run, waiting while wandb's service is still flushing the file (seen on a loaded 2-core host)."""
    deadline = time.monotonic() + wait_s
    while True:
        rec = read_run(run_dir)
        if (rec["id"] is not None and rec["history"]) or time.monotonic() > deadline:
            return rec
        time.sleep(0.5)


def _train(out, report_to, stop_at=None, **training):
    def preempt(run, rec):
        if run.state["step"] == stop_at:
            signal.raise_signal(signal.SIGTERM)

    recipe = tiny_recipe(out, **training)
    recipe.tracking.report_to = report_to
    return T.train(recipe, target=make_tiny_target("llama"), train_rows=make_rows(20),
                   heldout_rows=make_rows(4, seed=1), on_step=preempt if stop_at else None)


def test_training_wandb_namespaces_config_and_resume(tmp_path, fake, offline_wandb):  # noqa: F811
    out = tmp_path / "tiny-run-7"
    first = _train(out, ["jsonl", "wandb"], stop_at=3, max_steps=6)
    assert first["interrupted_by"] == signal.SIGTERM
    link = json.loads((out / "tracking.json").read_text())
    assert link["name"] == link["group"] == "tiny-run-7" and link["wandb_id"]
    _train(out, ["jsonl", "wandb"], max_steps=6, resume_from="auto")
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    a, b = (_read_finished(r) for r in runs)
    assert a["id"] == b["id"] == link["wandb_id"] and a["group"] == "tiny-run-7"  # one wandb run, resumed
    hist = a["history"] + b["history"]
    keys = set().union(*hist)
    assert {"train/loss", "train/acc_0", "train/lr", "train/tokens_per_s", "train/sim_tau_proxy", "train/step",
            "eval/sim_tau_proxy", "eval/acc_0", "eval/loss"} <= keys
    best = a["metrics"]["eval/sim_tau_proxy"]  # the runs table shows the best held-out sim tau, not the last
    assert best["summary"] == ["max"] and best["step_metric"] == "train/step"
    assert not keys & {"epoch", "heldout_rows", "wall_s", "loss", "tokens", "loss_tokens", "run/epoch"}
    assert sorted({h["train/step"] for h in hist if "train/loss" in h}) == list(range(1, 7))
    assert b["config"]["run/heldout_rows"] == 4 and b["config"]["run/wall_s"] > 0
    assert b["config"]["run/world_size"] == 1 and b["config"]["training.max_steps"] == 6
    assert "run/epoch" in b["config"]
    # a fresh run (no resume) into another dir gets its own wandb run and name
    _train(tmp_path / "other", ["wandb", "tensorboard"], max_steps=3)
    other = json.loads((tmp_path / "other" / "tracking.json").read_text())
    assert other["name"] == "other" and other["wandb_id"] != link["wandb_id"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(other["tensorboard_dir"])
    tb.Reload()
    assert {"train/loss", "train/lr", "eval/sim_tau_proxy"} <= set(tb.Tags()["scalars"])
    assert [e.step for e in tb.Scalars("train/loss")] == [1, 2, 3] and "epoch" not in tb.Tags()["scalars"]


def test_eval_wandb_scalars_join_the_training_group(workdir, tmp_path, offline_wandb, monkeypatch,  # noqa: F811
                                                    capsys):
    run = tmp_path / "runs" / "tiny-x"
    run.mkdir(parents=True)
    (run / "tracking.json").write_text(json.dumps({"project": "proj-x", "name": "tiny-x", "group": "tiny-x"}))
    # the n-gram drafter is what we decode with; the run dir stands in for a checkpoint's run (its link)
    argv = ["eval", "--recipe", str(workdir / "recipe.yaml"), "--drafter", "ngram", "--prompts", "heldout",
            "--prompts", str(workdir / "ood.jsonl"), "--n", "1", "--max-new-tokens", "8", "--k", "3",
            "--temperature", "0", "--out", str(run / "eval"), "--report-to", "wandb", "--report-to", "tensorboard"]
    from spectrain.eval import tracking as eval_tracking

    (run / "best").mkdir()
    link, where = eval_tracking.drafter_link(str(run / "best"))
    assert link["group"] == "tiny-x" and where == run and eval_tracking.drafter_link("ngram") == (None, None)
    # decode with n-gram, linked as if it were the run's checkpoint (no trained head needed)
    monkeypatch.setattr(eval_tracking, "drafter_link", lambda spec: (link, run))
    assert cli_main(argv) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    (wb,) = (run / "eval" / "wandb").glob("offline-run-*")
    got = _read_finished(wb)
    assert got["group"] == "tiny-x" and got["config"]["prompt_set_splits"] == {"heldout": "held-out", "ood": "OOD"}
    assert got["name"] == "eval" and got["config"]["drafter"] == "ngram"  # the final --out's name, not .tmp-...
    logged = got["history"][0]
    for r in report["records"]:
        cell = cell_key(r)
        assert logged[f"tau/{cell}"] == pytest.approx(r["tau"])
        for m in ("acceptance_rate", "measured_speedup", "predicted_speedup"):
            assert logged[f"{m}/{cell}"] == pytest.approx(r[m])
        for i, a in enumerate(r["alpha"], 1):
            assert (f"alpha_{i}/{cell}" in logged) == (a is not None)
    assert "tau/k3_T0/heldout/heldout" in logged and "tau/k3_T0/ood/ood" in logged
    assert any(k.startswith("acceptance/k3_T0") for k in logged) and any(k.startswith("report") for k in logged)
    assert {"plots/acceptance_k=3_T=0/path", "plots/tau/path"} <= set(logged)  # no drafter in plot keys either
    # tensorboard: the same scalars, and the per-position curve
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "eval" / "tensorboard" / "ngram"))  # one TensorBoard run per drafter
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"tau/{cell_key(r)}" for r in report["records"]} <= tags
    assert acc.Scalars("tau/k3_T0/heldout/heldout")[0].value == pytest.approx(report["records"][0]["tau"])
    assert list((run / "eval" / "tensorboard" / "ngram").glob("acceptance_k3_T0_*"))  # add_scalars: a dir per line
    out = capsys.readouterr().out
    assert f"wandb sync {wb}" in out and f"tensorboard --logdir {run / 'eval' / 'tensorboard'}" in out
    assert ".tmp-" not in out


def test_two_evals_of_two_drafters_share_every_wandb_key(workdir, tmp_path, offline_wandb):  # noqa: F811
    """The same cells of two drafters evaluated separately land on the same keys (so they overlay in one
    chart); each run is named after its eval's output directory and carries its drafter in the config."""
    common = ["eval", "--recipe", str(workdir / "recipe.yaml"), "--prompts", "heldout", "--n", "1",
              "--max-new-tokens", "6", "--k", "2", "--temperature", "0", "--report-to", "wandb"]
    got = {}
    for drafter, out in (("ngram", tmp_path / "eval-a"), (str(workdir / "target"), tmp_path / "eval-b")):
        assert cli_main([*common, "--drafter", drafter, "--out", str(out)]) == 0
        (wb,) = (out / "wandb").glob("offline-run-*")
        got[out.name] = _read_finished(wb)
    a, b = got["eval-a"], got["eval-b"]
    assert (a["name"], b["name"]) == ("eval-a", "eval-b")
    assert a["config"]["drafter"] == "ngram" and b["config"]["drafter"] == "target"
    keys_a, keys_b = set().union(*a["history"]), set().union(*b["history"])
    alphas = {f"alpha_{i}/k2_T0/heldout/heldout" for i in (1, 2)}  # a position never verified logs no alpha
    assert keys_a - alphas == keys_b - alphas and "tau/k2_T0/heldout/heldout" in keys_a
    assert "alpha_1/k2_T0/heldout/heldout" in keys_a & keys_b and (keys_a | keys_b) & alphas <= alphas
    # and the two reports compare prompt by prompt (ids written by the eval)
    rec_a = json.loads((tmp_path / "eval-a" / "report.json").read_text())["records"][0]
    assert len(rec_a["per_prompt"]["ids"]) == 1
    assert cli_main(["compare", str(tmp_path / "eval-a"), str(tmp_path / "eval-b")]) == 0
