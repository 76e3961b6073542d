"""Medusa heads: layout, loss alignment, tree selection, lossless decoding, persistence, training."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import pytest
import torch
from conftest import make_tiny_target

from spectrain.decoding.interface import DraftContext, TargetFeatures
from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.decoding.sampling import Sampler
from spectrain.drafters import load_drafter
from spectrain.drafters.losses import fkl
from spectrain.drafters.medusa import MedusaHeads, MedusaProposer, best_tree, load
from spectrain.recipe.load import recipe_from_dict
from spectrain.recipe.schema import Recipe
from spectrain.train import loop as T

torch.set_num_threads(1)


def make_heads(target, num_heads=3, num_resblocks=1, loss="fkl", perturb=0.0, seed=0):
    """Heads from a recipe; `perturb` > 0 gives the ResBlocks random weights (a non-trivial head)."""
    r = Recipe()
    r.drafter.kind, r.drafter.loss = "medusa", loss
    r.drafter.medusa.num_heads, r.drafter.medusa.num_resblocks = num_heads, num_resblocks
    heads = MedusaHeads.from_recipe(r, target, None)
    if perturb:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in heads.blocks.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * perturb)
    return heads


def final_hidden(target, ids, am=None):
    return target(ids, am, want_final_hidden=True, want_logits=False).final_hidden


def greedy_rows(target, n, gen_len=24, seed=0):
    """Prompt (6 random tokens, not trained) + the target's greedy continuation (trained)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p = torch.randint(3, target.vocab_size, (6,), generator=g)
        ids = torch.cat([p, torch.tensor(plain_generate(target, p, gen_len, eos_token_id=[]).tokens)])
        mask = torch.ones_like(ids)
        mask[:6] = 0
        rows.append({"id": f"r{i}", "input_ids": ids, "loss_mask": mask})
    return rows


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


def test_layout_identity_init_and_distinct_blocks(target):
    heads = make_heads(target, num_heads=2, num_resblocks=2)
    want = {f"blocks.{i}.layers.{j}.{w}" for i in range(2) for j in range(2) for w in ("weight", "bias")}
    assert set(heads.state_dict()) == want | {"lm_heads.0.weight", "lm_heads.1.weight"}  # vLLM names
    assert heads.feature_spec() == {"want_final_hidden": True}
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs))  # every ResBlock and vocab head is its own tensor (not shared)
    assert not {id(p) for p in heads.parameters()} & {id(p) for p in target.model.parameters()}
    ids = torch.randint(3, 128, (1, 9))
    logits = target(ids).logits
    # zero-initialised ResBlocks = identity: a fresh head is the target's own lm_head
    torch.testing.assert_close(heads(final_hidden(target, ids))[1], logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loss", ["fkl", "hard_ce"])
def test_loss_alignment_matches_hand_loop(target, loss):
    """Head i at anchor t: teacher = the target's logits at t+1+i (from a full forward), label token
    t+2+i, counted iff that token is an attended assistant token."""
    heads = make_heads(target, num_heads=3, loss=loss, perturb=0.3)
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 13))
    am, lm = torch.ones_like(ids), (torch.rand(2, 13) > 0.3).long()
    am[1, 9:], lm[1, 9:] = 0, 0
    fh = final_hidden(target, ids, am)
    total, met = heads.train_loss({"input_ids": ids, "attention_mask": am, "loss_mask": lm},
                                  {"final_hidden": fh}, target)
    with torch.no_grad():
        tl = target(ids, am).logits
    accs = []
    for i in range(3):
        per, hits = [], []
        for b, t in itertools.product(range(2), range(13 - 2 - i)):
            if not (lm[b, t + 2 + i] and am[b, t + 2 + i]):
                continue
            with torch.no_grad():
                s = heads.head_logits(i, fh[b, t])
            if loss == "fkl":
                per.append(float(fkl(s, tl[b, t + 1 + i])))
            else:
                per.append(float(-s.log_softmax(-1)[ids[b, t + 2 + i]]))
            hits.append(int(s.argmax() == tl[b, t + 1 + i].argmax()))
        assert met[f"loss_{i}"] == pytest.approx(sum(per) / len(per), rel=1e-4, abs=1e-6)
        assert met[f"acc_{i}"] == pytest.approx(sum(hits) / len(hits))
        accs.append(sum(hits) / len(hits))
        if i == 0:
            assert met["tokens"] == len(per)
    assert met["loss"] == pytest.approx(sum(met[f"loss_{i}"] for i in range(3)), rel=1e-5)
    assert met["sim_tau"] == pytest.approx(1 + accs[0] + accs[0] * accs[1] + accs[0] * accs[1] * accs[2])
    total.backward()
    assert heads.blocks[2].layers[0].weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in target.model.parameters())


