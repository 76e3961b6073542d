"""The shared training loop: schedule, sharding, precision, run directory, best/, NaN handling, registry."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_target
from safetensors.torch import load_file, save_file
from torch import nn

from spectrain import registry
from spectrain.drafters.losses import sim_tau
from spectrain.recipe.load import recipe_from_dict
from spectrain.train import loop as T
from spectrain.train import metrics as M
from spectrain.train import schedule as S
from spectrain.train.setup import drafter_class

torch.set_num_threads(1)


# ---- helpers shared with test_resume.py ------------------------------------------------------------


def make_rows(n: int, seed: int = 0, vocab: int = 128) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(10, 32, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.long)
        mask[length // 3:] = 1
        rows.append({"id": f"r{i}", "input_ids": ids, "loss_mask": mask})
    return rows


def tiny_recipe(out: Path, **training):
    t = {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 6, "warmup_steps": 2, "eval_every": 3,
         "checkpoint_every": 3, "keep_checkpoints": 2, "lr": 3e-3}
    t.update(training)
    return recipe_from_dict({"drafter": {"eagle3": {"draft_vocab_size": 64, "ttt_steps": 3}},
                             "training": t, "tracking": {"report_to": ["jsonl"]}, "output_dir": str(out)})


class FakeDrafter(nn.Module):
    """A linear next-token head on the aux features. `dropout` consumes the global RNG (resume test);
    `nan_at` makes train_loss return NaN on those (1-based) training calls; `eval_acc` scripts the
    held-out accuracies so the best/ choice can be checked against the loss."""

    nan_at: set = set()
    eval_acc: list = []
    dropout: float = 0.0

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(dim, vocab)
        self.drop = nn.Dropout(self.dropout)
        self.calls = 0
        self.eval_calls = 0

    @classmethod
    def from_recipe(cls, recipe, target, token_counts):
        return cls(2 * target.hidden_size, target.vocab_size)

    def feature_spec(self) -> dict:
        return {"aux_layers": [1, 4], "want_last_hidden": False}

    def train_loss(self, batch, feats, target):
        logits = self.proj(self.drop(feats["aux"]))[:, :-1]
        labels, mask = batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:].bool()
        loss = F.cross_entropy(logits[mask].float(), labels[mask])
        acc = float((logits.argmax(-1)[mask] == labels[mask]).float().mean())
        if self.training:
            self.calls += 1
            if self.calls in self.nan_at:
                loss = loss * float("nan")
        elif self.eval_acc:
            acc = self.eval_acc[min(self.eval_calls, len(self.eval_acc) - 1)]
            self.eval_calls += 1
        return loss, {"acc_0": acc, "tokens": float(mask.sum())}

    def save_pretrained(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(Path(path) / "model.safetensors"))


def route_eagle3(monkeypatch, cls) -> None:
    """drafter.kind=eagle3 builds ``cls`` (its registry record, swapped for this test)."""
    real = registry.FAMILIES["eagle3"]
    monkeypatch.setitem(registry.FAMILIES, "eagle3",
                        dataclasses.replace(real, train=dataclasses.replace(real.train, head=cls, build="")))


@pytest.fixture
def fake(monkeypatch):
    """Route drafter.kind=eagle3 to FakeDrafter (fresh class attributes per test)."""
    cls = type("Fake", (FakeDrafter,), {"nan_at": set(), "eval_acc": [], "dropout": 0.0})
    route_eagle3(monkeypatch, cls)
    return cls


def losses(run_dir: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r and "split" not in r]


# ---- pure pieces -------------------------------------------------------------------------------------


def test_lr_schedules():
    f = S.lr_factor
    assert [f(s, "cosine", 4, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4, "cosine", 4, 20) == pytest.approx(1.0)
    assert f(12, "cosine", 4, 20) == pytest.approx(0.5)
    assert f(19, "cosine", 4, 20) < 0.02
    assert f(12, "linear", 4, 20) == pytest.approx(0.5)
    assert f(19, "constant", 4, 20) == 1.0
    assert f(0, "cosine", 0, 10) == 1.0  # no warmup: the first step runs at the peak lr


def test_sharding_no_duplicates_and_world_size_invariant():
    rows = S.epoch_order(37, seed=3, epoch=0)[:8]
    assert S.epoch_order(37, 3, 0) == S.epoch_order(37, 3, 0)
    assert S.epoch_order(37, 3, 0) != S.epoch_order(37, 3, 1)  # a fresh shuffle per epoch
    lengths = [int(x) % 5 for x in rows]
    one = S.rank_micro_batches(rows, lengths, micro=2, rank=0, world=1)  # 1 process, accumulation 4
    two = [S.rank_micro_batches(rows, lengths, micro=2, rank=r, world=2) for r in range(2)]
    four = [S.rank_micro_batches(rows, lengths, micro=2, rank=r, world=4) for r in range(4)]
    flat2 = [i for mbs in two for mb in mbs for i in mb]
    assert sorted(flat2) == sorted(rows)  # every row once, no duplicates across ranks
    # the same micro-batches exist whatever the world size: DDP == single process with accumulation
    as_set = lambda parts: sorted(tuple(mb) for mbs in parts for mb in mbs)  # noqa: E731
    assert as_set([one]) == as_set(two) == as_set(four)
    assert all(len(mbs) == 2 for mbs in two)


def test_precision_resolution():
    if not torch.cuda.is_available():
        assert T.resolve_precision("auto") == "no"
        with pytest.raises(ValueError, match="fp16 needs a CUDA"):
            T.resolve_precision("fp16")
    assert T.resolve_precision("fp32") == "no"
    assert T.resolve_precision("bf16") == "bf16"


def test_sim_tau_and_aggregate():
    assert sim_tau([]) == 1.0
    assert sim_tau([0.5, 0.5]) == pytest.approx(1.75)
    agg = M.aggregate([({"acc_0": 1.0, "acc_1": 0.0}, 1.0), ({"acc_0": 0.5, "acc_1": 1.0}, 3.0)])
    assert agg["acc_0"] == pytest.approx(0.625) and agg["acc_1"] == pytest.approx(0.75)
    assert agg["sim_tau"] == pytest.approx(1 + 0.625 + 0.625 * 0.75)


def test_registry_errors():
    with pytest.raises(ValueError, match="training-free"):
        drafter_class("ngram")
    with pytest.raises(ValueError, match="not a drafter family"):
        drafter_class("nonsense")


# ---- end to end on a tiny random target -----------------------------------------------------------------


def test_eagle3_run_dir(tmp_path):
    """The real EAGLE-3 head: run dir contents, pruning, last/best, frozen target, loadable best/."""
    from spectrain.drafters.eagle3.model import Eagle3Head

    target = make_tiny_target("llama")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    recipe = tiny_recipe(tmp_path / "run", max_steps=7, checkpoint_every=2, keep_checkpoints=2)
    s = T.train(recipe, target=target, train_rows=make_rows(24), heldout_rows=make_rows(6, seed=1))
    run = tmp_path / "run"
    assert s["step"] == 7 and s["interrupted_by"] is None
    assert all(torch.equal(v, target.model.state_dict()[k]) for k, v in before.items())  # target untouched
    info = json.loads((run / "run_info.json").read_text())
    assert info["world_size"] == 1 and info["target_fingerprint"] and info["versions"]["torch"] and "git_sha" in info and info["command"]
    assert info["grad_accum"] == 2 and (run / "recipe.yaml").is_file()
    ckpts = sorted(p.name for p in run.glob("step-*"))
    assert ckpts == ["step-6", "step-7"], ckpts  # keep_checkpoints=2; the final step always saved
    assert (run / "last").resolve().name == "step-7" and not list(run.glob(".tmp*"))
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "loss" in r and "split" not in r]
    assert [r["step"] for r in train_recs] == list(range(1, 8))
    assert all(k in train_recs[0] for k in ("acc_0", "acc_2", "lr", "grad_norm", "tokens_per_s", "sim_tau"))
    evals = [r for r in recs if r.get("split") == "heldout"]
    assert [r["step"] for r in evals] == [3, 6, 7] and all(r["eval/sim_tau_proxy"] >= 1.0 for r in evals)
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["sim_tau_proxy"] == max(r["eval/sim_tau_proxy"] for r in evals)
    head = Eagle3Head.from_pretrained(run / "best", target)
    assert torch.equal(head.d2t, Eagle3Head.from_pretrained(run / "last", target).d2t)


def test_best_by_sim_tau_not_loss(tmp_path, fake):
    fake.eval_acc = [0.2, 0.9, 0.1]  # held-out acc at steps 2, 4, 6: best is step 4 although loss keeps falling
    recipe = tiny_recipe(tmp_path / "run", eval_every=2, lr=1e-2)
    # 2 held-out rows = one eval batch per evaluation, so eval_acc[i] is evaluation i's accuracy
    T.train(recipe, target=make_tiny_target("llama"), train_rows=make_rows(24), heldout_rows=make_rows(2, 1))
    best = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert best["step"] == 4 and best["sim_tau_proxy"] == pytest.approx(1.9)


def test_nan_step_skipped_then_training_continues(tmp_path, fake):
    fake.nan_at = {3, 4}  # training calls 3-4 = both micro-batches of optimizer step 2
    recipe = tiny_recipe(tmp_path / "run", max_steps=4, max_nan_steps=3)
    weights = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        T.train(recipe, target=make_tiny_target("llama"), train_rows=make_rows(24), heldout_rows=None,
                on_step=lambda run, rec: weights.append(run.drafter.proj.weight.detach().clone()))
    assert any("non-finite loss" in str(w.message) for w in caught)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", 0) for r in recs if "loss" in r] == [0, 1, 0, 0]
    assert torch.equal(weights[0], weights[1])  # the NaN step did not touch the weights
    assert not torch.equal(weights[1], weights[2]) and torch.isfinite(weights[3]).all()
    assert (tmp_path / "run" / "best" / "best.json").is_file()  # no held-out split: final weights


def test_nan_streak_stops_with_clear_error(tmp_path, fake):
    fake.nan_at = set(range(1, 100))
    recipe = tiny_recipe(tmp_path / "run", max_nan_steps=2)
    with pytest.raises(T.TrainingDiverged, match="2 consecutive steps"):
        T.train(recipe, target=make_tiny_target("llama"), train_rows=make_rows(24), heldout_rows=None)


def test_target_param_in_optimizer_is_refused(tmp_path, monkeypatch):
    class Leaky(FakeDrafter):
        @classmethod
        def from_recipe(cls, recipe, target, token_counts):
            d = cls(2 * target.hidden_size, target.vocab_size)
            d.emb = target.embed_tokens  # shares the target's module ...
            d.emb.weight.requires_grad_(True)  # ... and un-freezes it: must never reach the optimizer
            return d

    route_eagle3(monkeypatch, Leaky)
    with pytest.raises(AssertionError, match="target parameters would be trained"):
        T.train(tiny_recipe(tmp_path / "run"), target=make_tiny_target("llama"), train_rows=make_rows(24))


def test_too_little_data_and_missing_tracker(tmp_path, fake):
    with pytest.raises(ValueError, match="fewer than training.global_batch_size"):
        T.train(tiny_recipe(tmp_path / "a"), target=make_tiny_target("llama"), train_rows=make_rows(3))
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        r = tiny_recipe(tmp_path / "b")
        r.tracking.report_to = ["tensorboard"]
        with pytest.raises(ValueError, match="pip install"):
            T.train(r, target=make_tiny_target("llama"), train_rows=make_rows(24))


def test_saved_best_weights_match_a_state_dict(tmp_path, fake):
    recipe = tiny_recipe(tmp_path / "run", max_steps=3, eval_every=3)
    T.train(recipe, target=make_tiny_target("llama"), train_rows=make_rows(24), heldout_rows=make_rows(4, 1))
    best = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    last = load_file(str(tmp_path / "run" / "last" / "model.safetensors"))
    assert set(best) == {"proj.weight", "proj.bias"} and torch.equal(best["proj.weight"], last["proj.weight"])


def test_offline_features_train_like_online(tmp_path):
    """Same seed, same rows: the loop over the feature cache (fp32) reproduces the online loss sequence."""
    from spectrain.data.features import write_feature_cache

    target = make_tiny_target("llama")
    rows, held = make_rows(16), make_rows(4, seed=1)
    online = tiny_recipe(tmp_path / "on", max_steps=3)
    T.train(online, target=target, train_rows=rows, heldout_rows=held)
    aux = target.validate_aux_layers(target.default_aux_layers())
    write_feature_cache(target, {"train": rows, "heldout": held}, tmp_path / "cache", aux, dtype="fp32",
                        max_length=online.data.max_length, verbose=False)
    offline = tiny_recipe(tmp_path / "off", max_steps=3, features="offline", feature_cache=str(tmp_path / "cache"))
    T.train(offline, target=target, train_rows=rows, heldout_rows=held)
    a, b = losses(tmp_path / "on"), losses(tmp_path / "off")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3]
    assert all(abs(x - y) <= 1e-6 * max(1.0, abs(x)) for (_, x), (_, y) in zip(a, b)), (a, b)
    with pytest.raises(ValueError, match="feature_cache"):
        T.train(tiny_recipe(tmp_path / "x", features="offline"), target=target)
