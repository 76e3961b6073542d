#!/usr/bin/env python3
"""Conformance fixtures for EAGLE-3 interop, made by the REAL `speculators` package (0.9.0).

Run from the repository root with a Python that has `speculators` installed (it pins torch / transformers
versions of its own, so use a separate virtual environment; the anchor README in ../shared/anchors/
speculators_cpu shows how to build one). spectrain is not installed there: PYTHONPATH=. makes the checkout's
importable (only the spectrain_<variant> fixtures need it; ``--record`` does not):

    PYTHONPATH=. /work/spec_venv/bin/python scripts/make_conformance_fixtures.py --out tests/fixtures/conformance

It writes (all small, fp32, < 2 MB in total):
- ``target/``: a tiny random Llama (8 layers, hidden 32, vocab 128), saved once so both environments use
  the same weights; ``inputs.safetensors``: fixed token ids and the target's aux features (inputs of
  layers 2, 4, 5) that every forward below is fed.
- ``speculators_<variant>/``: (a) a speculator built by speculators itself for that target, the way its
  trainer builds one (``create_transformer_layer_config`` + ``Eagle3DraftModel.from_training_args``),
  trained a few optimizer steps with speculators' own forward + KL loss, saved with ``save_pretrained``;
  ``logits.safetensors`` = the per-TTT-step draft logits of speculators' forward (``reloaded`` from the
  saved directory with ``SpeculatorModel.from_pretrained``, the loader users call).
  Variants: ``default`` = speculators' trainer defaults for eagle3 (norm_before_fc, norm_before_residual,
  norm_output true, sliding-window layer with window 2048), reduced draft vocab; ``window8`` = the same
  with a window of 8 tokens, shorter than the inputs; ``plain`` = all layout flags off, full vocabulary (no d2t/t2d),
  saved without ``embed_tokens.weight``; ``fcnorm`` = per-aux fc_norm.
- ``spectrain_<variant>/``: (b) a spectrain head (``head/``), its ``spectrain export --format vllm-eagle3``
  (``export/``), and ``logits.safetensors`` = speculators' forward on that export, loaded with
  ``SpeculatorModel.from_pretrained`` and no override of any weight.
- ``meta.json``: versions, and the check each step ran here (max |diff| between the in-memory and reloaded
  speculators models, between speculators and spectrain on the export).

tests/test_conformance.py replays these files in the project environment (fast) and, when
$SPECTRAIN_SPECULATORS_PYTHON (or /work/spec_venv/bin/python) exists, reruns this script (slow).

``--record CKPT --target T --out DIR`` instead records speculators' forward of an existing speculators
checkpoint (e.g. one its trainer wrote) on fixed random rows of target T: DIR/row<i>.safetensors with
input_ids, aux features and per-step logits. scripts/check_speculators_import.py compares spectrain's
import against them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AUX = [2, 4, 5]
TTT = 3
SEQ = 24
DEFAULT_FLAGS = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
SPEC_VARIANTS = {  # flags, draft vocab (0 = full), keep embed_tokens in the saved file, sliding window
    "default": (DEFAULT_FLAGS, 96, True, 2048),
    "bf16": (DEFAULT_FLAGS, 96, True, 2048),  # saved in bf16, as speculators' trainer saves
    "window8": (DEFAULT_FLAGS, 96, True, 8),  # a window shorter than the inputs: windowed attention for real
    "plain": ({"norm_before_residual": False, "norm_before_fc": False, "norm_output": False}, 0, False, 2048),
    "fcnorm": ({"norm_before_residual": False, "norm_before_fc": False, "norm_output": True, "fc_norm": True}, 96, True,
               2048),
}
SPECTRAIN_VARIANTS = {"plain": {}, "speculators-defaults": {"norm_before_fc": True, "norm_before_residual": True,
                                                            "norm_output": True}}


def build_target(out: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions, as tests/conftest.py does
    model.save_pretrained(out, safe_serialization=True)
    return model


def inputs(model, out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states  # hidden_states[L] = input of layer L (L < N)
    aux = torch.cat([hs[a] for a in AUX], -1).float()
    save_file({"input_ids": ids, "aux": aux.contiguous()}, str(out / "inputs.safetensors"))
    return ids, aux


def spec_logits(model, ids: torch.Tensor, aux: torch.Tensor, steps: int = TTT) -> torch.Tensor:
    """speculators' own TTT forward on its training layout (eagle3.data.shift_batch): per step [n-1, D]."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach().float()))
    n = ids.shape[1]
    with torch.no_grad():
        model(hidden_states=aux[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros(1, n - 1, dtype=torch.long),
              position_ids=torch.arange(1, n)[None], ttt_steps=steps)
    hook.remove()
    return torch.stack([c[0] for c in captured])


def load_speculator(path: Path):
    """SpeculatorModel.from_pretrained, the loader users call; only the attention backend is chosen (sdpa: the
    default simple_flex_attention block mask does not fit these short CPU sequences). No weight is touched."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    cfg = SpeculatorModelConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001
    return SpeculatorModel.from_pretrained(str(path), config=cfg).float().eval()


def make_speculator(target_dir: Path, flags: dict, draft_vocab: int, counts: torch.Tensor, window: int):
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer = create_transformer_layer_config(verifier_name_or_path=str(target_dir), num_layers=1, draft_arch="llama",
                                            hidden_act="silu", sliding_window=window, full_attention_indices=[],
                                            mrope_full_head_hack=False)
    d2t = t2d = None
    if draft_vocab:
        ids = torch.sort(torch.sort(counts, descending=True, stable=True).indices[:draft_vocab]).values
        d2t, t2d = ids - torch.arange(draft_vocab), torch.zeros(128, dtype=torch.bool)
        t2d[ids] = True
    model = Eagle3DraftModel.from_training_args(
        layer, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab or 128, ttt_steps=TTT, target_layer_ids=AUX,
        verifier_name_or_path=str(target_dir), draft_attn_impl="sdpa", **{"fc_norm": False, **flags})
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # distinct norm weights, so a misplaced norm changes the numbers
        for name, p in model.named_parameters():
            if p.requires_grad and (name.endswith("norm.weight") or "fc_norm." in name):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def train_a_few_steps(model, target, steps: int = 4) -> list[float]:
    """speculators' own forward + KL loss (what its Trainer calls), AdamW, on random rows of the target."""
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config("kl_div", "eager")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    g, losses = torch.Generator().manual_seed(3), []
    model.train()
    for _ in range(steps):
        ids = torch.randint(3, 128, (1, 64), generator=g)
        captured = {}  # the final norm's INPUT: speculators rebuilds teacher logits from the pre-norm state
        hook = target.model.norm.register_forward_hook(lambda m, i, o, c=captured: c.setdefault("pre", i[0].detach()))
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        hook.remove()
        aux, n = torch.cat([hs[a] for a in AUX], -1), ids.shape[1]
        _, loss, _ = model(hidden_states=aux[:, :-1], input_ids=ids[:, 1:],
                           document_ids=torch.zeros(1, n - 1, dtype=torch.long), position_ids=torch.arange(1, n)[None],
                           verifier_last_hidden_states=captured["pre"][:, 1:], loss_mask=torch.ones(1, n - 1),
                           ttt_steps=TTT, ttt_step_loss_decay=1.0, loss_config=loss_config)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def speculators_variant(out: Path, name: str, target_dir: Path, target, ids, aux, meta: dict) -> None:
    flags, draft_vocab, keep_emb, window = SPEC_VARIANTS[name]
    counts = torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(4))
    model = make_speculator(target_dir, flags, draft_vocab, counts, window)
    losses = train_a_few_steps(model, target)
    d = out / f"speculators_{name}"
    if name == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(d)
    for f in d.glob("*.py"):  # save_pretrained copies speculators' config source; loading does not need it
        f.unlink()
    if not keep_emb:  # the other shape public heads come in: no stored embedding
        state = load_file(str(d / "model.safetensors"))
        state.pop("embed_tokens.weight")
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    live = spec_logits(model.float().eval(), ids, aux)
    reloaded = load_speculator(d)
    if not keep_emb:  # documented speculators behaviour under transformers 5: the NaN sentinel is lost
        reloaded.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    logits = spec_logits(reloaded, ids, aux)
    save_file({"logits": logits.contiguous()}, str(d / "logits.safetensors"))
    meta[f"speculators_{name}"] = {"flags": flags, "draft_vocab_size": draft_vocab or 128, "train_losses": losses,
                                   "sliding_window": window,
                                   "stored_embedding": keep_emb,
                                   "live_vs_reloaded_max_abs": float((live - logits).abs().max())}


