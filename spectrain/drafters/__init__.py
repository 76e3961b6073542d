"""Drafter families and ``load_drafter``.

``load_drafter(spec, target)`` resolves, in order:
- ``"ngram"`` / ``"ngram:max_n=3,min_n=1,k=8"`` -> prompt-lookup drafter (spectrain/drafters/ngram.py);
- a directory holding ``drafter_config.json`` with ``"kind": K`` -> the ``drafter`` loader of family K
  (spectrain/registry.py)
  (trained spectrain drafters, e.g. ``eagle3``, ``medusa``);
- a public EAGLE-3 head directory (speculators / vLLM format, or EAGLE / SGLang ``LlamaForCausalLMEagle3``)
  -> imported exactly or refused by name (spectrain/drafters/eagle3/interop.py);
- anything else -> an HF causal LM directory or hub id used as a separate draft model
  (its tokenizer must match the target's; see draft_lm.check_vocab).

Families are listed, one record each, in spectrain/registry.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from spectrain import registry
from spectrain.decoding.interface import DraftContext, Drafter, Proposal, TargetFeatures
from spectrain.drafters.eagle3.interop import detect
from spectrain.drafters.ngram import NgramDrafter
from spectrain.io.integrity import verify
from spectrain.targets.model import looks_local

__all__ = ["DraftContext", "Drafter", "Proposal", "TargetFeatures", "load_drafter"]


def _load_draft_lm(path, target):
    return registry.resolve(registry.family("draft").decode.drafter)(str(path), target)


def load_drafter(spec, target) -> Drafter:
    """Build a drafter from a spec string / path (see module docstring), or pass a Drafter through."""
    if isinstance(spec, Drafter):
        return spec
    if not isinstance(spec, (str, Path)):
        raise ValueError(f"load_drafter(spec, target): spec must be 'ngram[:...]', a directory path or an HF id, got "
                         f"{type(spec).__name__}" + (" (the target? pass it as the second argument)"
                                                      if hasattr(spec, "tokenizer") else ""))
    spec = str(spec)
    needs_target = not NgramDrafter.is_spec(spec)  # n-gram drafts from the tokens alone
    if needs_target and (not hasattr(target, "vocab_size") or not hasattr(target, "forward")):
        raise ValueError(f"load_drafter(spec, target): target must be a loaded target (spectrain.load_target), got "
                         f"{type(target).__name__}")
    if not spec.strip():
        raise ValueError("load_drafter: the drafter spec is empty (it would load whatever is in the current "
                         "directory): give 'ngram', a trained drafter directory (e.g. runs/NAME/best) or an HF id")
    if NgramDrafter.is_spec(spec):
        return NgramDrafter.from_spec(spec)
    path = Path(spec)
    if not path.exists() and looks_local(spec):
        raise FileNotFoundError(f"drafter directory not found: {spec} (relative to {Path.cwd()}); give 'ngram', a "
                                "trained drafter directory (e.g. runs/NAME/best) or an HF draft model")
    if path.is_dir():  # SHA256SUMS written by every checkpoint save and export: refuse damaged weights
        verify(path, "drafter", fix="use another checkpoint (e.g. the run's last/ or a step-N/) or re-export it",
               warn_missing=False, required=(path / "drafter_config.json").is_file())  # an HF model dir has none
    cfg_file = path / "drafter_config.json"
    if cfg_file.is_file():
        try:
            kind = json.loads(cfg_file.read_text()).get("kind")
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
        if kind not in registry.FAMILIES:
            raise ValueError(f"{cfg_file} has kind={kind!r}; known drafter kinds: {', '.join(sorted(registry.FAMILIES))}")
        return _read_errors_named(registry.resolve(registry.FAMILIES[kind].decode.drafter), path, target)
    if detect(path):
        return _read_errors_named(registry.resolve("spectrain.drafters.eagle3.interop:load"), path, target)
    if path.exists() and not (path / "config.json").is_file():
        raise ValueError(f"{spec!r} holds neither drafter_config.json (a spectrain drafter) nor config.json "
                         "(an HF draft model); give 'ngram', a trained drafter directory or an HF model")
    try:
        return _load_draft_lm(spec, target)
    except OSError as e:
        raise ValueError(f"cannot load drafter {spec!r}: not 'ngram[:...]', not a directory with "
                         f"drafter_config.json, and not loadable as an HF causal LM ({e})") from e


def _read_errors_named(loader: Callable, path: Path, target) -> Drafter:
    """A truncated or damaged weights file, or a tensor renamed, is an error naming the directory."""
    try:
        return loader(path, target)
    except Exception as e:
        if type(e).__name__ != "SafetensorError" and not (isinstance(e, RuntimeError) and "state_dict" in str(e)):
            raise
        why = " ".join(str(e).split())[:200]
        raise ValueError(f"cannot load the drafter weights in {path}: {type(e).__name__}: {why}; the file is "
                         "damaged or was not written for this drafter: use another checkpoint") from e
