"""Serving-format export: round trips that reload the files WITHOUT spectrain's loaders and compare numbers,
validation that catches broken exports, and the refusals (wrong kind, existing --out, source == out)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model, make_tiny_target
from safetensors.torch import load_file, save_file
from test_drafters import make_tokenizer
from test_eagle3 import make_head
from test_medusa import final_hidden, make_heads

from spectrain import export as E
from spectrain.decoding.loop import speculative_generate
from spectrain.drafters.eagle3.decode import Eagle3Proposer
from spectrain.drafters.eagle3.model import Eagle3Head
from spectrain.export import medusa as medusa_export
from spectrain.io.integrity import seal

torch.set_num_threads(1)
EAGLE3 = ("vllm-eagle3", "sglang-eagle3")
MEDUSA = ("vllm-medusa", "medusa")


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


@pytest.fixture(scope="module")
def eagle3_ckpt(target, tmp_path_factory):
    head = make_head(target, draft_vocab_size=96, ttt_steps=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distinct norm weights: a swapped or renamed norm changes the numbers
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp("e3") / "ckpt"
    head.save_pretrained(path)
    return head, path


@pytest.fixture(scope="module")
def medusa_ckpt(target, tmp_path_factory):
    heads = make_heads(target, num_heads=3, num_resblocks=2, perturb=0.3)
    path = tmp_path_factory.mktemp("md") / "ckpt"
    heads.save_pretrained(path)
    return heads, path


def ids_for(target, n=12, seed=0):
    return torch.randint(3, target.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def rewrite(out: Path, weights: str, tensors=None, config=None) -> None:
    """Apply edits to an export in place: tensors(dict) / config(dict) mutate and may return nothing."""
    if tensors:
        state = load_file(str(out / weights))
        tensors(state)
        save_file(state, str(out / weights))
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))


# ---- EAGLE-3 ---------------------------------------------------------------------------------
def drafter_from_export(out: Path, fmt: str) -> Eagle3Head:
    """Rebuild an Eagle3Head from the exported files only: config fields parsed by transformers' own
    LlamaConfig, names mapped back by hand, aux ids translated from the format's convention."""
    from transformers import LlamaConfig

    config, state = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    if fmt == "sglang-eagle3":
        layer, aux = config, [a + 1 for a in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    else:
        layer, aux = config["transformer_layer_config"], config["eagle_aux_hidden_state_layer_ids"]
    hf = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("model_type", "architectures")})
    cfg = {"aux_layers": aux, "target_hidden_size": config["target_hidden_size"], "target_vocab_size": hf.vocab_size,
           "hidden_size": hf.hidden_size, "draft_vocab_size": config["draft_vocab_size"],
           "num_layers": hf.num_hidden_layers, "num_attention_heads": hf.num_attention_heads,
           "num_key_value_heads": hf.num_key_value_heads, "head_dim": hf.head_dim,
           "intermediate_size": hf.intermediate_size, "rms_norm_eps": hf.rms_norm_eps,
           "rope_parameters": dict(hf.rope_parameters), "max_position_embeddings": hf.max_position_embeddings,
           "ttt_steps": 3}
    model = Eagle3Head(cfg, state["d2t"], state["t2d"])
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("fmt", EAGLE3)
def test_eagle3_round_trip_same_logits_and_proposals(target, eagle3_ckpt, tmp_path, fmt):
    head, ckpt = eagle3_ckpt
    summary = E.export(ckpt, fmt, tmp_path / "out")
    out = tmp_path / "out"
    assert E.validate(fmt, out) == [] and summary["files"]["model.safetensors"] > 0
    assert any("not a local model directory" in w for w in summary["warnings"])  # "tiny-llama" is no dir
    back = drafter_from_export(out, fmt)
    assert back.aux_layers == head.aux_layers and torch.equal(back.draft_ids, head.draft_ids)
    ids = ids_for(target)
    am = torch.ones_like(ids)

    def logits(model):
        feats = target(ids, am, aux_layers=model.aux_layers, want_logits=False)
        return model.ttt_logits(ids, am, torch.cat(feats.aux_hidden, -1), target, 3)

    with torch.no_grad():
        for a, b in zip(logits(back), logits(head.eval())):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    runs = [speculative_generate(target, Eagle3Proposer(m, target), ids[0, :6], max_new_tokens=10, k=3)
            for m in (head, back)]
    assert runs[0].tokens == runs[1].tokens and runs[0].stats.accepts == runs[1].stats.accepts


