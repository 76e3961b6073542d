"""EAGLE-3 head: layout, draft vocab, TTT alignment against the decoding adapter, trees, persistence."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from spectrain.decoding.interface import DraftContext, TargetFeatures
from spectrain.decoding.sampling import Sampler
from spectrain.drafters.eagle3.decode import Eagle3Proposer, load
from spectrain.drafters.eagle3.model import Eagle3Head, build_draft_vocab
from spectrain.drafters.losses import fkl
from spectrain.recipe.schema import Recipe

torch.set_num_threads(1)
EXPECTED_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
}


def make_recipe(draft_vocab_size=96, ttt_steps=4, **eagle3):
    r = Recipe()
    r.drafter.eagle3.draft_vocab_size = draft_vocab_size
    r.drafter.eagle3.ttt_steps = ttt_steps
    for k, v in eagle3.items():
        setattr(r.drafter.eagle3, k, v)
    return r


def make_head(target, seed=0, **kw):
    torch.manual_seed(seed)
    counts = torch.randint(0, 1000, (target.vocab_size,))
    return Eagle3Head.from_recipe(make_recipe(**kw), target, counts)


def feats_of(target, head, ids, am=None):
    out = target(ids, am, aux_layers=head.aux_layers, want_last_hidden=True, want_logits=False)
    return {"aux": torch.cat(out.aux_hidden, -1), "last_hidden": out.last_hidden}


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


def test_layout_names_and_frozen_embeddings(target):
    head = make_head(target)
    assert set(head.state_dict()) == EXPECTED_KEYS
    assert head.layers[0].self_attn.q_proj.weight.shape[1] == 2 * target.hidden_size
    assert head.fc.weight.shape == (target.hidden_size, 3 * target.hidden_size)
    assert head.aux_layers == target.default_aux_layers()
    target_params = {id(p) for p in target.model.parameters()}
    assert all(p.requires_grad and id(p) not in target_params for p in head.parameters())
    assert head.feature_spec() == {"aux_layers": head.aux_layers, "want_last_hidden": True}


def test_draft_vocab_from_counts_and_errors():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = build_draft_vocab(counts, 3, 6)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]  # most frequent, sorted ascending
    assert t2d.tolist() == [False, False, True, True, False, True]
    d2t, t2d = build_draft_vocab(None, 6, 6)  # full vocabulary needs no counts
    assert d2t.abs().sum() == 0 and t2d.all()
    with pytest.raises(ValueError, match="larger than the target's vocabulary"):
        build_draft_vocab(counts, 7, 6)
    with pytest.raises(ValueError, match="token_counts"):
        build_draft_vocab(None, 3, 6)


def test_bad_aux_layers_rejected(target):
    with pytest.raises(ValueError, match="final layer's output"):
        make_head(target, aux_layers=[1, 2, target.num_layers])


def _propose(head, target, tokens, n_feat, k, sampler, tree=None):
    """Fresh adapter; features for positions 0..n_feat-1 of `tokens` (the target's, on the prefix)."""
    prop = Eagle3Proposer(head, target)
    prop.begin(tokens)
    aux = feats_of(target, head, tokens[None])["aux"][0, :n_feat]
    ctx = DraftContext(tokens=tokens[: n_feat + 1], k=k, sampler=sampler,
                       features=TargetFeatures(start=0, aux=aux), tree=tree)
    return prop, prop.propose(ctx)


@pytest.mark.parametrize("arch,layers", [("llama", 1), ("qwen3", 1), ("mistral", 2)])
def test_ttt_steps_match_decoding_chain(arch, layers):
    """Pins the alignment: TTT step i at anchor t == the adapter's i-th drafted distribution for the
    prefix x_0..x_{t+1}, when the sequence continues with exactly the drafted tokens."""
    target = make_tiny_target(arch)
    head = make_head(target, ttt_steps=4, num_layers=layers)
    torch.manual_seed(1)
    prefix = torch.randint(3, target.vocab_size, (12,))
    sampler = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0))
    _, prop = _propose(head, target, prefix, 11, 4, sampler)
    seq = torch.cat([prefix, prop.tokens])  # x_0..x_11 + the 4 drafted tokens
    with torch.no_grad():
        logits = head.ttt_logits(seq[None], torch.ones(1, seq.numel()), feats_of(target, head, seq[None])["aux"],
                                 target)
    for i in range(4):
        q = Sampler(temperature=1.0).probs(Eagle3Proposer(head, target)._full_logits(logits[i][0, 10]))
        torch.testing.assert_close(q, prop.probs[i], atol=1e-5, rtol=1e-4)
    # greedy: the drafted chain is the argmax of every TTT step
    _, greedy = _propose(head, target, seq, 11, 4, Sampler())
    seq_g = torch.cat([prefix, greedy.tokens])
    with torch.no_grad():
        lg = head.ttt_logits(seq_g[None], torch.ones(1, 16), feats_of(target, head, seq_g[None])["aux"], target)
    assert [int(head.draft_ids[lg[i][0, 10].argmax()]) for i in range(4)] == greedy.tokens.tolist()


