"""EAGLE-3 training options: lm_head from the target / frozen, the trained-position and out-of-vocab
rules, sequence packing (equal to padded rows, no cross-document attention), AdamW betas, threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import make_tiny_target

from spectrain.data.packing import PackedDocs, pack_rows
from spectrain.drafters.eagle3.model import Eagle3Head
from spectrain.recipe.load import load_recipe, recipe_from_dict
from spectrain.recipe.schema import Recipe

torch.set_num_threads(1)


def make_head(target, seed=0, vocab=96, **eagle3):
    r = Recipe()
    r.drafter.eagle3.draft_vocab_size, r.drafter.eagle3.ttt_steps = vocab, 3
    for k, v in eagle3.items():
        setattr(r.drafter.eagle3, k, v)
    torch.manual_seed(seed)
    return Eagle3Head.from_recipe(r, target, torch.randint(0, 1000, (target.vocab_size,)))


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


def padded_batch(target, head, lengths=(14, 9, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, target.vocab_size, (len(lengths), t), generator=g)
    am = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).long()
    lm = (torch.rand(len(lengths), t, generator=g) > 0.3).long() * am
    out = target(ids, am, aux_layers=head.aux_layers, want_last_hidden=True, want_logits=False)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}, \
        {"aux": torch.cat(out.aux_hidden, -1), "last_hidden": out.last_hidden}


def test_lm_head_from_target_rows_frozen_and_recorded(target, tmp_path):
    head = make_head(target, lm_head_init="target", freeze_lm_head=True)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[head.draft_ids])
    assert not head.lm_head.weight.requires_grad and head.fc.weight.requires_grad
    assert torch.equal(head.norm.weight, torch.ones_like(head.norm.weight))  # "target" leaves the norm alone
    assert head.config["lm_head_init"] == "target" and head.config["freeze_lm_head"] is True
    from spectrain.train.schedule import build_optimizer

    opt, params = build_optimizer(Recipe(), head, target)
    assert all(p is not head.lm_head.weight for p in params)
    head.save_pretrained(tmp_path / "h")
    back = Eagle3Head.from_pretrained(tmp_path / "h", target)
    assert not back.lm_head.weight.requires_grad and torch.equal(back.lm_head.weight, head.lm_head.weight)
    with_norm = make_head(target, lm_head_init="target_with_norm")
    assert torch.equal(with_norm.norm.weight, target.norm.weight) and with_norm.lm_head.weight.requires_grad
    # the pair (norm, lm_head) from the target maps the target's last hidden state to its own logits
    h = torch.randn(4, target.hidden_size)
    assert torch.allclose(with_norm.lm_head(with_norm.norm(h)), target.logits_from_last_hidden(h)[:, head.draft_ids],
                          atol=1e-5)
    random = make_head(target)
    assert random.lm_head.weight.requires_grad and not torch.equal(random.lm_head.weight, head.lm_head.weight)


def _mask_counts(target, head, batch, feats):
    _, met = head.train_loss(batch, feats, target)
    return met["tokens"]


def test_loss_position_and_out_of_vocab_rules(target):
    head = make_head(target, vocab=40)  # a small draft vocab: some target argmaxes fall outside it
    batch, feats = padded_batch(target, head)
    lm, am = batch["loss_mask"].bool(), batch["attention_mask"].bool()
    with torch.no_grad():
        in_vocab = head.t2d[target.logits_from_last_hidden(feats["last_hidden"]).argmax(-1)]
    t = lm.shape[1]
    pred = lm[:, 2:] & in_vocab[:, 1:t - 1]  # step 0, anchor t: predicted token t+2 is the assistant's
    inp = lm[:, 1:] & in_vocab[:, 1:]  # speculators: input token t+1 is the assistant's
    assert 0 < int((lm[:, 2:] & ~in_vocab[:, 1:t - 1]).sum())  # the rule has something to drop
    assert _mask_counts(target, head, batch, feats) == float(pred.sum())
    head.config["loss_positions"] = "input"
    assert _mask_counts(target, head, batch, feats) == float(inp.sum())
    head.config["out_of_vocab"] = "keep"
    assert _mask_counts(target, head, batch, feats) == float((lm[:, 1:] & am[:, 1:]).sum())
    head.config["loss_positions"] = "predicted"
    assert _mask_counts(target, head, batch, feats) == float(lm[:, 2:].sum())


@pytest.mark.parametrize("rule", ["predicted", "input"])
def test_packed_rows_train_exactly_like_padded_rows(target, rule):
    head = make_head(target, loss_positions=rule)
    batch, feats = padded_batch(target, head)
    loss, met = head.train_loss(batch, feats, target)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters()}
    head.zero_grad()
    pb, pf = pack_rows(batch, feats)
    assert pb["input_ids"].shape == (1, 28) and pb["doc_lengths"].tolist() == [14, 9, 5]
    ploss, pmet = head.train_loss(pb, pf, target)
    ploss.backward()
    assert float(ploss.detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert {k: pytest.approx(v, rel=1e-5, abs=1e-6) for k, v in met.items()} == pmet
    for n, p in head.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-6, rtol=1e-4), n


def test_packed_attention_never_crosses_documents(target):
    head = make_head(target)
    batch, feats = padded_batch(target, head, lengths=(7, 7))
    pb, pf = pack_rows(batch, feats)
    docs = PackedDocs(pb["doc_lengths"])
    assert docs.positions.tolist() == [list(range(7)) * 2] and docs.mask0.shape == (2, 1, 7, 7)
    with torch.no_grad():
        ref = head.ttt_logits(pb["input_ids"], pb["attention_mask"], pf["aux"], target, 3, docs)
        pf2 = {k: v.clone() for k, v in pf.items()}
        pf2["aux"][:, 7:] += 5.0  # another second document
        other = head.ttt_logits(pb["input_ids"], pb["attention_mask"], pf2["aux"], target, 3, docs)
    for a, b in zip(ref, other):
        assert torch.equal(a[:, :7], b[:, :7]) and not torch.allclose(a[:, 7:], b[:, 7:])


def test_pack_rows_refuses_left_padding(target):
    head = make_head(target)
    batch, feats = padded_batch(target, head)
    batch["attention_mask"] = batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="right-padded"):
        pack_rows(batch, feats)


def test_recipe_keys_betas_threads_packing(tmp_path, monkeypatch):
    r = load_recipe("recipes/tiny/eagle3.yaml", ["training.adam_betas=0.9,0.999", "training.num_threads=3"])
    assert r.training.adam_betas == [0.9, 0.999] and r.training.num_threads == 3
    for bad, msg in (("training.adam_betas=0.9", "two numbers"), ("training.adam_betas=0.9,1.0", r"\[0, 1\)"),
                     ("training.num_threads=-1", "must be >= 0"),
                     ("drafter.eagle3.lm_head_init=copy", "not one of random, target, target_with_norm")):
        with pytest.raises(ValueError, match=msg):
            load_recipe("recipes/tiny/eagle3.yaml", [bad])
    with pytest.raises(ValueError, match="packing=true is implemented for drafter.kind=eagle3 only"):
        recipe_from_dict({"drafter": {"kind": "medusa"}, "training": {"packing": True}})
    from spectrain.train.distributed import resolve_num_threads

    monkeypatch.delenv("SPECTRAIN_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_num_threads(0) == 2 and resolve_num_threads(5) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_num_threads(0) == 3
    monkeypatch.setenv("SPECTRAIN_NUM_THREADS", "1")
    assert resolve_num_threads(0) == 1
    monkeypatch.setenv("SPECTRAIN_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="SPECTRAIN_NUM_THREADS"):
        resolve_num_threads(0)


FAULTS_AFTER_ALLOC_FREE = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from spectrain.train.distributed import keep_freed_memory
    assert keep_freed_memory()
torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # the first allocation faults in either case
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # 64 MiB, over glibc's largest mmap threshold
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_training_keeps_freed_memory_instead_of_faulting_it_in_again(monkeypatch):
    """With $SPECTRAIN_MALLOC=keep a training process reuses freed vocabulary-sized buffers: allocating and freeing
    64 MiB eight times page-faults every time under glibc's defaults and about once after keep_freed_memory();
    unset (the default), it leaves glibc's defaults alone."""

    def faults(mode):
        out = subprocess.run([sys.executable, "-c", FAULTS_AFTER_ALLOC_FREE, mode], capture_output=True, text=True,
                             check=True, env={**os.environ, "SPECTRAIN_MALLOC": "keep"})
        return int(out.stdout.split()[-1])

    page_faults_per_round = (64 << 20) // 4096
    default, kept = faults("default"), faults("keep")
    assert default >= 6 * page_faults_per_round, default  # every round faults its pages in again
    assert kept <= 2 * page_faults_per_round, (kept, default)  # the heap grows once, then reuses
    from spectrain.train.distributed import keep_freed_memory

    monkeypatch.setenv("SPECTRAIN_MALLOC", "")  # opt-in: glibc's defaults unless asked (empty = unset)
    assert keep_freed_memory() is False
    monkeypatch.delenv("SPECTRAIN_MALLOC")
    assert keep_freed_memory() is False


