"""Recipes: flat YAML files mapped onto typed dataclasses, with strict validation.

    recipe = load_recipe("recipes/tiny/eagle3.yaml", ["training.lr=1e-4", "drafter.kind=medusa"])
    recipe.training.grad_accum(world_size=2)

- Every key must exist in the schema; a misspelt key is an error that names the closest valid key.
- ``a.b.c=value`` overrides are converted to the field's annotated type (int, float, bool, str,
  list[int], list[str], Literal choices) and then validated exactly like values from the file.
- The global batch size is what a recipe states; gradient accumulation is derived from it.
- A recipe is a file path or the name of a shipped recipe (``tiny/eagle3``; spectrain/io/resources.py).
  Relative paths in a user's recipe (target, data files, cache and output dirs) are resolved against
  the current working directory, not the recipe file; in a shipped recipe the input paths (target,
  data files, draft model) point into the installed package, outputs stay in the current directory.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from spectrain import registry
from spectrain.io.resources import anchor_shipped_paths, resolve_recipe
from spectrain.recipe.deploy import ENGINE_NAMES, engine_problems
from spectrain.recipe.schema import (
    DEVICE_MAPS,
    DrafterConfig,
    OnPolicyConfig,
    Recipe,
    TrainingConfig,
)

# ---- building dataclasses from plain data ------------------------------------------------------------


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown_key(key: str, valid: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    section = f"section '{where}'" if where else "the top level"
    return ValueError(f"unknown key '{key}' in {section}: {hint}valid keys: {', '.join(valid)}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check / convert one value against its annotation; `where` is the dotted key for messages."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if value is None:
            return []
        if not isinstance(value, list):
            value = [value]  # a single scalar stands for a one-element list (e.g. report_to=none)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where}: expected a mapping of names to values (e.g. {{enable_thinking: false}}), "
                             f"got {value!r}")
        bad = [k for k, v in value.items() if not isinstance(v, (str, int, float, bool, type(None), list))]
        if bad:
            raise ValueError(f"{where}.{bad[0]}: give a plain value (string, number, true/false or a list)")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping (section with keys), got {value!r}")
        return _build(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML 1.1 reads `1e-4` (no dot) as a string, so numeric strings are accepted too.
        try:
            if not isinstance(value, bool) and isinstance(value, (int, float, str)):
                number = float(value)
                if not math.isfinite(number):
                    raise ValueError(f"{where}: {value!r} is not a finite number; give a finite value")
                return number
        except (ValueError, OverflowError) as e:
            if "finite" in str(e):
                raise
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r} (quote it in YAML)")
        return value
    raise TypeError(f"{where}: unsupported annotation {tp!r}")  # a schema bug, not a user error


def _build(cls, raw: dict, where: str = ""):
    hints = _hints(cls)
    kwargs, sections = {}, {}
    for key, value in raw.items():
        if cls is DrafterConfig and key not in hints and _family_section(key):
            sections[key] = _build(_family_section(key), value or {}, f"drafter.{key}")
            continue
        if key not in hints or key == "sections":
            raise _unknown_key(str(key), [h for h in hints if h != "sections"], where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}" if where else key)
    if sections:
        kwargs["sections"] = sections
    return cls(**kwargs)


def _family_section(key: str) -> type | None:
    """The recipe section a family registered outside the schema adds under drafter.<key> (None: not one)."""
    fam = registry.FAMILIES.get(key)
    return registry.resolve(fam.train.section) if fam is not None and fam.train.section else None


# ---- validation ------------------------------------------------------------------------------------------

_INIT_RE = re.compile(r"^(pretrained|config|layers:\d+(,\d+)*)$")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_draft_layers(init: str, num_layers: int | None = None) -> list[int]:
    """The layer ids of drafter.draft.init=layers:i,j,... : increasing, and (given the target's depth) in
    range. One check for the recipe, `spectrain check` and the training's layer_subset."""
    if not init.startswith("layers:"):
        return []
    layers = [int(x) for x in init.split(":", 1)[1].split(",")]
    _require(all(b > a for a, b in zip(layers, layers[1:])),
             f"drafter.draft.init={init}: list the layer ids in increasing order without repeats (e.g. layers:0,7)")
    bad = [i for i in layers if num_layers is not None and not 0 <= i < num_layers]
    _require(not bad, f"drafter.draft.init={init}: layer ids {bad} are out of range; the target has {num_layers} "
                      f"decoder layers (ids 0..{(num_layers or 1) - 1})")
    return layers


def _kinds_with(capability: str) -> str:
    return "|".join(registry.with_capability(capability)) or "(no family)"


def _check_on_policy(op: OnPolicyConfig, dr: DrafterConfig, t: TrainingConfig) -> None:
    _require(0.0 <= op.fraction <= 1.0, f"training.on_policy.fraction={op.fraction} must be in [0, 1] (0 = off)")
    _require(op.temperature >= 0, f"training.on_policy.temperature={op.temperature} must be >= 0 (0 = greedy)")
    _require(op.max_new_tokens >= 1, f"training.on_policy.max_new_tokens={op.max_new_tokens} must be >= 1")
    _require(op.refresh_every >= 1, f"training.on_policy.refresh_every={op.refresh_every} must be >= 1 "
             "(1 = sample from the current student)")
    if op.fraction > 0:
        _require(registry.supports(dr.kind, "on_policy"), f"training.on_policy is for drafter.kind="
                 f"{_kinds_with('on_policy')} (got {dr.kind}); EAGLE-3 heads "
                 "roll out with drafter.eagle3.rollout, or set training.on_policy.fraction=0")
        _require(dr.loss != "hard_ce", "training.on_policy with drafter.loss=hard_ce would train the student on its "
                 "own samples; use a divergence from the target (fkl, rkl, jsd, tvd, accept, lk)")


def validate(r: Recipe) -> Recipe:
    """Numeric and cross-field sanity. Raises ValueError naming the key and the fix."""
    d, t, dr = r.data, r.training, r.drafter
    kinds = [*registry.FAMILIES, *registry.TRAINING_FREE]
    _require(dr.kind in kinds, f"drafter.kind: {dr.kind!r} is not one of {', '.join(kinds)}")
    section = _family_section(dr.kind)
    if section is not None:
        dr.sections.setdefault(dr.kind, section())  # a family's section with all defaults when absent
    _require(len(r.target.name_or_path) > 0, "target.name_or_path is empty: give an HF hub id or a local model dir")
    _require(r.target.device_map in DEVICE_MAPS, f"target.device_map={r.target.device_map!r}: use one of "
             f"{', '.join(repr(m) for m in DEVICE_MAPS)} ('' = the whole target on one device)")
    _require(len(d.train_files) > 0, "data.train_files is empty: list at least one file, dir or dataset name")
    _require(d.max_length >= 8, f"data.max_length={d.max_length} is too small (need >= 8)")
    _require(0.0 <= d.heldout_fraction < 1.0, f"data.heldout_fraction={d.heldout_fraction} must be in [0, 1)")
    _require(d.max_rows >= 0, f"data.max_rows={d.max_rows} must be >= 0 (0 = all rows)")
    _require(d.heldout_rows >= 0, f"data.heldout_rows={d.heldout_rows} must be >= 0")
    _require(t.global_batch_size > 0 and t.micro_batch_size > 0,
             "training.global_batch_size and training.micro_batch_size must be positive")
    t.grad_accum(1)  # divisibility on one process; the launcher re-checks with the real world size
    _require(0 < t.lr <= 1, f"training.lr={t.lr} must be in (0, 1] (AdamW; typical 1e-4 .. 3e-3)")
    _require(t.weight_decay >= 0, f"training.weight_decay={t.weight_decay} must be >= 0")
    _require(t.warmup_steps >= 0, f"training.warmup_steps={t.warmup_steps} must be >= 0")
    _require(t.epochs >= 1 or t.max_steps > 0, "training: need epochs >= 1 or max_steps > 0")
    _require(t.max_steps >= 0, f"training.max_steps={t.max_steps} must be >= 0 (0 = run the epochs)")
    _require(t.grad_clip >= 0, f"training.grad_clip={t.grad_clip} must be >= 0 (0 = off)")
    for k in ("checkpoint_every", "eval_every", "max_nan_steps", "num_workers"):
        _require(getattr(t, k) >= 0, f"training.{k}={getattr(t, k)} must be >= 0")
    _require(len(t.adam_betas) == 2 and all(0.0 <= b < 1.0 for b in t.adam_betas),
             f"training.adam_betas={t.adam_betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    _require(t.num_threads >= 0, f"training.num_threads={t.num_threads} must be >= 0 (0 = from the CPU affinity)")
    _require(t.keep_checkpoints >= 1, f"training.keep_checkpoints={t.keep_checkpoints} must be >= 1")
    _require(not t.packing or registry.supports(dr.kind, "packing"), "training.packing=true is implemented for "
             f"drafter.kind={_kinds_with('packing')} "
             f"only (got {dr.kind}); set training.packing=false")
    _check_on_policy(t.on_policy, dr, t)
    e = dr.eagle3
    ro = e.rollout
    _require(0.0 <= ro.fraction <= 1.0, f"drafter.eagle3.rollout.fraction={ro.fraction} must be in [0, 1] (0 = off)")
    _require(ro.anchors >= 1, f"drafter.eagle3.rollout.anchors={ro.anchors} must be >= 1")
    _require(ro.temperature >= 0, f"drafter.eagle3.rollout.temperature={ro.temperature} must be >= 0 (0 = greedy)")
    if ro.fraction > 0:
        _require(registry.supports(dr.kind, "rollout"), f"drafter.eagle3.rollout is for drafter.kind="
                 f"{_kinds_with('rollout')} (got {dr.kind}); "
                 "set drafter.eagle3.rollout.fraction=0")
        _require(e.ttt_steps >= 2, "drafter.eagle3.rollout needs drafter.eagle3.ttt_steps >= 2 (step 0 has no "
                 "draft of its own to feed back)")
        _require(not t.packing, "drafter.eagle3.rollout does not support training.packing=true yet; set "
                 "training.packing=false")
        _require(dr.loss != "hard_ce", "drafter.eagle3.rollout with drafter.loss=hard_ce has no data label on the "
                 "head's own prefixes; use a divergence from the target (fkl, accept, lk ...)")
    _require(all(i >= 0 for i in e.aux_layers) and len(set(e.aux_layers)) == len(e.aux_layers),
             f"drafter.eagle3.aux_layers={e.aux_layers} must be distinct layer ids >= 0 ([] = derive)")
    _require(not e.aux_layers or (len(e.aux_layers) == 3 and e.aux_layers == sorted(e.aux_layers)),
             f"drafter.eagle3.aux_layers={e.aux_layers}: give 3 layer ids in ascending order (or [] to derive "
             "them): vLLM, SGLang and TensorRT-LLM build fc for exactly 3 captured layers and feed them in "
             "ascending order, so they refuse (or silently mis-serve) any other head")
    _require(e.sliding_window >= 0, f"drafter.eagle3.sliding_window={e.sliding_window} must be >= 0 (0 = full attention)")
    _require(not (e.norm_before_fc and e.fc_norm),
             "drafter.eagle3.norm_before_fc and fc_norm are exclusive (one norm over the concatenated aux states, or "
             "one per state): set at most one")
    _require(e.num_layers >= 1, "drafter.eagle3.num_layers must be >= 1")
    _require(e.draft_vocab_size >= 1, "drafter.eagle3.draft_vocab_size must be >= 1")
    _require(e.ttt_steps >= 1, "drafter.eagle3.ttt_steps must be >= 1")
    _require(0.0 < e.ttt_decay <= 1.0, f"drafter.eagle3.ttt_decay={e.ttt_decay} must be in (0, 1]")
    _require(e.intermediate_size >= 0 and e.num_attention_heads >= 0,
             "drafter.eagle3.intermediate_size / num_attention_heads must be >= 0 (0 = the target's)")
    _require(dr.medusa.num_heads >= 1, "drafter.medusa.num_heads must be >= 1")
    _require(dr.medusa.num_resblocks >= 0, "drafter.medusa.num_resblocks must be >= 0")
    _require(bool(_INIT_RE.match(dr.draft.init)),
             f"drafter.draft.init={dr.draft.init!r}: use pretrained, config, or layers:<i>,<j>,... (e.g. layers:0,1)")
    check_draft_layers(dr.draft.init)
    family_checks = registry.hook(dr.kind, "train.validate")
    if family_checks is not None:  # the family's own recipe checks (spectrain/registry.py)
        family_checks(r)
    _require(1 <= dr.ngram.min_n <= dr.ngram.max_n,
             f"drafter.ngram: need 1 <= min_n ({dr.ngram.min_n}) <= max_n ({dr.ngram.max_n})")
    rt = r.tracking.report_to
    _require(len(set(rt)) == len(rt), f"tracking.report_to={rt} has duplicates")
    _require("none" not in rt or len(rt) == 1, "tracking.report_to: 'none' cannot be combined with other trackers")
    _require(len(r.output_dir) > 0, "output_dir is empty")
    _require(r.features.shard_mb > 0 and r.features.batch_size >= 1,
             f"features.shard_mb={r.features.shard_mb} / features.batch_size={r.features.batch_size} must be > 0")
    _require(r.launch.nproc >= 0, f"launch.nproc={r.launch.nproc} must be >= 0 (0 or 1 = one process)")
    _check_deploy(r)
    return r


def _check_deploy(r: Recipe) -> None:
    e, kind = r.drafter.eagle3, r.drafter.kind
    flags = {k: getattr(e, k) for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")}
    bad = engine_problems(r.deploy.engine, kind, flags, e.sliding_window > 0, e.num_layers, e.aux_layers)
    _require(not bad, f"deploy.engine={r.deploy.engine}: {ENGINE_NAMES.get(r.deploy.engine)} cannot serve this "
             f"{kind} drafter: {'; '.join(bad)}. Change the drafter.{kind} keys named, or deploy.engine")


# ---- overrides and loading -------------------------------------------------------------------------------


def _field_type(path: list[str]) -> Any:
    """The annotation at a dotted path, with unknown-key errors like the file's."""
    cls: Any = Recipe
    where = ""
    for i, key in enumerate(path):
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"override '{'.'.join(path)}': '{where}' is a value, not a section")
        hints = _hints(cls)
        if cls is DrafterConfig and key not in hints and _family_section(key):
            cls, where = _family_section(key), ".".join(path[: i + 1])
            continue
        if key not in hints or key == "sections":
            raise _unknown_key(key, [h for h in hints if h != "sections"], where)
        cls = hints[key]
        where = ".".join(path[: i + 1])
    if dataclasses.is_dataclass(cls):
        raise ValueError(f"override '{where}' names a whole section; override its keys (e.g. {where}.<key>=...)")
    return cls


def _parse_override_value(text: str, tp: Any) -> Any:
    is_str = tp is str or (typing.get_origin(tp) is Literal and all(isinstance(c, str) for c in typing.get_args(tp)))
    if is_str:
        return text  # keep strings verbatim: `target.name_or_path=007` must stay "007"
    if typing.get_origin(tp) is list and not text.strip().startswith("["):
        # `a=x,y` as a convenience for `a=[x,y]`; `a=` is the empty list
        parts = [p.strip() for p in text.split(",") if p.strip()]
        (item_tp,) = typing.get_args(tp)
        return [_parse_override_value(p, item_tp) for p in parts]
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"cannot parse override value {text!r}: {e}") from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set `a.b.c=value` entries into a raw (not yet validated) recipe dict."""
    for ov in overrides:
        key, sep, text = ov.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"bad override {ov!r}: expected key=value, e.g. training.lr=1e-4")
        path = key.split(".")
        tp = _field_type(path)
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ValueError(f"override {ov!r}: '{part}' in the recipe is not a section")
            node = child
        node[path[-1]] = _parse_override_value(text, tp)
    return raw


def recipe_from_dict(raw: dict | None, overrides: list[str] | None = None) -> Recipe:
    """Build + validate a Recipe from a plain dict (e.g. a run dir's saved recipe)."""
    if raw is not None and not isinstance(raw, dict):
        raise ValueError("a recipe must be a YAML mapping of sections")
    raw = copy.deepcopy(raw or {})  # overrides must not write into the caller's dict
    raw = apply_overrides(raw, list(overrides or []))
    return validate(_build(Recipe, raw))


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a YAML recipe (a file, or a shipped recipe's name such as tiny/eagle3), apply typed overrides,
    validate. Errors name the file and the key."""
    if Path(path).expanduser().is_dir():
        raise IsADirectoryError(f"recipe {path} is a directory: give a YAML recipe file (e.g. {path}/eagle3.yaml)")
    path, shipped = resolve_recipe(str(path))
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text (UTF-8 YAML) file") from None
    if raw is None:
        raise ValueError(f"{path} is empty: a recipe needs at least the sections it changes (see recipes/tiny/*.yaml; "
                         "an explicit `{}` means all defaults)")
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe must be a mapping of sections (target:, data:, drafter: ...)")
    if shipped and raw:
        raw = anchor_shipped_paths(raw)  # before the overrides: a user's override is relative to the cwd
    try:
        return recipe_from_dict(raw, overrides)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