def test_short_rows_and_empty_masks_give_finite_zero_loss(target):
    heads = make_heads(target, num_heads=4)
    ids = torch.randint(3, 128, (1, 3))  # heads 1..3 have no anchor at all
    fh = final_hidden(target, ids)
    loss, met = heads.train_loss({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                  "loss_mask": torch.ones_like(ids)}, {"final_hidden": fh}, target)
    assert torch.isfinite(loss) and met["loss_3"] == 0.0 and met["acc_3"] == 0.0
    loss.backward()


def test_best_tree_is_the_top_n_paths():
    g = torch.Generator().manual_seed(0)
    for m, depth, total in [(3, 3, 10), (2, 4, 7), (4, 2, 20), (1, 3, 5)]:
        logq = torch.randn(depth, m, generator=g).log_softmax(-1).sort(-1, descending=True).values.tolist()
        paths, parents = best_tree(logq, total)
        every = [p for d in range(1, depth + 1) for p in itertools.product(range(m), repeat=d)]
        score = {p: sum(logq[d][r] for d, r in enumerate(p)) for p in every}
        want = sorted(score.values(), reverse=True)[: min(total, len(every))]
        assert sorted((score[p] for p in paths), reverse=True) == pytest.approx(want)
        for i, (p, par) in enumerate(zip(paths, parents)):
            assert par < i and (par == -1 if len(p) == 1 else paths[par] == p[:-1])
        sib = [[p[-1] for p in paths if p[:-1] == q] for q in {p[:-1] for p in paths}]
        assert all(s == sorted(s) for s in sib)  # siblings likeliest (lowest rank) first


def _propose(heads, target, seq, k, tree=None):
    prop = MedusaProposer(heads, target)
    prop.begin(seq)
    fh = final_hidden(target, seq[None])[0, : seq.numel() - 1]
    ctx = DraftContext(tokens=seq, k=k, sampler=Sampler(), features=TargetFeatures(start=0, final_hidden=fh),
                       tree=tree)
    return prop, prop.propose(ctx)


def test_chain_and_tree_read_the_row_before_the_bonus_token(target):
    heads = make_heads(target, num_heads=4, perturb=0.3)
    seq = torch.randint(3, 128, (11,))
    fh = final_hidden(target, seq[None])[0]
    _, chain = _propose(heads, target, seq, 4)
    # decoding: head i on the row of position L-2 drafts position L+i (the training offset t+2+i)
    assert chain.tokens.tolist() == [int(heads.head_logits(i, fh[9]).argmax()) for i in range(4)]
    _, one = _propose(heads, target, seq, 3, {"topk": 1, "total_tokens": 8})
    assert one.tokens.tolist() == chain.tokens[:3].tolist() and one.parents.tolist() == [-1, 0, 1]
    _, tree = _propose(heads, target, seq, 3, {"topk": 3, "total_tokens": 10})
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    assert len(toks) == 10 and all(p < i for i, p in enumerate(par))
    depth = []
    for i, p in enumerate(par):
        depth.append(1 if p < 0 else depth[p] + 1)
        kids = [toks[c] for c, q in enumerate(par) if q == i]
        if kids:  # children at depth d+1 = the top of head d, likeliest first, whatever the path
            assert kids == heads.head_logits(depth[i], fh[9]).topk(3).indices.tolist()[: len(kids)]
    assert tree.probs is None  # deterministic: exact for greedy and sampling alike
    with pytest.raises(ValueError, match="at most 4 tokens"):
        _propose(heads, target, seq, 5)
    with pytest.raises(ValueError, match="lag the tokens"):
        MedusaProposer(heads, target).propose(DraftContext(seq, 2, Sampler(), TargetFeatures(0, final_hidden=fh[:5])))


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)])
def test_greedy_chain_and_tree_equal_generate(arch, tied, tmp_path):
    target = make_tiny_target(arch, tied)
    make_heads(target, num_heads=4, perturb=0.3).save_pretrained(tmp_path)
    drafter = load_drafter(str(tmp_path), target)
    assert isinstance(drafter, MedusaProposer)
    accepted = rejected = 0
    # a 1-token prompt has no hidden state yet: its first step drafts nothing
    for prompt in ([1, 17, 33, 5, 90, 12], [1, 22, 23, 24, 22, 23, 24, 22, 23, 24, 22, 23, 60, 61, 2], [1]):
        ids = torch.tensor([prompt])
        ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        for tree in (None, {"topk": 3, "total_tokens": 12}):
            out = speculative_generate(target, drafter, ids[0], 20, k=4 if tree is None else 3, tree=tree,
                                       eos_token_id=[])
            assert out.tokens == ref, (arch, tied, prompt, tree)
            accepted += sum(out.stats.accepts)
            rejected += sum(out.stats.attempts) - sum(out.stats.accepts)
    assert accepted > 0 and rejected > 0  # both verification branches (and cache rollbacks) were exercised