def test_eagle3_config_facts(eagle3_ckpt, tmp_path):
    head, ckpt = eagle3_ckpt
    E.export(ckpt, "vllm-eagle3", tmp_path / "v")
    E.export(ckpt, "sglang-eagle3", tmp_path / "s")
    v = json.loads((tmp_path / "v" / "config.json").read_text())
    s = json.loads((tmp_path / "s" / "config.json").read_text())
    assert v["speculators_model_type"] == "eagle3" and v["norm_before_residual"] is False
    assert v["eagle_aux_hidden_state_layer_ids"] == head.aux_layers == [2, 4, 5]  # inputs of layers (vLLM)
    assert v["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert v["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"
    assert v["transformer_layer_config"]["vocab_size"] == 128 and v["draft_vocab_size"] == 96
    assert s["architectures"] == ["LlamaForCausalLMEagle3"] and s["tie_word_embeddings"] is False
    assert s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # outputs of layers (SGLang)
    names = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert "midlayer.hidden_norm.weight" in names and not any(k.startswith("layers.") for k in names)


@pytest.mark.parametrize("fmt,edit,expect", [
    ("vllm-eagle3", lambda t: t.update({"fc.weight": t["fc.weight"].T.contiguous()}), "transposed"),
    ("vllm-eagle3", lambda t: t.pop("layers.0.hidden_norm.weight"), "missing tensor layers.0.hidden_norm"),
    ("vllm-eagle3", lambda t: t.update({"d2t": torch.zeros_like(t["d2t"])}), "d2t and t2d disagree"),
    ("vllm-eagle3", lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1), "not strictly increasing"),
    ("vllm-eagle3", lambda t: t.update({"extra.weight": torch.zeros(2)}), "unexpected tensor extra.weight"),
    ("vllm-eagle3", lambda t: t["norm.weight"].fill_(float("nan")), "NaN"),
    ("vllm-eagle3", lambda t: t.update({"lm_head.weight": t["lm_head.weight"].half()}), "mixed float dtypes"),
    ("sglang-eagle3", lambda t: t.update({"layers.0.hidden_norm.weight": t.pop("midlayer.hidden_norm.weight")}),
     "missing tensor midlayer.hidden_norm"),
])
def test_eagle3_validation_catches_broken_weights(eagle3_ckpt, tmp_path, fmt, edit, expect):
    E.export(eagle3_ckpt[1], fmt, tmp_path / "out")
    rewrite(tmp_path / "out", "model.safetensors", tensors=edit)
    problems = E.validate(fmt, tmp_path / "out")
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("fmt,edit,expect", [
    ("vllm-eagle3", lambda c: c.update(draft_vocab_size=95), "lm_head.weight has shape [96, 32], the config implies [95, 32]"),
    ("vllm-eagle3", lambda c: c.pop("norm_before_residual"), "norm_before_residual"),
    ("vllm-eagle3", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4]), "aux layer ids"),
    ("vllm-eagle3", lambda c: c["transformer_layer_config"].update(intermediate_size=63), "mlp.up_proj"),
    ("vllm-eagle3", lambda c: c.pop("speculators_config"), "lacks a required field: 'speculators_config'"),
    ("vllm-eagle3", lambda c: c.update(speculators_config={"proposal_methods": []}), "lacks a required field"),
    ("sglang-eagle3", lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
    ("sglang-eagle3", lambda c: c.update(num_attention_heads=2), "q_proj"),
])
def test_eagle3_validation_catches_wrong_config(eagle3_ckpt, tmp_path, fmt, edit, expect):
    E.export(eagle3_ckpt[1], fmt, tmp_path / "out")
    rewrite(tmp_path / "out", "model.safetensors", config=edit)
    problems = E.validate(fmt, tmp_path / "out")
    assert any(expect in p for p in problems), problems


def test_eagle3_refusals(target, tmp_path):
    head = make_head(target, draft_vocab_size=96, num_layers=2)
    head.save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="single-layer heads.*vllm-eagle3"):
        E.export(tmp_path / "two", "sglang-eagle3", tmp_path / "o")
    E.export(tmp_path / "two", "vllm-eagle3", tmp_path / "o")  # a 2-layer head is fine for vLLM
    assert not (tmp_path / "o").joinpath("x").exists() and E.validate("vllm-eagle3", tmp_path / "o") == []


