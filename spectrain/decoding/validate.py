"""Checks of the Python API's inputs, so a bad argument is a ValueError naming it and the fix, not an
IndexError or a NaN deep inside a forward pass (the CLI prints the same messages as one line).

    check_generate_args(target, drafter, input_ids, k=5, tree=None, temperature=0.0, top_p=1.0, top_k=0)
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

import torch

from spectrain.decoding.interface import Drafter

# Sampling temperatures spectrain decodes with: 0 (greedy) or this range. Outside it logits / T overflows
# float32 (tiny T: inf, then NaN after softmax) or flattens every distribution to uniform (huge T).
TEMPERATURE_RANGE = (1e-4, 1e4)
# Tree options the drafters read (DraftContext.tree): nodes expanded per level, depth, nodes in all.
TREE_KEYS = ("topk", "depth", "total_tokens")


def check_tree(tree) -> None:
    if tree is None:
        return
    if not isinstance(tree, dict):
        raise ValueError(f"tree must be a dict like {{'topk': 4, 'depth': 5, 'total_tokens': 32}} or None, got {tree!r}")
    unknown = sorted(set(map(str, tree)) - set(TREE_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], TREE_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown tree option {unknown[0]!r}{hint}; tree options are {', '.join(TREE_KEYS)}")
    for key, value in tree.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"tree option {key}={value!r} must be a positive integer")


def check_sampling(temperature, top_p, top_k) -> None:
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    lo, hi = TEMPERATURE_RANGE
    if temperature and not lo <= temperature <= hi:
        raise ValueError(f"temperature={temperature!r} is outside the supported range: use 0 (greedy) or a value in "
                         f"[{lo:g}, {hi:g}] (beyond it the warped distribution logits/T is not finite in float32 "
                         "or is flat)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")


def _flat_ids(input_ids) -> Iterable:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
        return input_ids.reshape(-1).tolist()
    if isinstance(input_ids, (list, tuple)):
        out = []
        for x in input_ids:
            out.extend(_flat_ids(x) if isinstance(x, (list, tuple, torch.Tensor)) else [x])
        return out
    raise ValueError(f"input_ids must be a tensor, a list of token ids or a list of such lists, got "
                     f"{type(input_ids).__name__}")


def check_token_ids(input_ids, vocab_size: int) -> None:
    for pos, t in enumerate(_flat_ids(input_ids)):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"input_ids[{pos}] = {t!r} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} (input_ids position {pos}) is outside the target's vocabulary of "
                             f"{vocab_size} ids (0..{vocab_size - 1}): tokenise with the target's tokenizer")


def positive_int(name: str, value, allow_none: bool = False) -> None:
    """``value`` is a positive int (a bool is not: ``max_new_tokens=True`` is a mistake, not 1)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_drafter_arg(drafter, target) -> None:
    """``drafter`` is None or a loaded spectrain Drafter for this target; name the usual mistakes."""
    if drafter is None or isinstance(drafter, Drafter):
        other = getattr(drafter, "target", None)
        if other is not None and other is not target:
            diff = [f"{k} {getattr(other, k, None)} vs {getattr(target, k, None)}"
                    for k in ("hidden_size", "vocab_size", "num_layers") if getattr(other, k, None) != getattr(target, k, None)]
            if diff:
                raise ValueError(f"the drafter was loaded for another target ({getattr(other, 'name_or_path', '?')}: "
                                 f"{', '.join(diff)}): load it for this one with load_drafter(path, target)")
        return
    if isinstance(drafter, (str, bytes)) or hasattr(drafter, "__fspath__"):
        raise ValueError(f"drafter={str(drafter)!r} is a path, not a drafter: load it first with "
                         "spectrain.load_drafter(path, target) (or pass 'ngram' there)")
    if drafter is target or (hasattr(drafter, "model") and hasattr(drafter, "tokenizer") and hasattr(drafter, "forward")):
        raise ValueError("the target was passed as the drafter: pass a drafter from spectrain.load_drafter(...) "
                         "(e.g. an EAGLE-3 head, 'ngram', or a small draft model), or drafter=None for plain decoding")
    raise ValueError(f"drafter must be a spectrain Drafter (from spectrain.load_drafter) or None, got "
                     f"{type(drafter).__name__}")


def check_generate_args(target, drafter, input_ids, k=5, tree=None, temperature=0.0, top_p=1.0, top_k=0) -> None:
    """Everything ``speculative_generate`` can check before it decodes (ValueError naming the argument).
    ``drafter=None`` is plain decoding: k is not used."""
    check_drafter_arg(drafter, target)
    if drafter is not None and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
        raise ValueError(f"k (draft length / tree depth) must be a positive integer, got {k!r}")
    check_tree(tree)
    check_sampling(temperature, top_p, top_k)
    check_token_ids(input_ids, int(target.vocab_size))
