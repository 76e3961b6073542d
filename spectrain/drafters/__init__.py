"""Drafter families and ``load_drafter``.

``load_drafter(spec, target)`` resolves, in order:
- ``"ngram"`` / ``"ngram:max_n=3,min_n=1,k=8"`` -> prompt-lookup drafter (spectrain/drafters/ngram.py);
- a directory holding ``drafter_config.json`` with ``"kind": K`` -> ``REGISTRY[K](path, target)``
  (trained spectrain drafters, e.g. ``eagle3``, ``medusa``);
- a public EAGLE-3 head directory (speculators / vLLM format, or EAGLE / SGLang ``LlamaForCausalLMEagle3``)
  -> imported exactly or refused by name (spectrain/drafters/eagle3_import.py);
- anything else -> an HF causal LM directory or hub id used as a separate draft model
  (its tokenizer must match the target's; see draft_lm.check_vocab).

``REGISTRY`` is a plain dict {kind: loader(path, target) -> Drafter}. Families register lazily so
importing spectrain never imports every drafter's dependencies.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

from spectrain.drafters.base import DraftContext, Drafter, Proposal, TargetFeatures

__all__ = ["REGISTRY", "DraftContext", "Drafter", "Proposal", "TargetFeatures", "load_drafter"]


def _lazy(module: str, attr: str = "load") -> Callable:
    def loader(path, target):
        return getattr(importlib.import_module(module), attr)(path, target)

    loader.__qualname__ = f"{module}.{attr}"
    return loader


def _load_draft_lm(path, target):
    from spectrain.drafters.draft_lm import DraftLMDrafter

    return DraftLMDrafter.from_pretrained(str(path), target)


REGISTRY: dict[str, Callable] = {
    "eagle3": _lazy("spectrain.drafters.eagle3"),
    "medusa": _lazy("spectrain.drafters.medusa"),
    "draft": _load_draft_lm,
}


def load_drafter(spec, target) -> Drafter:
    """Build a drafter from a spec string / path (see module docstring), or pass a Drafter through."""
    if isinstance(spec, Drafter):
        return spec
    if not isinstance(spec, (str, Path)):
        raise ValueError(f"load_drafter(spec, target): spec must be 'ngram[:...]', a directory path or an HF id, got "
                         f"{type(spec).__name__}" + (" (the target? pass it as the second argument)"
                                                      if hasattr(spec, "tokenizer") else ""))
    spec = str(spec)
    needs_target = spec.split(":", 1)[0].strip() != "ngram"  # n-gram drafts from the tokens alone
    if needs_target and (not hasattr(target, "vocab_size") or not hasattr(target, "forward")):
        raise ValueError(f"load_drafter(spec, target): target must be a loaded target (spectrain.load_target), got "
                         f"{type(target).__name__}")
    if not spec.strip():
        raise ValueError("load_drafter: the drafter spec is empty (it would load whatever is in the current "
                         "directory): give 'ngram', a trained drafter directory (e.g. runs/NAME/best) or an HF id")
    if spec.split(":", 1)[0].strip() == "ngram":
        from spectrain.drafters.ngram import NgramDrafter

        return NgramDrafter.from_spec(spec)
    path = Path(spec)
    from spectrain.target import looks_local

    if not path.exists() and looks_local(spec):
        raise FileNotFoundError(f"drafter directory not found: {spec} (relative to {Path.cwd()}); give 'ngram', a "
                                "trained drafter directory (e.g. runs/NAME/best) or an HF draft model")
    if path.is_dir():  # SHA256SUMS written by every checkpoint save and export: refuse damaged weights
        from spectrain.integrity import verify

        verify(path, "drafter", fix="use another checkpoint (e.g. the run's last/ or a step-N/) or re-export it",
               warn_missing=False, required=(path / "drafter_config.json").is_file())  # an HF model dir has none
    cfg_file = path / "drafter_config.json"
    if cfg_file.is_file():
        try:
            kind = json.loads(cfg_file.read_text()).get("kind")
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
        if kind not in REGISTRY:
            raise ValueError(f"{cfg_file} has kind={kind!r}; known drafter kinds: {', '.join(sorted(REGISTRY))}")
        return _read_errors_named(REGISTRY[kind], path, target)
    from spectrain.drafters.eagle3_import import detect

    if detect(path):
        return _read_errors_named(_lazy("spectrain.drafters.eagle3_import"), path, target)
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
