"""Recipes: flat YAML files mapped onto typed dataclasses, with strict validation.

    recipe = load_recipe("recipes/tiny/eagle3.yaml", ["training.lr=1e-4", "drafter.kind=medusa"])
    recipe.training.grad_accum(world_size=2)

- Every key must exist in the schema; a misspelt key is an error that names the closest valid key.
- ``a.b.c=value`` overrides are converted to the field's annotated type (int, float, bool, str,
  list[int], list[str], Literal choices) and then validated exactly like values from the file.
- The global batch size is what a recipe states; gradient accumulation is derived from it.
- A recipe is a file path or the name of a shipped recipe (``tiny/eagle3``; spectrain/resources.py).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

DrafterKind = Literal["eagle3", "medusa", "draft", "ngram"]
LossName = Literal["fkl", "rkl", "jsd", "tvd", "accept", "lk", "soft_ce", "hard_ce"]
DEVICE_MAPS = ("", "auto", "balanced", "balanced_low_0", "sequential")
Tracker = Literal["none", "jsonl", "wandb", "tensorboard"]


@dataclass
class TargetConfig:
    name_or_path: str = "assets/reference-target"  # an HF dir or hub id, or a .gguf file (dequantized once, cached)
    gguf_file: str = ""  # with a dir or hub repo in name_or_path: the GGUF file in it
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"] = "auto"
    trust_remote_code: bool = False
    device_map: str = ""  # "" = one device; auto | balanced | sequential = spread over the visible GPUs (HF device_map)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/train/chat_mix_messages.jsonl"])
    format: Literal["auto", "messages", "sharegpt"] = "auto"
    max_length: int = 512
    heldout_fraction: float = 0.05
    max_rows: int = 0  # 0 = all rows
    heldout_rows: int = 64  # cap on the held-out split size
    cache_dir: str = ".cache/spectrain"
    # extra arguments of the target's chat template when `spectrain regenerate` renders prompts (in-process)
    # or asks a server (sent as the request's chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Eagle3RolloutConfig:
    """drafter.eagle3.rollout (spectrain/drafters/eagle3_rollout.py): on that fraction of the optimizer steps,
    TTT feeds `anchors` anchors per row the head's own drafts and trains them against the target's
    distribution on those drafted prefixes (one extra target pass per micro-batch)."""
    fraction: float = 0.0  # share of optimizer steps that roll out (0 = off: plain TTT)
    anchors: int = 16  # rolled-out anchors per row (the extra target pass grows with anchors x (ttt_steps - 1))
    temperature: float = 0.0  # 0 = greedy drafts (the T=0 decoding path); > 0 = drafts sampled from the head


@dataclass
class Eagle3Config:
    aux_layers: list[int] = field(default_factory=list)  # [] = derive from the target
    num_layers: int = 1
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    intermediate_size: int = 0  # 0 = the target's
    num_attention_heads: int = 0  # 0 = the target's
    # layer layout (speculators' names; all false = the original EAGLE-3 layer, see drafters/eagle3.py)
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states before fc
    fc_norm: bool = False  # one RMSNorm per aux state before fc (exclusive with norm_before_fc)
    norm_before_residual: bool = False  # layer 0's residual = hidden_norm(hidden)
    norm_output: bool = False  # feed the final norm's output to the next step
    sliding_window: int = 0  # > 0: every draft layer attends to anchors within this window (speculators' default 2048)
    init_from: str = ""  # a head dir to fine-tune (spectrain, speculators/vLLM or EAGLE/SGLang format)
    # target: lm_head = the target's lm_head rows of the draft vocabulary (target_with_norm: also the
    # final norm's weight from the target's final norm); random: normal(0, 0.02)
    lm_head_init: Literal["random", "target", "target_with_norm"] = "random"
    freeze_lm_head: bool = False
    # which TTT positions carry loss: "predicted" = the predicted token is an assistant token;
    # "input" = the step's input token is (the speculators rule)
    loss_positions: Literal["predicted", "input"] = "predicted"
    # positions whose target argmax lies outside the draft vocab: "mask" = no loss there, "keep" = trained
    out_of_vocab: Literal["mask", "keep"] = "mask"
    rollout: Eagle3RolloutConfig = field(default_factory=Eagle3RolloutConfig)


@dataclass
class MedusaConfig:
    num_heads: int = 4
    num_resblocks: int = 1


@dataclass
class DraftLMConfig:
    model: str = ""
    init: str = "pretrained"  # pretrained | layers:0,1 | config


@dataclass
class NgramConfig:
    max_n: int = 3
    min_n: int = 1


@dataclass
class DrafterConfig:
    kind: DrafterKind = "eagle3"
    loss: LossName = "fkl"
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    draft: DraftLMConfig = field(default_factory=DraftLMConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)


@dataclass
class OnPolicyConfig:
    """training.on_policy (drafter.kind=draft; spectrain/on_policy.py): on that fraction of the optimizer steps
    the batches are the student's own continuations of the training prompts, scored by the target."""
    fraction: float = 0.0  # share of optimizer steps that roll out (0 = off: fixed data only; 1 = every step)
    temperature: float = 1.0  # the student's sampling temperature (0 = greedy)
    max_new_tokens: int = 32  # tokens sampled per prompt (fewer when an eos comes first)
    refresh_every: int = 1  # 1 = sample from the current student; N = from a snapshot refreshed every N steps