def _e2e_counts(n: int, broken: bool, monkeypatch) -> tuple[float, float]:
    from test_sampling_exact import _e2e_models, chi_square_pvalue, e2e_counts, e2e_exact

    import spectrain.decoding.acceptance as acceptance

    target, _ = _e2e_models()  # vocab 3: every 3-token outcome is enumerable
    drafter = MedusaProposer(make_heads(target, num_heads=2, perturb=0.5), target)
    if broken:
        monkeypatch.setattr(acceptance, "_RESIDUAL_FROM_P", True)
    prompt, temp = [1, 2], 1.0
    counts, stats = e2e_counts(target, drafter, prompt, n, temp, {"topk": 2, "total_tokens": 4})
    return chi_square_pvalue(counts, e2e_exact(target, prompt, temp), n), stats.acceptance_rate


def test_sampled_tree_is_exact(monkeypatch):
    pvalue, rate = _e2e_counts(600, False, monkeypatch)
    assert 0.05 < rate < 0.95  # both acceptances and rejections happen
    assert pvalue > 1e-3


def test_sampled_tree_check_catches_a_broken_residual(monkeypatch):
    pvalue, _ = _e2e_counts(1500, True, monkeypatch)
    assert pvalue < 1e-4


def test_save_load_roundtrip_wrong_target_and_fingerprint(target, tmp_path):
    heads = make_heads(target, num_heads=3, num_resblocks=2, perturb=0.2)
    heads.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "drafter_config.json").read_text())
    assert cfg["kind"] == "medusa" and cfg["num_heads"] == 3 and cfg["num_resblocks"] == 2
    assert cfg["target_hidden_size"] == 32 and cfg["target_vocab_size"] == 128 and cfg["target_fingerprint"]
    again = MedusaHeads.from_pretrained(tmp_path, target)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in heads.state_dict().items())
    seq = torch.randint(3, 128, (9,))
    for tree in (None, {"topk": 2, "total_tokens": 6}):
        a, b = _propose(heads, target, seq, 3, tree)[1], _propose(load(tmp_path, target).model, target, seq, 3,
                                                                  tree)[1]
        assert a.tokens.tolist() == b.tokens.tolist()
    with pytest.raises(ValueError, match="target_hidden_size=32.*wrong target"):
        MedusaHeads.from_pretrained(tmp_path, make_tiny_target("llama", hidden=48))
    with pytest.raises(ValueError, match="target_vocab_size=128.*wrong target"):
        MedusaHeads.from_pretrained(tmp_path, make_tiny_target("llama", vocab_size=96))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MedusaHeads.from_pretrained(tmp_path, target)  # its own target: silent
    with pytest.warns(UserWarning, match="other weights"):
        MedusaHeads.from_pretrained(tmp_path, make_tiny_target("llama", seed=1))


def medusa_recipe(out, **training):
    t = {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 30, "warmup_steps": 2, "eval_every": 10,
         "checkpoint_every": 100, "lr": 1e-2, "schedule": "constant"}
    t.update(training)
    return recipe_from_dict({"drafter": {"kind": "medusa", "medusa": {"num_heads": 3, "num_resblocks": 1}},
                             "training": t, "tracking": {"report_to": ["jsonl"]}, "output_dir": str(out)})