def test_step0_loss_matches_hand_alignment(target):
    head = make_head(target, ttt_steps=2)
    torch.manual_seed(2)
    ids = torch.randint(3, target.vocab_size, (2, 14))
    am, lm = torch.ones_like(ids), (torch.rand(2, 14) > 0.3).long()
    am[1, 10:] = 0
    lm[1, 10:] = 0
    loss, met = head.train_loss({"input_ids": ids, "attention_mask": am, "loss_mask": lm},
                                feats_of(target, head, ids, am), target)
    # hand: anchor t, teacher = target logits at t+1 (full forward), label token t+2 under the loss mask
    with torch.no_grad():
        tl = target(ids, am).logits
        lg0 = head.ttt_logits(ids, am, feats_of(target, head, ids, am)["aux"], target, steps=1)[0]
    t = 11
    teacher = tl[:, 1: t + 1][..., head.draft_ids]
    mask = lm[:, 2: t + 2].bool() & head.t2d[tl[:, 1: t + 1].argmax(-1)]
    assert met["loss_0"] == pytest.approx(float(fkl(lg0[:, :t], teacher, mask)), rel=1e-4)
    assert met["tokens"] == float(mask.sum())
    assert set(met) >= {"loss", "sim_tau", "acc_0", "acc_1", "cond_acc_1", "loss_1"}
    assert met["sim_tau"] == pytest.approx(1 + met["acc_0"] + met["acc_0"] * met["acc_1"])
    loss.backward()
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in target.model.parameters())


def test_hard_ce_uses_the_data_tokens_in_the_draft_vocabulary(target):
    head = make_head(target, ttt_steps=1, draft_vocab_size=96)
    head.config["loss"] = "hard_ce"
    torch.manual_seed(3)
    ids = torch.randint(3, target.vocab_size, (2, 12))
    am, lm = torch.ones_like(ids), (torch.rand(2, 12) > 0.2).long()
    feats = feats_of(target, head, ids, am)
    _, met = head.train_loss({"input_ids": ids, "attention_mask": am, "loss_mask": lm}, feats, target)
    with torch.no_grad():
        lg0 = head.ttt_logits(ids, am, feats["aux"], target, steps=1)[0][:, :10]
    data = ids[:, 2:]  # anchor t's label is the data token t+2, when the draft vocabulary holds it
    keep = lm[:, 2:].bool() & head.t2d[data]
    assert 0 < int(keep.sum()) < keep.numel()  # some labels fall outside the 96-token draft vocabulary
    draft_id = {int(t): j for j, t in enumerate(head.draft_ids)}
    nll = [-torch.log_softmax(lg0[b, t], -1)[draft_id[int(data[b, t])]] for b, t in keep.nonzero().tolist()]
    assert met["loss_0"] == pytest.approx(float(torch.stack(nll).mean()), rel=1e-4)


