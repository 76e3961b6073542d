"""Separate draft model -> a standard HF model directory (``hf-draft``), with its validator.

The run's files are copied byte for byte (config, safetensors, tokenizer, chat template); run bookkeeping
(best.json, optimizer / accelerate state) is left behind. ``drafter_config.json`` is kept: serving
engines ignore it, and it carries the target fingerprint spectrain uses to warn when the draft is paired
with another target. Validation loads the directory with transformers itself.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from spectrain.export.common import (
    CONFIG_NAME,
    check_out,
    read_config,
    rope_keys,
    staged,
    summary,
    write_json,
)
from spectrain.io.integrity import link_inside

HF_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
            "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
            "chat_template.*", CONFIG_NAME)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def export_hf_draft(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False,
                    readme: str = "") -> dict:
    src, out = Path(src_dir), Path(out_dir)
    cfg = read_config(src, "draft", "hf-draft")
    check_out(src, out, overwrite)
    target = target_name or cfg.get("target") or ""
    files = [f for f in sorted(src.iterdir()) if f.is_file() and any(f.match(p) for p in HF_FILES)]
    skipped = [f.name for f in sorted(src.iterdir()) if f not in files]  # run state: optimizer, best.json ...
    warnings = []
    if not any(f.name in TOKENIZER_FILES for f in files):
        # a student saved without a tokenizer: the target's is the right one (drafts share it)
        tdir = Path(target) if target else None
        extra = [f for f in sorted(tdir.iterdir()) if f.is_file() and f.match("tokenizer*")] if tdir and tdir.is_dir() else []
        files += extra
        warnings.append(f"no tokenizer in {src}; " + (f"copied the target's from {tdir}" if extra else "none found"))
    elif target and Path(target).is_dir():
        _check_same_vocab(src, Path(target))
    with staged(out, "hf-draft", validate_hf_draft, readme) as tmp:
        for f in files:
            _copy_inside(f, f.parent, tmp / f.name)  # f.parent: the checkpoint, or the target
        _both_rope_styles(tmp / "config.json")
    return summary("hf-draft", src, out, target, warnings, {"skipped": skipped})


def _copy_inside(f: Path, root: Path, dst: Path) -> None:
    """Copy ``f``'s bytes (never its mode or a link): a symlink is followed only when it stays inside ``root``,
    so a link to a private file elsewhere is refused instead of published in the export."""
    if f.is_symlink() and not link_inside(f, root):
        raise ValueError(f"{f} is a symbolic link to {os.readlink(f)}, outside {root}: export copies only files "
                         "inside the checkpoint; replace the link with the file itself")
    shutil.copyfile(f, dst, follow_symlinks=True)


def _both_rope_styles(file: Path) -> None:
    """Write rope_theta/rope_scaling next to rope_parameters (and vice versa), same RoPE, in every text config."""
    config = json.loads(file.read_text())
    for sub in (config, config.get("text_config")):
        if not isinstance(sub, dict):
            continue
        rope = sub.get("rope_parameters")
        if not rope and "rope_theta" in sub:  # a transformers-4 config: build the 5.x form from it
            rope = {**(sub.get("rope_scaling") or {}), "rope_theta": sub["rope_theta"]}
            rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        if isinstance(rope, dict) and "rope_theta" in rope:  # flat (not per-layer-type) RoPE only
            sub.update(rope_keys(rope))
    write_json(file, config)


def _check_same_vocab(draft: Path, target: Path) -> None:
    """Drafts must share the target's vocabulary token for token (same sizes are not enough)."""
    try:
        mine, theirs = (AutoTokenizer.from_pretrained(str(d)).get_vocab() for d in (draft, target))
    except (OSError, ValueError):
        return  # the target has no loadable tokenizer: nothing to compare against
    diff = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
    if diff:
        raise ValueError(f"the draft's tokenizer differs from target {target}'s in {len(diff)} (token, id) "
                         f"entries, e.g. {diff[:3]}: a draft must use the target's vocabulary")


def validate_hf_draft(out_dir) -> list[str]:
    """Load with transformers itself: missing / unexpected / mis-shaped weights, tokenizer, vocab rows."""
    out = Path(out_dir)
    if not (out / "config.json").is_file() or not list(out.glob("*.safetensors")):
        return [f"{out} needs config.json and *.safetensors weights (a standard HF model directory)"]
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the problems are reported below, not as a log table
    hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True,
                                                           ignore_mismatched_sizes=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is the finding
        return [f"transformers cannot load {out}: {e}"]
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    problems = [f"missing tensor {k}" for k in sorted(info["missing_keys"])]
    problems += [f"unexpected tensor {k}" for k in sorted(info["unexpected_keys"])]
    problems += [f"mis-shaped tensor {k}" for k in sorted(map(str, info["mismatched_keys"]))]
    problems += [f"{n} holds NaN or Inf values" for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    rows = model.get_output_embeddings().weight.shape[0]
    try:
        n_tok = len(AutoTokenizer.from_pretrained(str(out)))
        if n_tok > rows:
            problems.append(f"tokenizer has {n_tok} tokens but the lm_head only {rows} rows")
    except (OSError, ValueError) as e:
        problems.append(f"no loadable tokenizer ({e}); re-export with --target set to the target's directory")
    if (out / CONFIG_NAME).is_file():
        tv = json.loads((out / CONFIG_NAME).read_text()).get("target_vocab_size", 0)
        if tv > rows:
            problems.append(f"lm_head has {rows} rows, fewer than the target's {tv}-token vocabulary")
    return problems