def test_an_unknown_malloc_setting_is_refused_before_anything_is_written(monkeypatch, tmp_path, capsys):
    """Only "keep" or unset / empty: a typo must not quietly train with the other allocator (twice the memory, or
    half the speed). Refused by `train` (before the run directory is touched, before any process starts) and by
    `check`, in one line naming the accepted values."""
    from spectrain import cli
    from spectrain.train import loop
    from spectrain.train.distributed import keep_freed_memory

    run = tmp_path / "run"
    for bad in ("system", "Keep", "on", "1"):
        monkeypatch.setenv("SPECTRAIN_MALLOC", bad)
        with pytest.raises(ValueError, match=r"SPECTRAIN_MALLOC=.* use SPECTRAIN_MALLOC=keep .* unset / empty"):
            keep_freed_memory()
        r = Recipe()
        r.output_dir = str(run)
        with pytest.raises(ValueError, match="SPECTRAIN_MALLOC"):
            loop.train(r)
        assert cli.main(["train", "tiny/eagle3", f"output_dir={run}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"$SPECTRAIN_MALLOC='{bad}' is not a known setting" in err[0], err
        assert not run.exists()
    assert cli.main(["check", "tiny/eagle3", f"output_dir={run}"]) != 0
    said = capsys.readouterr()
    assert "FAILED: $SPECTRAIN_MALLOC='1' is not a known setting" in said.out + said.err
    assert not run.exists()


def test_the_run_records_the_allocator_setting_in_effect(monkeypatch, tmp_path):
    import json

    from spectrain.train import distributed
    from spectrain.train.run_dir import write_run_info

    for env, kept in (("keep", True), ("keep", False), (None, False)):  # keep asked, not applied: a GPU run
        if env is None:
            monkeypatch.delenv("SPECTRAIN_MALLOC", raising=False)
        else:
            monkeypatch.setenv("SPECTRAIN_MALLOC", env)
        monkeypatch.setattr(distributed, "_malloc_kept", kept)
        write_run_info(tmp_path, Recipe(), 1)
        info = json.loads((tmp_path / "run_info.json").read_text())
        assert info["malloc"] == {"SPECTRAIN_MALLOC": env, "keep_freed_memory": kept}


def test_betas_reach_adamw(target):
    from spectrain.train.schedule import build_optimizer

    r = Recipe()
    r.training.adam_betas = [0.8, 0.99]
    opt, _ = build_optimizer(r, make_head(target), target)
    assert all(g["betas"] == (0.8, 0.99) for g in opt.param_groups)


def test_training_loop_with_packing_matches_padded_and_frozen_head_stays(tmp_path):
    """training.packing=true in the loop: the same loss sequence as padded rows; a frozen lm_head from the
    target is bit-identical after training."""
    from test_train import losses, make_rows, tiny_recipe

    from spectrain.train import loop as T

    target = make_tiny_target("llama")
    rows, held = make_rows(12), make_rows(2, seed=1)
    for name, packing in (("pad", False), ("pack", True)):
        r = tiny_recipe(tmp_path / name, max_steps=2, packing=packing)
        r.drafter.eagle3.lm_head_init, r.drafter.eagle3.freeze_lm_head = "target", True
        T.train(r, target=target, train_rows=rows, heldout_rows=held)
    head = Eagle3Head.from_pretrained(tmp_path / "pack" / "last", target)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[head.draft_ids])
    a, b = losses(tmp_path / "pad"), losses(tmp_path / "pack")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2]
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for (_, x), (_, y) in zip(a, b)), (a, b)