@dataclass
class TrainingConfig:
    global_batch_size: int = 8
    micro_batch_size: int = 4
    lr: float = 3.0e-4
    weight_decay: float = 0.0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 20
    epochs: int = 1
    max_steps: int = 0  # 0 = run `epochs`
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    grad_clip: float = 1.0  # 0 = no clipping
    checkpoint_every: int = 100
    eval_every: int = 50
    keep_checkpoints: int = 2
    resume_from: str = ""
    features: Literal["online", "offline"] = "online"
    feature_cache: str = ""
    max_nan_steps: int = 10
    num_workers: int = 0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    num_threads: int = 0  # torch CPU threads; 0 = $SPECTRAIN_NUM_THREADS, else the cores this process may use
    packing: bool = False  # pack each micro-batch's rows into one row with document masking (EAGLE-3)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)

    def grad_accum(self, world_size: int = 1) -> int:
        """Micro-steps per optimizer step so that one step sees exactly `global_batch_size` rows."""
        per_step = self.micro_batch_size * world_size
        if world_size < 1 or self.global_batch_size % per_step:
            raise ValueError(
                f"training.global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size ({self.micro_batch_size}) x world size ({world_size}) = {per_step}; "
                f"pick a global batch size that is a multiple of {per_step} or change micro_batch_size"
            )
        return self.global_batch_size // per_step


@dataclass
class TrackingConfig:
    report_to: list[Tracker] = field(default_factory=lambda: ["jsonl"])
    project: str = "spectrain"
    run_name: str = ""  # "" = the output directory's name (also the wandb group; see spectrain/tracking.py)


@dataclass
class LaunchConfig:
    """How `spectrain train` starts itself: N processes through `accelerate launch` (0 = every visible GPU,
    one process without CUDA; 1 = one process; --nproc wins) and an accelerate config (a shipped name such
    as zero2, or a path)."""
    nproc: int = 0
    accelerate_config: str = ""


@dataclass
class DeployConfig:
    """The serving engine the head is for ("" = not said): recipe validation refuses, before any training, a
    drafter that engine cannot compute (spectrain/serving.py engine_problems)."""
    engine: Literal["", "vllm", "sglang", "trtllm"] = ""


@dataclass
class FeaturesConfig:
    """How `spectrain prepare-features` stores the offline cache (spectrain/features.py)."""
    dtype: Literal["bf16", "fp32", "fp8"] = "bf16"  # fp8: aux states in float8 e4m3 + one scale per row
    shard_mb: float = 1024.0  # target size of one shard file
    batch_size: int = 8  # rows per target forward


@dataclass
class Recipe:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    output_dir: str = "runs/tiny-eagle3"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """Block-style sections with inline lists: the same shape as the recipe files."""
        return yaml.dump(self.to_dict(), Dumper=_RecipeDumper, sort_keys=False, default_flow_style=False)


class _RecipeDumper(yaml.SafeDumper):
    pass


_RecipeDumper.add_representer(
    list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


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
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            raise _unknown_key(str(key), list(hints), where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}" if where else key)
    return cls(**kwargs)


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


def _check_on_policy(op: OnPolicyConfig, dr: DrafterConfig, t: TrainingConfig) -> None:
    _require(0.0 <= op.fraction <= 1.0, f"training.on_policy.fraction={op.fraction} must be in [0, 1] (0 = off)")
    _require(op.temperature >= 0, f"training.on_policy.temperature={op.temperature} must be >= 0 (0 = greedy)")
    _require(op.max_new_tokens >= 1, f"training.on_policy.max_new_tokens={op.max_new_tokens} must be >= 1")
    _require(op.refresh_every >= 1, f"training.on_policy.refresh_every={op.refresh_every} must be >= 1 "
             "(1 = sample from the current student)")
    if op.fraction > 0:
        _require(dr.kind == "draft", f"training.on_policy is for drafter.kind=draft (got {dr.kind}); EAGLE-3 heads "
                 "roll out with drafter.eagle3.rollout, or set training.on_policy.fraction=0")
        _require(dr.loss != "hard_ce", "training.on_policy with drafter.loss=hard_ce would train the student on its "
                 "own samples; use a divergence from the target (fkl, rkl, jsd, tvd, accept, lk)")


def validate(r: Recipe) -> Recipe:
    """Numeric and cross-field sanity. Raises ValueError naming the key and the fix."""
    d, t, dr = r.data, r.training, r.drafter
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
    _require(not t.packing or dr.kind == "eagle3", f"training.packing=true is implemented for drafter.kind=eagle3 "
             f"only (got {dr.kind}); set training.packing=false")
    _check_on_policy(t.on_policy, dr, t)
    e = dr.eagle3
    ro = e.rollout
    _require(0.0 <= ro.fraction <= 1.0, f"drafter.eagle3.rollout.fraction={ro.fraction} must be in [0, 1] (0 = off)")
    _require(ro.anchors >= 1, f"drafter.eagle3.rollout.anchors={ro.anchors} must be >= 1")
    _require(ro.temperature >= 0, f"drafter.eagle3.rollout.temperature={ro.temperature} must be >= 0 (0 = greedy)")
    if ro.fraction > 0:
        _require(dr.kind == "eagle3", f"drafter.eagle3.rollout is for drafter.kind=eagle3 (got {dr.kind}); "
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
    if dr.kind == "draft":
        _require(bool(dr.draft.model) or dr.draft.init.startswith("layers:"),
                 f"drafter.draft.model is empty but init={dr.draft.init}: give a model id/path, "
                 "or use init=layers:... to take a layer subset of the target")
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
    from spectrain.serving import ENGINE_NAMES, engine_problems

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
        if key not in hints:
            raise _unknown_key(key, list(hints), where)
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
    from spectrain.resources import anchor_shipped_paths, resolve_recipe

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


def check_main(recipe_path: str, overrides: list[str], plan: str = "", mfu: float | None = None) -> int:
    """`spectrain check` (spectrain/check.py: everything `train` would refuse that the recipe, the target's
    config and tokenizer and a data sample can show)."""
    from spectrain.check import main

    return main(recipe_path, overrides, plan, mfu)