def test_training_raises_accuracy(target):
    head = make_head(target, ttt_steps=2, draft_vocab_size=128)
    torch.manual_seed(3)
    ids = torch.randint(3, target.vocab_size, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    feats = feats_of(target, head, ids)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    first = head.train_loss(batch, feats, target)[1]
    for _ in range(40):
        loss, met = head.train_loss(batch, feats, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert met["loss"] < 0.5 * first["loss"] and met["acc_0"] > first["acc_0"] + 0.3


def test_incremental_cache_equals_from_scratch(target):
    head = make_head(target)
    torch.manual_seed(4)
    seq = torch.randint(3, target.vocab_size, (16,))
    aux = feats_of(target, head, seq[None])["aux"][0]
    for tree in (None, {"topk": 3, "total_tokens": 12}):
        inc = Eagle3Proposer(head, target)
        inc.begin(seq[:7])
        inc.propose(DraftContext(seq[:7], 3, Sampler(), TargetFeatures(0, aux[:6]), tree))
        inc.commit([0])
        got = inc.propose(DraftContext(seq, 3, Sampler(), TargetFeatures(6, aux[6:15]), tree))
        _, want = _propose(head, target, seq, 15, 3, Sampler(), tree)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.parents is None if tree is None else got.parents.tolist() == want.parents.tolist()
    with pytest.raises(ValueError, match="skipped"):
        inc.propose(DraftContext(seq, 3, Sampler(), TargetFeatures(20, aux[:1])))


def test_tree_structure_and_paths_match_ttt(target):
    head = make_head(target)
    torch.manual_seed(5)
    seq = torch.randint(3, target.vocab_size, (10,))
    _, chain = _propose(head, target, seq, 9, 4, Sampler())
    _, one = _propose(head, target, seq, 9, 4, Sampler(), {"topk": 1, "total_tokens": 10})
    assert one.tokens.tolist() == chain.tokens.tolist() and one.parents.tolist() == [-1, 0, 1, 2]
    _, tree = _propose(head, target, seq, 9, 4, Sampler(), {"topk": 3, "total_tokens": 14})
    par, toks = tree.parents.tolist(), tree.tokens.tolist()
    assert len(par) == 14 and all(p < i for i, p in enumerate(par))
    for node in range(len(par)):  # each node's children are the top-k of a TTT unroll along its path
        kids = [toks[c] for c, p in enumerate(par) if p == node]
        if not kids:
            continue
        path, p = [], node
        while p >= 0:
            path.insert(0, toks[p])
            p = par[p]
        s = torch.cat([seq, torch.tensor(path)])
        with torch.no_grad():
            lg = head.ttt_logits(s[None], torch.ones(1, s.numel()), feats_of(target, head, s[None])["aux"],
                                 target, steps=len(path) + 1)[len(path)][0, 8]
        top = head.draft_ids[lg.topk(3).indices].tolist()
        assert kids == top[: len(kids)]
    sampler = Sampler(temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(0))
    _, st = _propose(head, target, seq, 9, 4, sampler, {"topk": 2, "total_tokens": 9})
    assert len(st) <= 9 and torch.allclose(st.probs.sum(-1), torch.ones(len(st)))
    assert all(st.probs[i, t] > 0 for i, t in enumerate(st.tokens.tolist()))
    assert not head.t2d[st.probs.nonzero()[:, 1]].logical_not().any()  # q is zero outside the draft vocab


def test_save_load_roundtrip_and_wrong_target(target, tmp_path):
    head = make_head(target)
    head.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "model.safetensors"))) == EXPECTED_KEYS
    again = Eagle3Head.from_pretrained(tmp_path, target)
    for k, v in head.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    drafter = load(tmp_path, target)
    assert drafter.aux_layers == head.aux_layers and drafter.supports_tree
    with pytest.raises(ValueError, match="wrong target"):
        Eagle3Head.from_pretrained(tmp_path, make_tiny_target("llama", hidden=48))


@pytest.mark.parametrize("tree", [None, {"topk": 3, "total_tokens": 12}])
def test_speculative_generate_greedy_is_lossless(target, tmp_path, tree):
    from spectrain.decoding.loop import plain_generate, speculative_generate

    make_head(target, draft_vocab_size=100).save_pretrained(tmp_path)
    drafter = load(tmp_path, target)
    prompt = torch.tensor([1, 17, 33, 5, 90, 12])
    want = plain_generate(target, prompt, max_new_tokens=24, eos_token_id=[])
    got = speculative_generate(target, drafter, prompt, max_new_tokens=24, k=4, tree=tree, eos_token_id=[])
    assert got.tokens == want.tokens


def test_speculative_generate_sampling_runs_and_is_seeded(target, tmp_path):
    from spectrain.decoding.loop import speculative_generate

    make_head(target).save_pretrained(tmp_path)
    drafter = load(tmp_path, target)
    for tree in (None, {"topk": 2, "total_tokens": 6}):
        runs = [speculative_generate(target, drafter, torch.tensor([1, 17, 33, 5]), max_new_tokens=12, k=3,
                                     temperature=0.7, top_p=0.9, seed=3, tree=tree, eos_token_id=[])
                for _ in range(2)]
        assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 12
    # a 1-token prompt has no target features yet: the drafter proposes nothing, decoding still works
    out = speculative_generate(target, drafter, torch.tensor([1]), max_new_tokens=5, k=3, eos_token_id=[])
    assert len(out.tokens) == 5


