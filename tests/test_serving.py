"""The serve command `spectrain export` prints and writes into the export's README.md: every flag and config key
is one of the engines' names (spectrain/export/serving.py ENGINE_FLAGS, each with its source), and --k / --tree land on
the right flags. Plus `deploy.engine`: `check` / recipe validation refuse layouts the engine cannot compute."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest
import torch
from conftest import make_tiny_target
from test_eagle3 import make_head
from test_export import make_draft_ckpt
from test_medusa import make_heads

from spectrain import export as E
from spectrain.export.serving import ENGINE_FLAGS, FORMAT_ENGINES
from spectrain.recipe.deploy import engine_problems
from spectrain.recipe.load import load_recipe

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    target = make_tiny_target("llama")  # 8 layers: aux layers [2, 4, 5]
    root = tmp_path_factory.mktemp("serve")
    make_head(target, draft_vocab_size=96, ttt_steps=3).save_pretrained(root / "e3")
    make_heads(target, num_heads=4).save_pretrained(root / "md")
    make_draft_ckpt(root / "draft")
    return {"eagle3": root / "e3", "medusa": root / "md", "draft": root / "draft"}


def run_export(src, fmt, out, *extra) -> tuple[int, str]:
    parser = E.add_export_args(argparse.ArgumentParser())
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = E.main(parser.parse_args([str(src), "--format", fmt, "--out", str(out), *extra]))
    return rc, buf.getvalue()


def parse_printed(text: str) -> dict[str, dict]:
    """engine -> {flag or config key: value} read back from the printed shell text (not from our objects)."""
    engines, cur, yaml_lines, in_yaml = {}, None, [], False
    names = {"# vLLM": "vllm", "# SGLang": "sglang", "# TensorRT-LLM": "trtllm"}
    for line in text.splitlines():
        if line in names:
            cur = names[line]
            engines[cur] = {}
        elif cur and line.startswith("cat > "):
            in_yaml, yaml_lines = True, []
        elif cur and in_yaml:
            if line == "EOF":
                in_yaml = False
                import yaml

                cfg = yaml.safe_load("\n".join(yaml_lines))
                engines[cur].update({k: True for k in cfg}, **cfg["speculative_config"])
            else:
                yaml_lines.append(line)
        elif cur and line.strip() and not line.startswith("#"):
            engines[cur].setdefault("_cmd", []).append(line.rstrip("\\").strip())
    for flags in engines.values():
        words = shlex.split(" ".join(flags.pop("_cmd", [])))
        flags["_program"] = " ".join(words[:3] if words[0] == "python" else words[:2] if words[:2] == ["vllm", "serve"]
                                     else words[:1])
        for i, w in enumerate(words):
            if w.startswith("--"):
                flags[w] = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True
        if "--speculative-config" in flags:
            flags.update(json.loads(flags["--speculative-config"]))
    return engines


def assert_known(engine: str, flags: dict) -> None:
    known = ENGINE_FLAGS[engine]
    assert flags["_program"] in known
    unknown = [k for k in flags if k != "_program" and k not in known]
    assert not unknown, f"{engine}: flags/keys not in ENGINE_FLAGS: {unknown}"


def test_eagle3_chain_k_maps_to_every_engine(ckpts, tmp_path):
    for fmt in ("vllm-eagle3", "sglang-eagle3"):
        out = tmp_path / fmt
        rc, text = run_export(ckpts["eagle3"], fmt, out, "--k", "4")
        assert rc == 0
        printed = parse_printed(text)
        assert set(printed) == set(FORMAT_ENGINES[fmt])
        for engine, flags in printed.items():
            assert_known(engine, flags)
        readme = (out / "README.md").read_text()
        assert "## Serve it" in readme and "k=4" in readme and E.validate(fmt, out) == []
    v = parse_printed(run_export(ckpts["eagle3"], "vllm-eagle3", tmp_path / "v2", "--k", "4")[1])["vllm"]
    assert v["method"] == "eagle3" and v["num_speculative_tokens"] == 4 and v["model"] == str(tmp_path / "v2")
    s = parse_printed(run_export(ckpts["eagle3"], "sglang-eagle3", tmp_path / "s2", "--k", "4")[1])
    sg, trt = s["sglang"], s["trtllm"]
    assert (sg["--speculative-algorithm"], sg["--speculative-num-steps"], sg["--speculative-eagle-topk"],
            sg["--speculative-num-draft-tokens"]) == ("EAGLE3", "4", "1", "5")  # SGLang counts the root token
    assert sg["--speculative-draft-model-path"] == str(tmp_path / "s2")
    assert trt["decoding_type"] == "Eagle3" and trt["max_draft_len"] == 4 and "use_dynamic_tree" not in trt
    assert trt["eagle3_layers_to_capture"] == [1, 3, 4]  # aux inputs [2, 4, 5] -> layer outputs


def test_eagle3_tree_maps_to_sglang_and_trtllm_and_is_labelled_for_vllm(ckpts, tmp_path):
    tree = "topk=3,depth=4,total=10"
    s = parse_printed(run_export(ckpts["eagle3"], "sglang-eagle3", tmp_path / "s", "--tree", tree)[1])
    sg, trt = s["sglang"], s["trtllm"]
    assert (sg["--speculative-num-steps"], sg["--speculative-eagle-topk"], sg["--speculative-num-draft-tokens"]) == \
        ("4", "3", "11")
    assert (trt["max_draft_len"], trt["use_dynamic_tree"], trt["dynamic_tree_max_topK"],
            trt["max_total_draft_tokens"]) == (4, True, 3, 10)
    rc, text = run_export(ckpts["eagle3"], "vllm-eagle3", tmp_path / "v", "--tree", tree)
    assert parse_printed(text)["vllm"]["num_speculative_tokens"] == 4
    assert "dynamic tree" in text and "chain of 4" in text  # the mismatch is said, not hidden
    assert "chain of 4" in (tmp_path / "v" / "README.md").read_text()


def test_medusa_and_draft_model_commands(ckpts, tmp_path):
    rc, text = run_export(ckpts["medusa"], "medusa", tmp_path / "m", "--k", "3")
    trt = parse_printed(text)["trtllm"]
    assert_known("trtllm", trt)
    assert (trt["decoding_type"], trt["max_draft_len"], trt["num_medusa_heads"], trt["--backend"]) == \
        ("Medusa", 3, 4, "tensorrt")
    assert trt["medusa_choices"] == [[0], [0, 0], [0, 0, 0]]
    rc, text = run_export(ckpts["medusa"], "vllm-medusa", tmp_path / "vm")
    v = parse_printed(text)["vllm"]
    assert v["method"] == "medusa" and v["num_speculative_tokens"] == 4  # default: every head
    assert "vLLM 0.33.0 has no Medusa" in text
    with pytest.raises(ValueError, match="exceeds this Medusa export's 4 heads"):
        run_export(ckpts["medusa"], "medusa", tmp_path / "m2", "--k", "5")
    rc, text = run_export(ckpts["draft"], "hf-draft", tmp_path / "d", "--k", "6")
    p = parse_printed(text)
    for engine, flags in p.items():
        assert_known(engine, flags)
    assert p["vllm"]["method"] == "draft_model" and p["vllm"]["num_speculative_tokens"] == 6
    assert p["sglang"]["--speculative-algorithm"] == "STANDALONE" and p["sglang"]["--speculative-num-draft-tokens"] == "7"
    assert p["trtllm"]["decoding_type"] == "DraftTarget" and p["trtllm"]["max_draft_len"] == 6
    assert E.validate("hf-draft", tmp_path / "d") == []


def test_engine_choice_and_bad_input(ckpts, tmp_path):
    rc, text = run_export(ckpts["eagle3"], "sglang-eagle3", tmp_path / "a", "--engine", "trtllm")
    assert set(parse_printed(text)) == {"trtllm"}
    with pytest.raises(ValueError, match="served by vllm"):
        run_export(ckpts["eagle3"], "vllm-eagle3", tmp_path / "b", "--engine", "sglang")
    with pytest.raises(ValueError, match="--tree"):
        run_export(ckpts["eagle3"], "vllm-eagle3", tmp_path / "c", "--tree", "topk=0")
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_engine_problems_facts():
    flags = {"norm_before_fc": False, "fc_norm": False, "norm_before_residual": True, "norm_output": False}
    assert engine_problems("vllm", "eagle3", flags) == []
    assert "layout norms" in engine_problems("sglang", "eagle3", flags)[0]
    none = dict.fromkeys(flags, False)
    assert engine_problems("trtllm", "eagle3", none, num_layers=2)[0].startswith("2 draft layers")
    assert "fc_norm" in engine_problems("vllm", "eagle3", {**none, "fc_norm": True})[0]
    assert "no Medusa" in engine_problems("vllm", "medusa", none)[0]
    assert engine_problems("trtllm", "medusa", none) == [] and engine_problems("", "eagle3", flags) == []


def test_recipe_deploy_engine_refuses_what_the_engine_cannot_compute(capsys):
    # the tiny recipe trains speculators' layout (norm_before_fc, norm_before_residual, norm_output)
    with pytest.raises(ValueError, match=r"deploy.engine=vllm.*\['norm_output'\]"):
        load_recipe("tiny/eagle3", ["deploy.engine=vllm"])
    vllm_ok = ["drafter.eagle3.norm_output=false", "drafter.eagle3.norm_before_fc=false"]
    assert load_recipe("tiny/eagle3", ["deploy.engine=vllm", *vllm_ok]).deploy.engine == "vllm"
    with pytest.raises(ValueError, match=r"deploy.engine=sglang.*norm_before_residual.*layout norms"):
        load_recipe("tiny/eagle3", ["deploy.engine=sglang", *vllm_ok])
    with pytest.raises(ValueError, match=r"deploy.engine=vllm.*no Medusa"):
        load_recipe("tiny/medusa", ["deploy.engine=vllm"])
    with pytest.raises(ValueError, match="deploy.engine"):
        load_recipe("tiny/eagle3", ["deploy.engine=tgi"])
    from spectrain.cli import main

    assert main(["check", "tiny/eagle3", "deploy.engine=trtllm", "drafter.eagle3.num_layers=2"]) == 2
    assert "FAILED" in capsys.readouterr().err
