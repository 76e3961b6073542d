"""Training a separate draft LM (drafter.kind=draft): inits, vocab checks, loss alignment, the shared
loop online and offline, and the saved run directory decoding losslessly."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import make_tiny_model, make_tiny_target
from test_drafters import make_tokenizer
from test_train import losses, make_rows

from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.drafters import load_drafter
from spectrain.drafters.draft_lm import (
    DraftLMDrafter,
    DraftStudent,
    chain_metrics,
    layer_subset,
    sliced_config,
)
from spectrain.drafters.losses import fkl, sim_tau
from spectrain.recipe.load import recipe_from_dict
from spectrain.recipe.schema import Recipe
from spectrain.train import loop as T

torch.set_num_threads(1)


def draft_recipe(init: str = "layers:0,7", model: str = "", loss: str = "fkl") -> Recipe:
    r = Recipe()
    r.drafter.kind, r.drafter.loss = "draft", loss
    r.drafter.draft.init, r.drafter.draft.model = init, model
    return r


def batch_and_feats(target, seed: int = 0, b: int = 2, t: int = 14):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (b, t), generator=g)
    am, lm = torch.ones_like(ids), (torch.rand(b, t, generator=g) > 0.3).long()
    am[1, t - 4:], lm[1, t - 4:] = 0, 0  # right padding on row 1
    out = target(ids, am, want_last_hidden=True, want_logits=False)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}, {"last_hidden": out.last_hidden}


def shares_storage(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ptrs = {p.data_ptr() for p in b.parameters()}
    return any(p.data_ptr() in ptrs for p in a.parameters())


# ---- inits ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("mistral", True)])
def test_all_layers_copy_equals_target_and_owns_its_weights(arch, tied, tmp_path):
    from transformers import AutoModelForCausalLM

    target = make_tiny_target(arch, tied)
    student = DraftStudent.from_recipe(draft_recipe("layers:" + ",".join(map(str, range(8)))), target)
    ids = torch.randint(3, 128, (2, 11))
    assert torch.equal(student.model(ids).logits, target.model(ids).logits)
    # tied embeddings survive the round trip, also from the unshared full state dict the loop gathers
    # under ZeRO-3 / FSDP
    student.save_pretrained(tmp_path, state_dict={k: v.detach().clone() for k, v in student.state_dict().items()})
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, target.model(ids).logits)
    assert not shares_storage(student, target.model) and all(p.requires_grad for p in student.parameters())
    assert all(p.dtype == torch.float32 for p in student.parameters())
    assert student.feature_spec() == {"want_last_hidden": True}


def test_layer_subset_equals_hand_built_model_with_sliced_layer_types():
    import transformers as tf

    # qwen2 with a sliding window from layer 4 on: layer_types differ per layer and must follow the weights
    cfg = tf.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                         max_window_layers=4, max_position_embeddings=256)
    torch.manual_seed(0)
    from spectrain.targets.model import FrozenTarget

    target = FrozenTarget(tf.Qwen2ForCausalLM(cfg).eval(), name_or_path="tiny-swa")
    layers = [1, 6]
    student = layer_subset(target, layers)
    assert student.config.num_hidden_layers == 2
    assert student.config.layer_types == ["full_attention", "sliding_attention"]
    hand = tf.Qwen2ForCausalLM(sliced_config(target.config, layers)).eval()
    src, dst = target.model.model, hand.model
    dst.embed_tokens.load_state_dict(src.embed_tokens.state_dict())
    dst.norm.load_state_dict(src.norm.state_dict())
    hand.lm_head.load_state_dict(target.model.lm_head.state_dict())
    for j, i in enumerate(layers):
        dst.layers[j].load_state_dict(src.layers[i].state_dict())
    ids = torch.randint(3, 128, (2, 12))  # longer than the window, so the sliding layer matters
    torch.testing.assert_close(student.eval()(ids).logits, hand(ids).logits, rtol=0, atol=0)


def test_bad_layer_ids_refused():
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match=r"layer ids \[8\] are out of range.*8 decoder layers \(ids 0..7\)"):
        DraftStudent.from_recipe(draft_recipe("layers:0,8"), target)
    with pytest.raises(ValueError, match="increasing order"):
        DraftStudent.from_recipe(draft_recipe("layers:3,1"), target)


def test_init_pretrained_and_config_from_a_local_dir(tmp_path):
    target = make_tiny_target("llama")
    target.tokenizer = make_tokenizer()
    src = make_tiny_model("llama", layers=2, seed=3)
    src.save_pretrained(tmp_path / "small")
    make_tokenizer().save_pretrained(tmp_path / "small")
    pre = DraftStudent.from_recipe(draft_recipe("pretrained", str(tmp_path / "small")), target)
    ids = torch.randint(3, 128, (1, 9))
    torch.testing.assert_close(pre.model(ids).logits, src(ids).logits)
    torch.manual_seed(0)
    cfg = DraftStudent.from_recipe(draft_recipe("config", str(tmp_path / "small")), target)
    assert cfg.model.config.num_hidden_layers == 2 and type(cfg.model) is type(src)
    assert not torch.equal(cfg.model.model.layers[0].mlp.up_proj.weight, src.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="cannot be loaded"):
        DraftStudent.from_recipe(draft_recipe("pretrained", str(tmp_path / "missing")), target)


def test_vocab_mismatch_refused(tmp_path):
    target = make_tiny_target("llama")
    target.tokenizer = make_tokenizer()
    make_tiny_model("llama", layers=2).save_pretrained(tmp_path / "other")
    make_tokenizer(rename={5: "zz"}).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="id 5: target 'w5' vs draft 'zz'"):
        DraftStudent.from_recipe(draft_recipe("pretrained", str(tmp_path / "other")), target)
    bare = make_tiny_target("llama")  # no tokenizers on either side: sizes must agree
    make_tiny_model("llama", layers=2, vocab_size=96).save_pretrained(tmp_path / "small_vocab")
    with pytest.raises(ValueError, match="96 rows.*128"):
        DraftStudent.from_recipe(draft_recipe("config", str(tmp_path / "small_vocab")), bare)


# ---- loss and metrics ---------------------------------------------------------------------------------


def test_student_equal_to_target_has_zero_loss_and_full_agreement():
    target = make_tiny_target("llama")
    student = DraftStudent.from_recipe(draft_recipe("layers:" + ",".join(map(str, range(8)))), target)
    batch, feats = batch_and_feats(target)
    loss, m = student.train_loss(batch, feats, target)
    assert abs(float(loss.detach())) < 1e-5 and m["acc_0"] == 1.0 and m["expected_acc"] == pytest.approx(1.0, abs=1e-4)
    valid = torch.zeros_like(batch["loss_mask"]).bool()
    valid[:, :-1] = (batch["loss_mask"][:, 1:] & batch["attention_mask"][:, 1:]).bool()
    assert m["tokens"] == float(valid.sum())
    # everything agrees, so a chain from anchor t runs until the first non-trained position
    want = chain_metrics(valid, torch.ones(int(valid.sum()), dtype=torch.bool), torch.ones(int(valid.sum())))
    assert m["sim_tau"] == pytest.approx(want["sim_tau"]) and m["sim_tau_t1"] == pytest.approx(m["sim_tau"], abs=1e-3)


def test_loss_alignment_by_hand():
    target = make_tiny_target("qwen2")
    student = DraftStudent.from_recipe(draft_recipe("layers:0,5"), target)
    batch, feats = batch_and_feats(target, seed=1)
    loss, m = student.train_loss(batch, feats, target)
    ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    with torch.no_grad():
        s_all, t_all = student.model(ids, attention_mask=am).logits, target(ids, am).logits
    mask = (lm[:, 1:] & am[:, 1:]).bool()  # position t trains on predicting token t+1
    assert float(loss.detach()) == pytest.approx(float(fkl(s_all[:, :-1], t_all[:, :-1], mask)), rel=1e-5)
    agree = (s_all[:, :-1].argmax(-1) == t_all[:, :-1].argmax(-1)) & mask
    assert m["acc_0"] == pytest.approx(float(agree.sum() / mask.sum()))
    hard, _ = DraftStudent(student.model, {**student.config, "loss": "hard_ce"}).train_loss(batch, feats, target)
    nll = torch.nn.functional.cross_entropy(s_all[:, :-1][mask], ids[:, 1:][mask])
    assert float(hard.detach()) == pytest.approx(float(nll), rel=1e-5)  # hard_ce = the data's next tokens
    loss.backward()
    assert student.model.model.layers[1].mlp.up_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in target.model.parameters())


def test_chain_metrics_run_lengths():
    valid = torch.tensor([[True, True, True, True, False, True]])
    agree = torch.tensor([True, True, False, True, True])  # positions 0,1,2,3,5
    m = chain_metrics(valid, agree, torch.full((5,), 0.5), k=3)
    # greedy runs from each anchor (capped at 3): 2, 1, 0, 1, 1 -> P(run>=1)=4/5, P(run>=2)=1/5, P(run>=3)=0
    assert m["acc_0"] == pytest.approx(0.8) and m["acc_1"] == pytest.approx(0.25) and m["acc_2"] == 0.0
    assert m["sim_tau"] == pytest.approx(1 + 0.8 + 0.2) == sim_tau([m[f"acc_{i}"] for i in range(3)])
    # T=1: anchors 0..3, 5 with a=0.5; products over runs inside the valid span
    assert m["sim_tau_t1"] == pytest.approx(1 + 0.5 + (0.25 * 3) / 5 + (0.125 * 2) / 5)


# ---- the shared loop ----------------------------------------------------------------------------------


def loop_recipe(out, **training):
    t = {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 12, "warmup_steps": 2, "eval_every": 6,
         "checkpoint_every": 6, "lr": 3e-3, "schedule": "constant"}
    t.update(training)
    return recipe_from_dict({"drafter": {"kind": "draft", "loss": "fkl", "draft": {"init": "layers:0,7"}},
                             "training": t, "tracking": {"report_to": ["jsonl"]}, "output_dir": str(out)})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short run of the real loop on a tiny target with a tokenizer (shared by the tests below)."""
    out = tmp_path_factory.mktemp("draft") / "run"
    target = make_tiny_target("llama")
    target.tokenizer = make_tokenizer()
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    summary = T.train(loop_recipe(out), target=target, train_rows=make_rows(8), heldout_rows=make_rows(8, 1))
    assert all(torch.equal(v, target.model.state_dict()[k]) for k, v in before.items())  # target untouched
    return target, out, summary