def test_target_dir_checked_and_recorded(eagle3_ckpt, tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    make_tiny_model("llama").save_pretrained(good)
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 8}))
    s = E.export(eagle3_ckpt[1], "vllm-eagle3", tmp_path / "o", target=str(good))
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert s["warnings"] == [] and cfg["speculators_config"]["verifier"] == {
        "name_or_path": str(good), "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError, match="target_hidden_size=32.*has 64: wrong --target"):
        E.export(eagle3_ckpt[1], "vllm-eagle3", tmp_path / "o2", target=str(bad))
    assert not (tmp_path / "o2").exists()


# ---- Medusa ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", MEDUSA)
def test_medusa_round_trip_by_hand(target, medusa_ckpt, tmp_path, fmt):
    heads, ckpt = medusa_ckpt
    E.export(ckpt, fmt, tmp_path / "out")
    out = tmp_path / "out"
    assert E.validate(fmt, out) == []
    config = json.loads((out / "config.json").read_text())
    if fmt == "medusa":
        t = load_file(str(out / "medusa_lm_head.safetensors"))
        k, n = config["medusa_num_heads"], config["medusa_num_layers"]
        w, b, lm = "{i}.{j}.linear.weight", "{i}.{j}.linear.bias", "{i}.{n}.weight"
        assert config["base_model_name_or_path"] == "tiny-llama"
    else:
        t = load_file(str(out / "model.safetensors"))
        k, n = config["num_heads"], config["num_hidden_layers"]
        w, b, lm = "blocks.{i}.layers.{j}.weight", "blocks.{i}.layers.{j}.bias", "lm_heads.{i}.weight"
        assert config["model_type"] == "medusa" and config["medusa_fc_bias"] is True
        assert (config["hidden_size"], config["vocab_size"]) == (32, 128)
    assert (k, n) == (3, 2)
    h = final_hidden(target, ids_for(target))[0]
    with torch.no_grad():
        for i in range(k):
            x = h.float()
            for j in range(n):  # ResBlock: x + SiLU(W x + b), layers in order
                x = x + F.silu(x @ t[w.format(i=i, j=j)].T + t[b.format(i=i, j=j)])
            torch.testing.assert_close(x @ t[lm.format(i=i, n=n)].T, heads.head_logits(i, h), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt,tensors,config,expect", [
    ("vllm-medusa", lambda t: t.pop("lm_heads.1.weight"), None, "missing tensor lm_heads.1.weight"),
    ("vllm-medusa", lambda t: t.update({"lm_heads.0.weight": t["lm_heads.0.weight"].T.contiguous()}), None,
     "transposed"),
    ("vllm-medusa", None, lambda c: c.update(num_heads=4), "missing tensor blocks.3.layers.0.weight"),
    ("vllm-medusa", None, lambda c: c.update(hidden_size=31), "blocks.0.layers.0.weight has shape [32, 32]"),
    ("vllm-medusa", None, lambda c: c.update(medusa_fc_bias=False), "vLLM would drop them"),
    ("vllm-medusa", None, lambda c: c.update(medusa_num_heads=3), "would overwrite num_heads"),
    ("medusa", lambda t: t.update({"0.2.weight": t["0.2.weight"].T.contiguous()}), None, "transposed"),
    ("medusa", lambda t: t.pop("2.1.linear.bias"), None, "missing tensor 2.1.linear.bias"),
    ("medusa", None, lambda c: c.update(medusa_num_layers=1), "unexpected tensor"),
    ("medusa", None, lambda c: c.update(medusa_num_heads=2), "unexpected tensor 2.0.linear.weight"),
    ("medusa", None, lambda c: c.pop("base_model_name_or_path"), "lacks a required field: 'base_model_name_or_path'"),
    ("medusa", None, lambda c: c.update(medusa_num_heads="3"), "malformed"),
])
def test_medusa_validation_catches_broken_export(medusa_ckpt, tmp_path, fmt, tensors, config, expect):
    E.export(medusa_ckpt[1], fmt, tmp_path / "out")
    weights = "medusa_lm_head.safetensors" if fmt == "medusa" else "model.safetensors"
    rewrite(tmp_path / "out", weights, tensors=tensors, config=config)
    problems = E.validate(fmt, tmp_path / "out")
    assert any(expect in p for p in problems), problems


