"""Medusa heads -> vLLM (``vllm-medusa``) and original Medusa / TensorRT-LLM (``medusa``), with validators.

- vllm-medusa: ``config.json`` ``model_type: medusa``, ``architectures: [MedusaModel]``, ``hidden_size``,
  ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (ResBlocks per head), ``medusa_fc_bias: true``
  (vLLM silently drops biases otherwise); weights ``blocks.{i}.layers.{j}.weight/bias``,
  ``lm_heads.{i}.weight`` -- spectrain's own names.
- medusa: ``medusa_lm_head.safetensors`` with ``{i}.{j}.linear.weight/bias`` and ``{i}.{L}.weight``
  (the vocab projection after L ResBlocks); ``config.json`` with ``medusa_num_heads``,
  ``medusa_num_layers``, ``base_model_name_or_path``. The same tensors also go to ``medusa_lm_head.pt``
  (a ``torch.save``d dict of tensors, loadable with ``weights_only=True``): FasterDecoding's loader and older
  TensorRT-LLM converters read only that file. FasterDecoding's ``MedusaModel.from_pretrained`` builds 5 heads
  whatever the config says and loads with ``strict=False``, and builds a head's ResBlocks as ONE shared
  module: an export with another head count, or more than one ResBlock per head, loads there without an
  error and computes something else, so the export warns by name.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from spectrain.export.common import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    Spec,
    check_out,
    check_tensors,
    dtype_name,
    load_export,
    problems_of,
    read_head,
    staged,
    summary,
    target_info,
    write_json,
)

MEDUSA_FILE = "medusa_lm_head.safetensors"
MEDUSA_PT = "medusa_lm_head.pt"
FASTERDECODING_HEADS = 5  # FasterDecoding/Medusa from_pretrained sets medusa_num_heads = 5
VLLM_MEDUSA_NAMES = ("blocks.{i}.layers.{j}.weight", "blocks.{i}.layers.{j}.bias", "lm_heads.{i}.weight")
ORIG_MEDUSA_NAMES = ("{i}.{j}.linear.weight", "{i}.{j}.linear.bias", "{i}.{L}.weight")


def _medusa_spec(k: int, n: int, h: int, v: int, names: tuple[str, str, str], bias: bool = True) -> Spec:
    spec: Spec = {}
    for i in range(k):
        for j in range(n):
            spec[names[0].format(i=i, j=j, L=n)] = ((h, h), "float")
            if bias:
                spec[names[1].format(i=i, j=j, L=n)] = ((h,), "float")
        spec[names[2].format(i=i, L=n)] = ((v, h), "float")
    return spec


def _export_medusa(fmt: str, src_dir, out_dir, target_name: str | None, overwrite: bool, readme: str = "") -> dict:
    src, out = Path(src_dir), Path(out_dir)
    cfg, state = read_head(src, "medusa", fmt)
    check_out(src, out, overwrite)
    target = target_name or cfg.get("target") or ""
    _, warnings = target_info(target, cfg)
    k, n, h, v = cfg["num_heads"], cfg["num_resblocks"], cfg["target_hidden_size"], cfg["target_vocab_size"]
    names = ORIG_MEDUSA_NAMES if fmt == "medusa" else VLLM_MEDUSA_NAMES
    # spectrain's names are vLLM's: rename by walking both layouts in the same order
    rename = dict(zip(_medusa_spec(k, n, h, v, VLLM_MEDUSA_NAMES), _medusa_spec(k, n, h, v, names)))
    if set(rename) != set(state):
        raise ValueError(f"{src / WEIGHTS_NAME} does not match its {CONFIG_NAME} (num_heads={k}, num_resblocks={n}): "
                         f"differing tensors {sorted(set(rename) ^ set(state))[:4]}")
    tensors = {rename[name]: t.contiguous() for name, t in state.items()}
    if fmt == "medusa":
        config, weights = {"medusa_num_heads": k, "medusa_num_layers": n, "base_model_name_or_path": target}, MEDUSA_FILE
    else:
        config, weights = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": h,
                           "vocab_size": v, "num_heads": k, "num_hidden_layers": n, "medusa_fc_bias": True,
                           "truncated_vocab_size": v, "original_lm_head": False,
                           "base_model_name_or_path": target, "torch_dtype": dtype_name(state)}, WEIGHTS_NAME
    if fmt == "medusa":
        warnings += fasterdecoding_warnings(k, n)
    with staged(out, fmt, validate_medusa if fmt == "medusa" else validate_vllm_medusa, readme) as tmp:
        save_file(tensors, str(tmp / weights), metadata={"format": "pt"})
        if fmt == "medusa":
            torch.save(tensors, tmp / MEDUSA_PT)
        write_json(tmp / "config.json", config)
    return summary(fmt, src, out, target, warnings, {"tensors": len(tensors)})


def fasterdecoding_warnings(k: int, n: int) -> list[str]:
    """What FasterDecoding's loader (5 heads, strict=False, one ResBlock object per head) would do to this head."""
    out = []
    if k < FASTERDECODING_HEADS:
        out.append(f"FasterDecoding/Medusa builds {FASTERDECODING_HEADS} heads and loads with strict=False: heads "
                   f"{k}..{FASTERDECODING_HEADS - 1} of this {k}-head export would stay at their initialisation there "
                   "(TensorRT-LLM reads medusa_num_heads and is fine); train 5 heads for that loader")
    elif k > FASTERDECODING_HEADS:
        out.append(f"FasterDecoding/Medusa builds {FASTERDECODING_HEADS} heads: heads {FASTERDECODING_HEADS}.."
                   f"{k - 1} of this {k}-head export would be ignored there")
    if n > 1:
        out.append(f"FasterDecoding/Medusa shares ONE ResBlock object across a head's {n} layers, so the last "
                   f"layer's weights would overwrite the others there (a different function); only "
                   "num_resblocks: 1 round-trips through that loader (TensorRT-LLM keeps distinct layers)")
    return out


