"""EAGLE-3 conformance against the real `speculators` package (0.9.0), replayed from committed fixtures.

tests/fixtures/conformance was written by scripts/make_conformance_fixtures.py running speculators itself:
(a) speculators-built, briefly speculators-trained heads (its trainer-default layout, a plain one without
d2t/t2d or a stored embedding, an fc_norm one) with the logits of speculators' own forward; (b) spectrain's
vllm-eagle3 exports with the logits speculators computes on them. Fast tests: spectrain's import reproduces
(a), and spectrain's own head reproduces (b), to 1e-5. The slow test reruns the script with the real package.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spectrain import registry
from spectrain.decoding.loop import speculative_generate
from spectrain.drafters import load_drafter
from spectrain.drafters.eagle3.decode import Eagle3Proposer
from spectrain.drafters.eagle3.interop import import_eagle3
from spectrain.drafters.eagle3.model import LAYOUT_FLAGS, Eagle3Head
from spectrain.targets.model import FrozenTarget

torch.set_num_threads(1)
FIX = Path(__file__).parent / "fixtures" / "conformance"
REPO = Path(__file__).resolve().parents[1]
SPEC_VARIANTS = ("default", "bf16", "window8", "plain", "fcnorm")
SPECTRAIN_VARIANTS = ("plain", "speculators-defaults")
TOL = 1e-5


def fixture_target(root: Path) -> FrozenTarget:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32).eval()
    return FrozenTarget(model, tokenizer=None, name_or_path=str(root / "target"))


def ttt_diff(head: Eagle3Head, target, root: Path, logits: torch.Tensor) -> float:
    """Max |spectrain TTT logits - recorded logits| over every step i and anchor t <= n-2-i (speculators' anchor t
    is its position t of the shifted batch; both see input token x_{t+1+i} and aux features g_t)."""
    inp = load_file(str(root / "inputs.safetensors"))
    ids, aux = inp["input_ids"], inp["aux"]
    n = ids.shape[1]
    with torch.no_grad():
        mine = head.eval().ttt_logits(ids, torch.ones_like(ids), aux, target, logits.shape[0])
    return max(float((mine[i][0, : n - 1 - i] - logits[i, : n - 1 - i]).abs().max()) for i in range(len(mine)))


def recorded(d: Path) -> torch.Tensor:
    return load_file(str(d / "logits.safetensors"))["logits"]


@pytest.fixture(scope="module")
def target():
    return fixture_target(FIX)


def test_target_features_equal_the_recorded_ones(target):
    inp = load_file(str(FIX / "inputs.safetensors"))
    out = target(inp["input_ids"], aux_layers=[2, 4, 5], want_logits=False)
    torch.testing.assert_close(torch.cat(out.aux_hidden, -1), inp["aux"], rtol=0, atol=TOL)


@pytest.mark.parametrize("variant", SPEC_VARIANTS)
def test_import_reproduces_speculators_logits(target, variant):
    d = FIX / f"speculators_{variant}"
    drafter = load_drafter(d, target)  # detected as a speculators head, imported exactly
    assert isinstance(drafter, Eagle3Proposer)
    config = json.loads((d / "config.json").read_text())
    assert {k: drafter.model.layout[k] for k in LAYOUT_FLAGS} == {k: config.get(k, False) for k in LAYOUT_FLAGS}
    assert ttt_diff(drafter.model, target, FIX, recorded(d)) <= TOL


def test_sliding_window_matters_in_the_window8_fixture(target):
    d = FIX / "speculators_window8"
    head = load_drafter(d, target).model
    assert head.windows == [8]
    head.windows = [None]  # the same weights with full attention: another function on these 24-token inputs
    assert ttt_diff(head, target, FIX, recorded(d)) > 1e-3


def test_bf16_head_computes_with_the_rounded_embedding(target):
    head = load_drafter(FIX / "speculators_bf16", target).model
    assert head.config["embed_dtype"] == "bfloat16"
    saved = head.config.pop("embed_dtype")  # the target's fp32 rows instead: measurably another function
    assert ttt_diff(head, target, FIX, recorded(FIX / "speculators_bf16")) > TOL
    head.config["embed_dtype"] = saved


def test_bf16_head_exports_and_imports_back_exactly(target, tmp_path):
    """Its vllm-eagle3 export stores the rounded rows (what it computes with), and imports back identically."""
    import shutil

    from spectrain import export as E

    head = load_drafter(FIX / "speculators_bf16", target).model
    head.save_pretrained(tmp_path / "h")
    shutil.copytree(FIX / "target", tmp_path / "t")
    E.export(tmp_path / "h", "vllm-eagle3", tmp_path / "v", target=str(tmp_path / "t"))
    back = import_eagle3(tmp_path / "v", target)
    assert back.config["embed_dtype"] == "bfloat16"
    assert ttt_diff(back, target, FIX, recorded(FIX / "speculators_bf16")) <= TOL


def test_speculators_default_layout_is_what_its_trainer_writes():
    config = json.loads((FIX / "speculators_default" / "config.json").read_text())
    assert config["norm_before_fc"] and config["norm_before_residual"] and config["norm_output"]
    assert not config["fc_norm"] and config["transformer_layer_config"]["layer_types"] == ["sliding_attention"]


@pytest.mark.parametrize("variant", SPECTRAIN_VARIANTS)
def test_speculators_logits_on_spectrain_export_equal_spectrain(target, variant):
    d = FIX / f"spectrain_{variant}"
    head = Eagle3Head.from_pretrained(d / "head", target)
    assert ttt_diff(head, target, FIX, recorded(d)) <= TOL
    back = import_eagle3(d / "export", target)  # export -> import is the identity
    assert back.layout == head.layout and back.aux_layers == head.aux_layers
    mine, theirs = head.state_dict(), back.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_sglang_export_read_by_speculators_converter(target):
    """speculators' reader of the EAGLE/SGLang format (Eagle3Converter) computed spectrain's logits on the
    sglang-eagle3 export (recorded when the fixtures were made), and spectrain imports it back identically."""
    meta = json.loads((FIX / "meta.json").read_text())
    assert meta["spectrain_plain"]["sglang_via_speculators_converter_max_abs"] <= TOL
    head = Eagle3Head.from_pretrained(FIX / "spectrain_plain" / "head", target)
    back = import_eagle3(FIX / "spectrain_plain" / "sglang", target)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))


def test_imported_default_layout_decodes_losslessly(target):
    drafter = load_drafter(FIX / "speculators_default", target)
    ids = load_file(str(FIX / "inputs.safetensors"))["input_ids"][0, :8]
    out = speculative_generate(target, drafter, ids, max_new_tokens=12, k=3)
    ref = target.model.generate(ids[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 8:]
    assert out.tokens == ref.tolist()


def test_speculators_default_head_trains_in_spectrain(target):
    """init_from loads speculators' default layout; TTT training moves its layout-specific weights."""
    from spectrain.recipe.schema import Recipe

    r = Recipe()
    r.drafter.eagle3.init_from, r.drafter.eagle3.ttt_steps = str(FIX / "speculators_default"), 3
    r.drafter.eagle3.freeze_lm_head = True  # as speculators trains it
    head = registry.build_head("eagle3", r, target, None)  # what the loop builds: init_from goes through interop
    assert head.layout["norm_before_fc"] and head.config["init_from"].endswith("speculators_default")
    assert not head.lm_head.weight.requires_grad
    assert ttt_diff(head, target, FIX, recorded(FIX / "speculators_default")) <= TOL
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    out = target(ids, aux_layers=head.aux_layers, want_last_hidden=True, want_logits=False)
    feats = {"aux": torch.cat(out.aux_hidden, -1), "last_hidden": out.last_hidden}
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    before = head.input_norm.weight.detach().clone()
    losses = []
    for _ in range(4):
        loss, _ = head.train_loss(batch, feats, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] and not torch.equal(before, head.input_norm.weight)