# ---- separate draft --------------------------------------------------------------------------
def make_draft_ckpt(path: Path, tokenizer: bool = True):
    model = make_tiny_model("llama", tied=True, layers=2, seed=3)
    model.save_pretrained(path)
    if tokenizer:
        make_tokenizer(128).save_pretrained(path)
    (path / "drafter_config.json").write_text(json.dumps({"kind": "draft", "target": "tiny-llama",
                                                          "target_vocab_size": 128}))
    (path / "best.json").write_text("{}")  # run bookkeeping that must not travel
    (path / "accelerate").mkdir()
    seal(path)  # what spectrain's checkpointing writes; export refuses an unsealed checkpoint
    return model


def test_hf_draft_round_trip_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student = make_draft_ckpt(tmp_path / "run" / "best")
    s = E.export(tmp_path / "run", "hf-draft", tmp_path / "out")  # a run dir resolves to best/
    out = tmp_path / "out"
    assert s["source"].endswith("best") and "best.json" in s["skipped"] and "accelerate" in s["skipped"]
    assert E.validate("hf-draft", out) == [] and (out / "drafter_config.json").is_file()
    assert not (out / "best.json").exists() and len(AutoTokenizer.from_pretrained(str(out))) == 128
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits,
                                   student(ids).logits, rtol=0, atol=0)