def spectrain_variant(out: Path, name: str, target_dir: Path, ids, aux, meta: dict) -> None:
    from transformers import LlamaForCausalLM

    from spectrain.drafters.eagle3.model import Eagle3Head
    from spectrain.export import export
    from spectrain.recipe.schema import Recipe
    from spectrain.targets.model import FrozenTarget

    target = FrozenTarget(LlamaForCausalLM.from_pretrained(str(target_dir)).eval(), tokenizer=None,
                          name_or_path=str(target_dir))
    r = Recipe()
    r.drafter.eagle3.aux_layers, r.drafter.eagle3.draft_vocab_size, r.drafter.eagle3.ttt_steps = list(AUX), 96, TTT
    for k, v in SPECTRAIN_VARIANTS[name].items():
        setattr(r.drafter.eagle3, k, v)
    torch.manual_seed(5)
    head = Eagle3Head.from_recipe(r, target, torch.randint(0, 1000, (128,)))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for pname, p in head.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    d = out / f"spectrain_{name}"
    head.save_pretrained(d / "head")
    export(d / "head", "vllm-eagle3", d / "export", target=str(target_dir))  # relative: the fixture travels
    spec = load_speculator(d / "export")  # no override of any weight
    logits = spec_logits(spec, ids, aux)
    save_file({"logits": logits.contiguous()}, str(d / "logits.safetensors"))
    with torch.no_grad():
        mine = head.eval().ttt_logits(ids, torch.ones_like(ids), aux, target, TTT)
    n = ids.shape[1]
    diff = max(float((mine[i][0, : n - 1 - i] - logits[i, : n - 1 - i]).abs().max()) for i in range(TTT))
    meta[f"spectrain_{name}"] = {"flags": SPECTRAIN_VARIANTS[name], "speculators_vs_spectrain_max_abs": diff,
                                 "attn_implementation": spec.config.transformer_layer_config._attn_implementation}
    if not SPECTRAIN_VARIANTS[name]:  # the EAGLE/SGLang layout has no extra norms: export it too
        meta[f"spectrain_{name}"]["sglang_via_speculators_converter_max_abs"] = sglang_through_converter(
            d, target_dir, target, head, ids, aux)