def _train_records(run_dir):
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r and "split" not in r], [r for r in recs if r.get("split") == "heldout"]


def test_training_loop_lowers_loss_and_saves_loadable_heads(target, tmp_path):
    rows, held = greedy_rows(target, 16), greedy_rows(target, 4, seed=1)
    s = T.train(medusa_recipe(tmp_path / "run", max_steps=40), target=target, train_rows=rows, heldout_rows=held)
    assert s["step"] == 40
    tr, ev = _train_records(tmp_path / "run")

    def mean(key, recs):  # 4-row steps are noisy: compare the first and last few
        return sum(r[key] for r in recs) / len(recs)

    assert mean("loss", tr[-5:]) < 0.7 * mean("loss", tr[:3]), tr
    assert mean("acc_0", tr[-5:]) > mean("acc_0", tr[:3]) + 0.15, tr
    assert all(k in tr[-1] for k in ("acc_2", "loss_1", "cond_acc_1", "sim_tau")) and len(ev) == 4
    assert all(e["eval/sim_tau_proxy"] >= 1.0 for e in ev)
    best = load_drafter(str(tmp_path / "run" / "best"), target)
    for r in held:
        out = speculative_generate(target, best, r["input_ids"][:6], 24, k=3, eos_token_id=[])
        assert out.tokens == r["input_ids"][6:].tolist()


def test_training_carries_over_to_decoding(target):
    """Train heads whose vocab layers start random on the target's own greedy text: the tau that decoding
    measures on those prompts must rise (it would stay ~1 if training and decoding used other offsets)."""
    rows = greedy_rows(target, 8)
    ids = torch.stack([r["input_ids"] for r in rows])
    lm = torch.ones_like(ids)
    lm[:, :6] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}
    feats = {"final_hidden": final_hidden(target, ids)}
    heads = make_heads(target, num_heads=3)
    torch.manual_seed(0)
    with torch.no_grad():
        for lin in heads.lm_heads:  # not the target's lm_head: start from nothing
            lin.weight.normal_(0.0, 0.02)

    def tau():
        outs = [speculative_generate(target, MedusaProposer(heads, target), r["input_ids"][:6], 24, k=3,
                                     eos_token_id=[]) for r in rows]
        assert all(o.tokens == r["input_ids"][6:].tolist() for o, r in zip(outs, rows))  # still lossless
        return sum(o.stats.emitted for o in outs) / sum(o.stats.target_passes for o in outs)

    before = tau()
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    heads.train()
    for _ in range(60):
        loss, met = heads.train_loss(batch, feats, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = tau()
    assert before < 1.2 and after > 1.8 and met["sim_tau"] > 2.0, (before, after, met["sim_tau"])


def test_offline_features_give_the_online_losses(target, tmp_path):
    from spectrain.data.features import write_feature_cache

    rows, held = greedy_rows(target, 8), greedy_rows(target, 2, seed=1)
    online = medusa_recipe(tmp_path / "on", max_steps=3)
    T.train(online, target=target, train_rows=rows, heldout_rows=held)
    write_feature_cache(target, {"train": rows, "heldout": held}, tmp_path / "cache", [], dtype="fp32",
                        max_length=online.data.max_length, verbose=False)
    T.train(medusa_recipe(tmp_path / "off", max_steps=3, features="offline", feature_cache=str(tmp_path / "cache")),
            target=target, train_rows=rows, heldout_rows=held)
    a, b = _train_records(tmp_path / "on")[0], _train_records(tmp_path / "off")[0]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-5), (x["loss"], y["loss"])


def test_hard_ce_training_lowers_the_data_cross_entropy(target):
    heads = make_heads(target, num_heads=2, loss="hard_ce")
    ids = torch.stack([r["input_ids"] for r in greedy_rows(target, 4)])
    lm = torch.ones_like(ids)
    lm[:, :6] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}
    feats = {"final_hidden": final_hidden(target, ids)}
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    first = heads.train_loss(batch, feats, target)[1]
    for _ in range(25):
        loss, met = heads.train_loss(batch, feats, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert met["loss"] < 0.5 * first["loss"] and met["acc_1"] > first["acc_1"]