def test_hf_draft_takes_the_targets_tokenizer_and_validation_catches_breakage(tmp_path):
    make_draft_ckpt(tmp_path / "ckpt", tokenizer=False)
    tdir = tmp_path / "target"
    make_tiny_model("llama").save_pretrained(tdir)
    make_tokenizer(128).save_pretrained(tdir)
    s = E.export(tmp_path / "ckpt", "hf-draft", tmp_path / "out", target=str(tdir))
    assert "copied the target's" in s["warnings"][0] and (tmp_path / "out" / "tokenizer.json").is_file()
    out = tmp_path / "out"
    (out / "tokenizer.json").unlink()
    rewrite(out, "model.safetensors", tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    problems = E.validate("hf-draft", out)
    assert any("missing tensor model.layers.1.mlp.up_proj.weight" in p for p in problems), problems
    assert any("tokenizer" in p for p in problems), problems


# ---- refusals, staging, CLI ------------------------------------------------------------------
def test_wrong_kind_and_bad_sources_refused(eagle3_ckpt, medusa_ckpt, tmp_path):
    with pytest.raises(ValueError, match="holds a 'medusa' drafter.*use --format vllm-medusa or medusa"):
        E.export(medusa_ckpt[1], "vllm-eagle3", tmp_path / "o")
    with pytest.raises(ValueError, match="holds a 'eagle3' drafter.*separate draft models"):
        E.export(eagle3_ckpt[1], "hf-draft", tmp_path / "o")
    with pytest.raises(ValueError, match="neither drafter_config.json"):
        E.export(tmp_path, "medusa", tmp_path / "o")
    with pytest.raises(ValueError, match="unknown export format"):
        E.export(medusa_ckpt[1], "onnx", tmp_path / "o")
    with pytest.raises(ValueError, match=r"is \(or contains\) the source .*would destroy it"):
        E.export(medusa_ckpt[1], "medusa", medusa_ckpt[1].parent, force=True)
    assert not (tmp_path / "o").exists()


def test_existing_out_refused_unless_force_and_kept_when_new_export_is_invalid(medusa_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("a user's file")
    with pytest.raises(FileExistsError, match="spectrain did not write"):  # a user's directory: never replaced
        E.export(medusa_ckpt[1], "medusa", out, force=True)
    out = tmp_path / "out"
    shutil.rmtree(out)
    E.export(medusa_ckpt[1], "medusa", out)
    (out / "keep.txt").write_text("old")  # an earlier export: replaced only with --force
    with pytest.raises(FileExistsError, match="--force"):
        E.export(medusa_ckpt[1], "medusa", out)
    monkeypatch.setattr(medusa_export, "validate_medusa", lambda d: ["planted problem"])
    with pytest.raises(E.ExportError, match="planted problem"):
        E.export(medusa_ckpt[1], "medusa", out, force=True)
    assert (out / "keep.txt").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.undo()
    E.export(medusa_ckpt[1], "medusa", out, force=True)
    assert not (out / "keep.txt").exists() and E.validate("medusa", out) == []


def test_run_dir_falls_back_to_last(medusa_ckpt, tmp_path):
    import shutil

    shutil.copytree(medusa_ckpt[1], tmp_path / "run" / "last")
    assert E.export(tmp_path / "run", "vllm-medusa", tmp_path / "o")["source"].endswith("last")


def test_cli_exit_codes(medusa_ckpt, tmp_path, capsys):
    parser = E.add_export_args(argparse.ArgumentParser())
    out = tmp_path / "out"
    assert E.main(parser.parse_args([str(medusa_ckpt[1]), "--format", "vllm-medusa", "--out", str(out)])) == 0
    assert "validated: OK" in capsys.readouterr().out
    assert E.main(parser.parse_args([str(out), "--format", "vllm-medusa", "--validate-only"])) == 0
    rewrite(out, "model.safetensors", config=lambda c: c.update(num_heads=5))
    assert E.main(parser.parse_args([str(out), "--format", "vllm-medusa", "--validate-only"])) == 2
    assert "missing tensor blocks.3.layers.0.weight" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--out DIR is required"):
        E.main(parser.parse_args([str(medusa_ckpt[1]), "--format", "medusa"]))


def test_hf_draft_with_another_vocabulary_refused(tmp_path):
    make_draft_ckpt(tmp_path / "ckpt")
    tdir = tmp_path / "target"
    make_tiny_model("llama").save_pretrained(tdir)
    make_tokenizer(128, rename={7: "other"}).save_pretrained(tdir)
    with pytest.raises(ValueError, match=r"differs from target .* 2 \(token, id\) entries.*'other', 7"):
        E.export(tmp_path / "ckpt", "hf-draft", tmp_path / "out", target=str(tdir))
    assert not (tmp_path / "out").exists()


def test_relative_target_path_warned(medusa_ckpt, tmp_path, monkeypatch):
    make_tiny_model("llama").save_pretrained(tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    s = E.export(medusa_ckpt[1], "vllm-medusa", tmp_path / "o", target="t")
    assert any("relative path 't'" in w for w in s["warnings"])


# ---- what the real loaders need (issue: serving interop) ---------------------------------------
def test_vllm_eagle3_writes_target_embedding_and_every_layout_flag(target, eagle3_ckpt, tmp_path, capsys):
    tdir = tmp_path / "t"
    target.model.save_pretrained(tdir)
    s = E.export(eagle3_ckpt[1], "vllm-eagle3", tmp_path / "v", target=str(tdir))
    emb = load_file(str(tmp_path / "v" / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(emb, target.embed_tokens.weight.detach()) and s["embed_tokens_bytes"] == 128 * 32 * 4
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert {k: cfg[k] for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")} == dict.fromkeys(
        ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"), False)
    parser = E.add_export_args(argparse.ArgumentParser())
    assert E.main(parser.parse_args([str(eagle3_ckpt[1]), "--format", "vllm-eagle3", "--out", str(tmp_path / "v3"),
                                     "--target", str(tdir)])) == 0
    assert "includes the target's embed_tokens.weight (0.0 MiB)" in capsys.readouterr().out
    s = E.export(eagle3_ckpt[1], "vllm-eagle3", tmp_path / "v2")  # no local target: said, not silent
    assert any("embed_tokens.weight not written" in w for w in s["warnings"])


def test_sglang_eagle3_states_trtllm_capture_layers(target, tmp_path, capsys):
    tdir = tmp_path / "t"
    target.model.save_pretrained(tdir)
    default = make_head(target, draft_vocab_size=96)  # inputs [2, 4, 5] = TensorRT-LLM's default outputs {1, 3, 4}
    default.save_pretrained(tmp_path / "d")
    s = E.export(tmp_path / "d", "sglang-eagle3", tmp_path / "sd", target=str(tdir))
    assert s["trtllm_eagle3_layers_to_capture"] == [1, 3, 4] and not any("TensorRT" in w for w in s["warnings"])
    assert "equals TensorRT-LLM's default" in (tmp_path / "sd" / "README.md").read_text()
    custom = make_head(target, draft_vocab_size=96, aux_layers=[1, 3, 6])
    custom.save_pretrained(tmp_path / "c")
    parser = E.add_export_args(argparse.ArgumentParser())
    assert E.main(parser.parse_args([str(tmp_path / "c"), "--format", "sglang-eagle3", "--out", str(tmp_path / "sc"),
                                     "--target", str(tdir)])) == 0
    assert "eagle3_layers_to_capture={0, 2, 5}" in capsys.readouterr().err
    meta = json.loads((tmp_path / "sc" / "config.json").read_text())["spectrain_export"]
    assert meta == {"trtllm_eagle3_layers_to_capture": [0, 2, 5], "trtllm_default_layers_to_capture": [1, 3, 4]}
    layout = make_head(target, draft_vocab_size=96, norm_output=True)
    layout.save_pretrained(tmp_path / "l")
    with pytest.raises(ValueError, match=r"\['norm_output'\].*use --format vllm-eagle3"):
        E.export(tmp_path / "l", "sglang-eagle3", tmp_path / "sl")


def fasterdecoding_heads(h: int, v: int, k: int = 5, layers: int = 1) -> torch.nn.ModuleList:
    """FasterDecoding/Medusa's head stack, as its from_pretrained builds it: medusa_num_heads forced to 5, and
    [ResBlock] * layers repeats ONE module object."""
    class ResBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(h, h)

        def forward(self, x):
            return x + F.silu(self.linear(x))

    return torch.nn.ModuleList(torch.nn.Sequential(*([ResBlock()] * layers), torch.nn.Linear(h, v, bias=False))
                               for _ in range(k))


def test_medusa_pt_loads_in_fasterdecoding_without_missing_heads(target, tmp_path):
    heads = make_heads(target, num_heads=5, num_resblocks=1, perturb=0.3)
    heads.save_pretrained(tmp_path / "m")
    s = E.export(tmp_path / "m", "medusa", tmp_path / "o")
    assert s["warnings"] == [w for w in s["warnings"] if "FasterDecoding" not in w]
    state = torch.load(tmp_path / "o" / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    fd = fasterdecoding_heads(32, 128)
    missing, unexpected = fd.load_state_dict(state, strict=False)  # what FasterDecoding calls
    assert missing == [] and unexpected == []
    h = final_hidden(target, ids_for(target))[0]
    with torch.no_grad():
        for i in range(5):
            torch.testing.assert_close(fd[i](h.float()), heads.head_logits(i, h), rtol=0, atol=1e-6)


def test_medusa_warns_for_what_fasterdecoding_cannot_represent(medusa_ckpt, tmp_path):
    s = E.export(medusa_ckpt[1], "medusa", tmp_path / "o")  # 3 heads, 2 ResBlocks each
    text = " ".join(s["warnings"])
    assert "heads 3..4 of this 3-head export would stay at their initialisation" in text
    assert "shares ONE ResBlock object" in text
    (tmp_path / "o" / "medusa_lm_head.pt").unlink()
    assert any("missing medusa_lm_head.pt" in p for p in E.validate("medusa", tmp_path / "o"))


def test_hf_draft_config_carries_both_rope_styles(tmp_path):
    from transformers import AutoConfig

    model = make_draft_ckpt(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg["rope_parameters"] = llama3
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    seal(tmp_path / "ckpt")
    E.export(tmp_path / "ckpt", "hf-draft", tmp_path / "out")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["rope_parameters"] == llama3 and out["rope_theta"] == 500000.0  # transformers 5 / 4.x
    assert out["rope_scaling"] == {k: v for k, v in llama3.items() if k != "rope_theta"}
    assert AutoConfig.from_pretrained(str(tmp_path / "out")).rope_parameters == llama3
    assert model is not None


def test_gguf_type_is_refused_for_formats_that_write_no_gguf(eagle3_ckpt, tmp_path):
    with pytest.raises(ValueError, match="--gguf-type .* writes no GGUF"):
        E.export(eagle3_ckpt[1], "vllm-eagle3", tmp_path / "out", gguf_type="q8_0")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("written,asked,ok", [("Q8_0", "q8_0", True), ("F32", "f32", True), ("F32", "q8_0", False),
                                              ("Q8_0", "f32", False), ("Q8_0", None, True)])
def test_gguf_validation_checks_the_weight_type_asked_for(tmp_path, written, asked, ok):
    from gguf_fixture import write_tiny_gguf

    from spectrain.export.llama_cpp import gguf_problems

    path = write_tiny_gguf(tmp_path / "draft.gguf", quant=written)
    problems = gguf_problems(path, "llama.cpp-draft", None, asked)
    assert (problems == []) == ok, problems
    if not ok:  # names what the file holds and what was asked for
        assert written.lower() in problems[0] and asked in problems[0]