def sglang_through_converter(d: Path, target_dir: Path, target, head, ids, aux) -> float:
    """spectrain's sglang-eagle3 export read by speculators' own reader of that format (Eagle3Converter, which
    `SpeculatorModel.from_pretrained` runs on non-speculators checkpoints). The converter takes no aux ids from
    eagle_config (it leaves them to the verifier default, equal here), and the export holds no embedding, which
    speculators then leaves uninitialised (documented): the target's is loaded into the converted model."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    from spectrain.export import export

    export(d / "head", "sglang-eagle3", d / "sglang", target=str(target_dir))
    tmp = d / "converted"
    Eagle3Converter().convert(d / "sglang", tmp, base_model=str(target_dir), validate=False)
    spec = load_speculator(tmp)
    spec.embed_tokens.weight.data.copy_(target.embed_tokens.weight)
    logits = spec_logits(spec, ids, aux)
    shutil.rmtree(tmp)
    with torch.no_grad():
        mine = head.eval().ttt_logits(ids, torch.ones_like(ids), aux, target, TTT)
    n = ids.shape[1]
    return max(float((mine[i][0, : n - 1 - i] - logits[i, : n - 1 - i]).abs().max()) for i in range(TTT))


def record(ckpt: Path, target_dir: Path, out: Path, lengths=(17, 64, 128)) -> None:
    """speculators' forward of an existing checkpoint on fixed random rows of the target, per TTT step."""
    from transformers import AutoModelForCausalLM

    model = load_speculator(ckpt)
    aux_ids = list(model.config.eagle_aux_hidden_state_layer_ids)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(lengths):
        ids = torch.randint(0, target.config.vocab_size, (1, n), generator=g)
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[a] for a in aux_ids], -1).float()
        steps = model.config.speculators_config.proposal_methods[0].speculative_tokens
        save_file({"input_ids": ids, "aux": aux.contiguous(), "logits": spec_logits(model, ids, aux, steps).contiguous()},
                  str(out / f"row{i}.safetensors"))
    print(f"recorded {len(lengths)} rows of speculators' forward of {ckpt} into {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures/conformance")
    ap.add_argument("--record", default=None, help="a speculators checkpoint dir to record (needs --target)")
    ap.add_argument("--target", default=None)
    a = ap.parse_args()
    if a.record:
        return record(Path(a.record), Path(a.target), Path(a.out))
    import importlib.metadata

    import transformers

    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    target = build_target(out / "target")
    ids, aux = inputs(target, out)
    meta = {"speculators": importlib.metadata.version("speculators"), "torch": torch.__version__,
            "transformers": transformers.__version__, "aux_layers": AUX, "ttt_steps": TTT, "seq_len": SEQ}
    for name in SPEC_VARIANTS:
        speculators_variant(out, name, out / "target", target, ids, aux, meta)
    for name in SPECTRAIN_VARIANTS:
        spectrain_variant(out, name, out / "target", ids, aux, meta)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