def test_training_carries_over_to_decoding(target):
    """End to end: TTT on target-generated text raises the tau that speculative decoding measures on
    the same prompts (would stay ~1 if training and decoding disagreed on alignment)."""
    from spectrain.decoding.loop import plain_generate, speculative_generate

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.vocab_size, (6,), generator=g) for _ in range(4)]
    ids = torch.stack([torch.cat([p, torch.tensor(plain_generate(target, p, max_new_tokens=24,
                                                                  eos_token_id=[]).tokens)]) for p in prompts])
    lm = torch.ones_like(ids)
    lm[:, :6] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}
    head = make_head(target, ttt_steps=3, draft_vocab_size=128)
    feats = feats_of(target, head, ids)

    def tau():
        outs = [speculative_generate(target, Eagle3Proposer(head, target), p, max_new_tokens=24, k=3,
                                     eos_token_id=[]) for p in prompts]
        assert all(o.tokens == r[6:].tolist() for o, r in zip(outs, ids))  # still lossless
        return sum(o.stats.emitted for o in outs) / sum(o.stats.target_passes for o in outs)

    before = tau()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    head.train()
    for _ in range(60):
        loss, metrics = head.train_loss(batch, feats, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = tau()
    assert before < 1.3 and after > 1.8 and metrics["sim_tau"] > 1.8, (before, after, metrics["sim_tau"])


def _sampled_tree_pvalue(target, broken: bool, n: int = 2500) -> float:
    """Chi-square p-value of the first two tokens emitted by sampled tree decoding against the exact
    target law p(x1) p(x2 | x1), with a briefly trained head so that deeper nodes get accepted."""
    st = pytest.importorskip("scipy.stats")
    from spectrain.decoding.loop import plain_generate, speculative_generate

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.vocab_size, (6,), generator=g) for _ in range(4)]
    ids = torch.stack([torch.cat([p, torch.tensor(plain_generate(target, p, max_new_tokens=24,
                                                                  eos_token_id=[]).tokens)]) for p in prompts])
    lm = torch.ones_like(ids)
    lm[:, :6] = 0
    head = make_head(target, ttt_steps=3, draft_vocab_size=128)
    feats = feats_of(target, head, ids)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(60):
        loss, _ = head.train_loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm},
                                  feats, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter = Eagle3Proposer(head, target)
    if broken:  # prune sampled siblings by their own value (the greedy rule): biased, must be detected
        drafter._select = lambda par, sc, dep, tot, greedy: Eagle3Proposer._select(par, sc, dep, tot, True)
    prompt, v = ids[0, :10], target.vocab_size
    with torch.no_grad():
        p1 = target(prompt[None]).logits[0, -1].float().softmax(-1)
        p2 = target(torch.cat([prompt.repeat(v, 1), torch.arange(v)[:, None]], 1)).logits[:, -1].float().softmax(-1)
    expected = (p1[:, None] * p2).flatten() * n
    counts = torch.zeros(v * v)
    for s in range(n):
        out = speculative_generate(target, drafter, prompt, max_new_tokens=3, k=2, temperature=1.0, seed=s,
                                   tree={"topk": 3, "total_tokens": 6}, eos_token_id=[])
        counts[out.tokens[0] * v + out.tokens[1]] += 1
    big = expected >= 5  # pool the rare outcomes into one bin
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).numpy()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).numpy()
    return float(st.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.slow
def test_sampled_tree_is_lossless(target):
    assert _sampled_tree_pvalue(target, broken=False) > 1e-3  # measured 0.97


@pytest.mark.slow
def test_sampled_tree_check_detects_value_dependent_pruning(target):
    assert _sampled_tree_pvalue(target, broken=True) < 1e-3  # measured 7e-5


def test_head_loaded_on_a_target_with_other_weights_warns(tmp_path):
    """Same shapes, different weights (e.g. a rebuilt target): loading works but must warn loudly."""
    import warnings

    from conftest import make_tiny_target

    t1, t2 = make_tiny_target(seed=0), make_tiny_target(seed=1)
    make_head(t1).save_pretrained(tmp_path / "head")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Eagle3Head.from_pretrained(tmp_path / "head", t1)  # its own target: silent
    with pytest.warns(UserWarning, match="other weights"):
        Eagle3Head.from_pretrained(tmp_path / "head", t2)