def test_loop_trains_the_student(trained):
    _, out, summary = trained
    seq = losses(out)
    assert summary["step"] == 12 and len(seq) == 12
    # 8 rows, 6 epochs: the student fits the target's distribution on them
    assert sum(x for _, x in seq[-3:]) < 0.5 * sum(x for _, x in seq[:3]), seq
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in recs if r.get("split") == "heldout"]
    assert [r["step"] for r in ev] == [6, 12]
    assert all(k in ev[-1] for k in ("eval/acc_0", "eval/acc_4", "eval/expected_acc", "eval/sim_tau_t1"))
    assert ev[-1]["eval/sim_tau_proxy"] > 1.0
    cfg = json.loads((out / "best" / "drafter_config.json").read_text())
    assert cfg["kind"] == "draft" and cfg["init"] == "layers:0,7" and cfg["target_vocab_size"] == 128
    assert (out / "init" / "config.json").is_file() and (out / "best" / "tokenizer.json").is_file()


@pytest.mark.parametrize("tree", [None, {"topk": 3}])
def test_saved_run_decodes_losslessly(trained, tree):
    from transformers import AutoModelForCausalLM

    target, out, _ = trained
    drafter = load_drafter(str(out / "best"), target)
    assert isinstance(drafter, DraftLMDrafter) and drafter.tokenizer is not None
    prompt = [1, 5, 9, 17, 33, 5, 9]
    got = speculative_generate(target, drafter, prompt, 24, k=4, tree=tree, eos_token_id=[])
    assert got.tokens == plain_generate(target, prompt, 24, eos_token_id=[]).tokens
    hf = AutoModelForCausalLM.from_pretrained(out / "best")
    assert hf.config.num_hidden_layers == 2
    torch.testing.assert_close(hf(torch.tensor([prompt])).logits, drafter.model(torch.tensor([prompt])).logits)


