"""The cost plan (`spectrain check RECIPE --plan 8xH100`) and the disk checks of prepare-features and train."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from conftest import make_tiny_target
from test_features import make_rows as feature_rows
from test_train import make_rows, tiny_recipe

from spectrain.data.features import main as features_main
from spectrain.recipe.load import load_recipe
from spectrain.train import check
from spectrain.train import loop as T
from spectrain.train.plan import (
    DEFAULT_MFU,
    DataSize,
    Shape,
    estimate,
    parse_hardware,
    plan_lines,
    training_cost,
)

Usage = namedtuple("Usage", "total used free")


def _free(monkeypatch, free_bytes: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**15, 10**15 - free_bytes, free_bytes))


def _llama8b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


def test_hardware_names():
    hw = parse_hardware("8xH100")
    assert (hw.gpus, hw.name, hw.peak_flops, hw.memory) == (8, "H100", 989e12, 80 * 2**30)
    assert parse_hardware("l40s").gpus == 1 and parse_hardware("4 x a100").name == "A100"
    for bad in ("8xH900", "0xH100", "eight H100"):
        with pytest.raises(ValueError, match="known GPUs: H100, H200, A100, L40S"):
            parse_hardware(bad)


def test_shapes_match_the_documented_arithmetic():
    t = Shape.of(_llama8b())
    assert round(t.params() / 1e9, 2) == 8.03  # recipes/README.md: 8.03 B
    d = training_cost(load_recipe("eagle3"), t)
    assert round(d.params / 1e6) == 425 and d.trained == d.params - 32000 * 4096  # frozen lm_head
    assert round(training_cost(load_recipe("medusa"), t).params / 1e9, 2) == 2.17


def test_flops_reproduce_the_measured_gpu_check_point():
    """docs/gpu_check_h200.md: EAGLE-3 on a synthetic Llama-3.2-1B-shaped target, micro 4 x 2048, TTT 7,
    19,376 tokens/s = 169.3 TFLOP/s on one H200; the plan's formula must give the same FLOPs per token."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
    r = load_recipe("eagle3", ["drafter.eagle3.ttt_steps=7", "training.max_steps=1", "training.global_batch_size=4",
                               "training.micro_batch_size=4"])
    est = estimate(r, cfg, DataSize(4, 0, 2048), parse_hardware("1xH200"))
    assert abs(est.flops_per_token * 19376 / 1e12 - 169.3) < 1.0
    assert abs(est.flops_per_token * 19376 / 989e12 - DEFAULT_MFU) < 0.002  # the default MFU is that point


def test_plan_for_the_8b_recipe(monkeypatch):
    _free(monkeypatch, 10 * 2**40)
    lines, problems = plan_lines(load_recipe("eagle3"), _llama8b(), DataSize(200_000, 2_000, 1200), parse_hardware("8xH100"))
    text = "\n".join(lines)
    assert not problems and "ESTIMATES" in text
    assert "9375 optimizer steps = 3 epochs x (200000 rows // global batch 64); grad accumulation 4" in text
    assert "tokens trained: 720.0 M" in text and "GPU-hours" in text and "MFU 0.17, measured once" in text
    assert "memory per GPU: ddp ~33.2 GiB, zero2 ~29.6 GiB" in text  # recipes/README.md: ~30 GiB at micro 2


def test_check_plan_prints_and_refuses_a_cache_that_does_not_fit(monkeypatch, capsys, tmp_path):
    small = ["data.max_rows=600", "training.micro_batch_size=1"]  # quick; global 8 splits over 8 GPUs
    assert check.main("tiny/eagle3", [f"output_dir={tmp_path / 'run'}", *small], plan="8xH100") == 0
    out = capsys.readouterr().out
    for key in ("plan for 8xH100", "train +", "optimizer steps", "wall time", "GPU-hours", "feature cache",
                "checkpoints:", "memory per GPU"):
        assert key in out
    _free(monkeypatch, 2**30)  # 1 GiB free: the tiny cache (~2.8 GiB) cannot fit
    offline = ["training.features=offline", f"training.feature_cache={tmp_path / 'cache'}", "data.max_rows=12000",
               "training.micro_batch_size=1"]
    monkeypatch.setattr(check, "_check_target", lambda r: (_tiny_cfg(), _ref_tok()))  # no cache yet: skip that check
    assert check.main("tiny/eagle3", offline, plan="8xH100") == 2
    err = capsys.readouterr().err
    assert "FAILED: plan: the feature cache needs ~" in err and "features.dtype=fp8" in err
    assert check.main("tiny/eagle3", [], plan="8xH900") == 2
    assert "known GPUs" in capsys.readouterr().err


def _tiny_cfg():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(Path(__file__).resolve().parents[1] / "assets" / "reference-target"))


def _ref_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "assets" / "reference-target"))


def test_prepare_features_refuses_a_full_disk(monkeypatch, tmp_path, capsys):
    import spectrain.data.features

    target = make_tiny_target("llama")
    monkeypatch.setattr(spectrain.data.features, "load_target", lambda *a, **k: target)
    monkeypatch.setattr(spectrain.data.features, "build_dataset", lambda cfg, tok, split, **k: feature_rows(6))
    _free(monkeypatch, 1000)
    out = tmp_path / "cache"
    with pytest.raises(ValueError, match="the feature cache needs ~.* but only 0 MiB are free there"):
        features_main("tiny/eagle3", [f"training.feature_cache={out}", "drafter.eagle3.aux_layers=1,2,3"])
    assert "bytes/token" in capsys.readouterr().out and not list(out.glob("*.safetensors"))


def test_train_refuses_when_checkpoints_cannot_fit(monkeypatch, tmp_path):
    _free(monkeypatch, 1000)
    with pytest.raises(ValueError, match="training's checkpoints needs ~.* MiB at .*keep_checkpoints"):
        T.train(tiny_recipe(tmp_path / "run"), target=make_tiny_target("llama"), train_rows=make_rows(24))
    assert not (tmp_path / "run" / "init").exists()