def export_vllm_medusa(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False,
                       readme: str = "") -> dict:
    return _export_medusa("vllm-medusa", src_dir, out_dir, target_name, overwrite, readme)


def export_medusa(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False,
                  readme: str = "") -> dict:
    return _export_medusa("medusa", src_dir, out_dir, target_name, overwrite, readme)


def validate_vllm_medusa(out_dir) -> list[str]:
    def check() -> list[str]:
        config, tensors = load_export(Path(out_dir), "config.json", WEIGHTS_NAME)
        problems = []
        if config.get("model_type") != "medusa" or config.get("architectures") != ["MedusaModel"]:
            problems.append("config needs model_type 'medusa' and architectures ['MedusaModel']")
        # vLLM renames every key holding "num" and "heads"/"layers" to num_heads/num_hidden_layers
        clash = [key for key in config if "num" in key and ("heads" in key or "layers" in key)
                 and key not in ("num_heads", "num_hidden_layers")]
        if clash:
            problems.append(f"config keys {clash} would overwrite num_heads/num_hidden_layers in vLLM")
        v = config["vocab_size"]
        if config.get("truncated_vocab_size", v) != v or config.get("original_lm_head", False):
            problems.append("truncated_vocab_size != vocab_size or original_lm_head: not what these weights hold")
        has_bias = any(name.endswith(".bias") for name in tensors)
        if has_bias and config.get("medusa_fc_bias") is not True:
            problems.append("weights have ResBlock biases but medusa_fc_bias is not true: vLLM would drop them")
        spec = _medusa_spec(config["num_heads"], config["num_hidden_layers"], config["hidden_size"], v,
                            VLLM_MEDUSA_NAMES, bias=bool(config.get("medusa_fc_bias")))
        return problems + check_tensors(tensors, spec, dtype=config.get("torch_dtype"))

    return problems_of(check)


def validate_medusa(out_dir) -> list[str]:
    def check() -> list[str]:
        config, tensors = load_export(Path(out_dir), "config.json", MEDUSA_FILE)
        k, n, base = config["medusa_num_heads"], config["medusa_num_layers"], config["base_model_name_or_path"]
        problems = [] if isinstance(base, str) and base else ["base_model_name_or_path must name the target model"]
        # this config holds no sizes: take them from the base model when local, else from the tensors
        # (a bias is hidden wide; the widest matrix dimension is the vocabulary)
        tc, _ = target_info(base, {})
        mats = [t.shape for t in tensors.values() if t.dim() == 2]
        bias = [t.shape[0] for name, t in tensors.items() if name.endswith(".linear.bias") and t.dim() == 1]
        if tc:
            h, v = tc["hidden_size"], tc["vocab_size"]
        elif mats:
            h, v = bias[0] if bias else min(min(m) for m in mats), max(max(m) for m in mats)
        else:
            return problems + [f"{MEDUSA_FILE} holds no weight matrices"]
        problems += check_tensors(tensors, _medusa_spec(k, n, h, v, ORIG_MEDUSA_NAMES))
        return problems + _pt_problems(Path(out_dir), tensors)

    return problems_of(check)


def _pt_problems(out: Path, tensors: dict) -> list[str]:
    """medusa_lm_head.pt must hold exactly the safetensors' tensors (what FasterDecoding / older TRT-LLM read)."""
    if not (out / MEDUSA_PT).is_file():
        return [f"missing {MEDUSA_PT} (FasterDecoding's loader and older TensorRT-LLM read only that file)"]
    try:
        pt = torch.load(out / MEDUSA_PT, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the finding
        return [f"{MEDUSA_PT} is not a loadable tensors-only state dict: {e}"]
    if not isinstance(pt, dict) or set(pt) != set(tensors):
        return [f"{MEDUSA_PT} holds other tensor names than {MEDUSA_FILE}"]
    bad = [name for name, t in tensors.items() if not torch.equal(pt[name], t)]
    return [f"{MEDUSA_PT} differs from {MEDUSA_FILE} in {bad[:3]}"] if bad else []