def test_other_target_warns_on_load(trained):
    _, out, _ = trained
    other = make_tiny_target("llama", seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_drafter(str(out / "best"), other)
    assert any("other weights" in str(w.message) for w in caught)


def test_offline_first_step_loss_equals_online(tmp_path):
    from spectrain.data.features import write_feature_cache

    target = make_tiny_target("llama")
    rows, held = make_rows(16), make_rows(4, seed=1)
    T.train(loop_recipe(tmp_path / "on", max_steps=2), target=target, train_rows=rows, heldout_rows=held)
    write_feature_cache(target, {"train": rows, "heldout": held}, tmp_path / "cache", [], dtype="fp32",
                        max_length=512, verbose=False)
    off = loop_recipe(tmp_path / "off", max_steps=2, features="offline", feature_cache=str(tmp_path / "cache"))
    T.train(off, target=target, train_rows=rows, heldout_rows=held)
    a, b = losses(tmp_path / "on"), losses(tmp_path / "off")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2]
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for (_, x), (_, y) in zip(a, b)), (a, b)


def test_resume_with_tied_embeddings_is_exact(tmp_path):
    """accelerate drops the tied lm_head copy when it checkpoints; resuming must still reproduce the run."""
    import os
    import signal

    from safetensors.torch import load_file

    def run(out, stop_at=None, **kw):
        def preempt(r, rec):
            if r.state["step"] == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)

        return T.train(loop_recipe(out, max_steps=5, checkpoint_every=2, eval_every=0, **kw),
                       target=make_tiny_target("llama", tied=True), train_rows=make_rows(12),
                       heldout_rows=None, on_step=preempt if stop_at else None)

    run(tmp_path / "full")
    assert run(tmp_path / "split", stop_at=3)["interrupted_by"] == signal.SIGTERM
    assert run(tmp_path / "split", resume_from="auto")["steps_this_run"] == 2
    assert losses(tmp_path / "full") == losses(tmp_path / "split")
    wa, wb = (load_file(str(tmp_path / d / "last" / "model.safetensors")) for d in ("full", "split"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
