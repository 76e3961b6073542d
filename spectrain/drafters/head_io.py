"""Saving and loading trained heads (EAGLE-3, Medusa): ``drafter_config.json`` + ``model.safetensors``,
with the checks every family needs before it trusts a directory on a given target."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from spectrain.io.integrity import seal_head
from spectrain.targets.fingerprint import same_target, target_fingerprint

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "model.safetensors"


def save_head(path, config: dict, state: dict[str, torch.Tensor]) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt", "kind": config["kind"]})
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    seal_head(path)  # every head spectrain writes carries SHA256SUMS (load_drafter requires it)


def check_state(state: dict[str, torch.Tensor], model: torch.nn.Module, where: str) -> None:
    """Before ``load_state_dict`` (which would cast an int32 weight or copy NaNs silently): every tensor has the
    shape the config implies, a float dtype where the module holds floats (the exact dtype for index buffers
    such as d2t / t2d), and only finite values. Missing / extra names are left to ``strict=True``."""
    for name, want in model.state_dict().items():
        t = state.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(want.shape):
            raise ValueError(f"{where}: tensor {name} has shape {list(t.shape)}, its config implies "
                             f"{list(want.shape)}: the weights were not written for this config; use another checkpoint")
        if t.is_floating_point() != want.is_floating_point() or (not want.is_floating_point() and t.dtype != want.dtype):
            expected = "a float dtype" if want.is_floating_point() else str(want.dtype)
            raise ValueError(f"{where}: tensor {name} has dtype {t.dtype}, expected {expected}: the file was not "
                             "written by spectrain for this head; use another checkpoint")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: tensor {name} holds NaN or Inf values (a diverged or damaged head): decoding "
                             "with it would be meaningless; use another checkpoint of the run or retrain")


def read_head_config(path, kind: str, target, what: str) -> dict:
    """The directory's config after checking kind and the target sizes it was trained for (``what``
    names the head in messages, e.g. "EAGLE-3 head")."""
    cfg_file = Path(path) / CONFIG_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: not a spectrain {kind} checkpoint directory")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("kind") != kind:
        raise ValueError(f"{cfg_file} is a {cfg.get('kind')!r} drafter, not {kind}")
    for key, have in (("target_hidden_size", target.hidden_size), ("target_vocab_size", target.vocab_size)):
        if cfg[key] != have:
            raise ValueError(f"{what} at {path} was trained for a target with {key}={cfg[key]}, "
                             f"this target ({target.name_or_path}) has {have}: wrong target?")
    warn_if_other_target(cfg.get("target_fingerprint"), target, f"{what} at {path}", cfg.get("target"))
    return cfg


def warn_if_other_target(recorded: str | None, target, what: str, recorded_name: str | None = None) -> None:
    """Same shapes do not mean same weights: a drafter trained on another build of the target loads fine
    and then accepts almost nothing (decoding stays lossless). The same target name with other weights (a
    rebuilt target) warns; another target name *and* other weights is refused."""
    if same_target(recorded, target) is not False:
        return
    name = str(target.name_or_path)
    if recorded_name and Path(str(recorded_name)).name != Path(name).name and str(recorded_name) != name:
        raise ValueError(f"{what} was trained for target {recorded_name!r} (fingerprint {recorded}), not for "
                         f"{name!r} ({target_fingerprint(target)}): give that target, or retrain the drafter on this one")
    warnings.warn(f"{what} was trained on a target with other weights (fingerprint {recorded}, this target "
                  f"{target_fingerprint(target)}): expect low acceptance; retrain it on this target", stacklevel=3)