def _speculators_python() -> str | None:
    py = os.environ.get("SPECTRAIN_SPECULATORS_PYTHON") or "/work/spec_venv/bin/python"
    if not Path(py).is_file():
        return None
    ok = subprocess.run([py, "-c", "import speculators"], capture_output=True).returncode == 0
    return py if ok else None


@pytest.mark.slow
def test_real_speculators_package_regenerates_conformance(tmp_path):
    py = _speculators_python()
    if py is None:
        pytest.skip("no Python with `speculators` (set SPECTRAIN_SPECULATORS_PYTHON)")
    root = tmp_path / "conformance"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([py, "scripts/make_conformance_fixtures.py", "--out", str(root)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    meta = json.loads((root / "meta.json").read_text())
    assert all(meta[f"spectrain_{v}"]["speculators_vs_spectrain_max_abs"] <= TOL for v in SPECTRAIN_VARIANTS)
    assert meta["spectrain_plain"]["sglang_via_speculators_converter_max_abs"] <= TOL
    target = fixture_target(root)
    for v in SPEC_VARIANTS:
        assert ttt_diff(load_drafter(root / f"speculators_{v}", target).model, target, root,
                        recorded(root / f"speculators_{v}")) <= TOL
    for v in SPECTRAIN_VARIANTS:
        head = Eagle3Head.from_pretrained(root / f"spectrain_{v}" / "head", target)
        assert ttt_diff(head, target, root, recorded(root / f"spectrain_{v}")) <= TOL
