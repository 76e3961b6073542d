"""One record per drafter family: everything the pipeline needs to know about a family, in one place.

A family is one module (or folder) under spectrain/drafters/ plus one ``register(Family(...))`` line here;
recipes name it with ``drafter.kind`` and configure it in the ``drafter.<kind>`` section (``train.section``).
References are "module:attribute" strings, resolved on use, so importing spectrain (or training one family)
never imports every family's dependencies, and this module sits below every other layer. Every hook a
built-in family declares lives in its own drafters/ module or folder; only its exporters live in
spectrain/export/<format>.py (one function per format). No module outside a family's own compares
``drafter.kind`` with a family's name: what differs between families is a hook or a capability here
(tests/test_family_names.py enforces it).

The record is grouped by who reads it; hooks are "module:function" strings or callables, "" = the default named.

``Family.train`` (``TrainSide``; recipe validation, ``spectrain check``, the training loop, the plan):
- ``head``: the trained module class, a ``TrainableHead``;
- ``features``: the target features it reads, a ``FeatureSpec`` or ``(recipe, target) -> FeatureSpec``
  (the aux layer ids depend on the recipe and the target): read by training and the offline feature cache;
- ``build``: ``(recipe, target, token_counts) -> head`` (default: ``head.from_recipe``);
- ``section``: the dataclass of its recipe keys (``drafter.<kind>``), or None for a family the recipe
  schema already carries;
- ``validate``: ``(recipe)`` raising ValueError, run by recipe validation; ``preflight``: ``(recipe,
  target_config, tokenizer)`` raising ValueError before any compute (`spectrain check` and `train`);
- ``cost``: ``(recipe, target_shape, student_shape or None, tokens_per_row) -> costs.TrainingCost`` (the
  plan's FLOPs and sizes; default: none, and the plan says so); ``cost_config``: ``(recipe) -> HF config or
  None``, a model config of its own the cost reads (a draft LM's);
- ``run_inputs``: ``(recipe) -> [(what, path)]``, inputs a run reads beyond the target, data and cache.

``Family.decode`` (``DecodeSide``; load_drafter, ``spectrain eval``, its roofline):
- ``drafter``: ``(path, target) -> Drafter``, the decoding side loaded from a saved head;
- ``deploy_cost``: ``(target_config, head_config, dtype_bytes) -> costs.ModelCost`` (the head spectrain
  would build for a target; default: the loaded module's measured size).

``Family.serve`` (``ServeSide``; ``spectrain export`` and the serve commands it prints):
- ``exports``: export format name -> ("module:export_function", "module:validate_function");
- ``engines``: export format -> the serving engines that load it (spectrain/export/serving.py prints their
  commands); ``command``: ``(engine, target, model_dir, decode, head_config) -> ServeCommand``;
- ``k``: ``(head_config, k or None) -> k`` (the draft length served when --k is not given, and the family's
  limit; default: 5, ``spectrain eval``'s default, without a limit);
- ``engine_problems``: ``(engine, layout_flags, sliding, num_layers, aux) -> [why engine cannot serve it]``
  (default: every engine can); recipe validation refuses a ``deploy.engine`` it names.

``Family.capabilities``: what the shared machinery may do with it: "packing" (training.packing), "rollout"
(drafter.eagle3.rollout), "on_policy" (training.on_policy), "one_pass" (all k drafts from one forward).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Ref = str | Callable[..., Any]  # "module:attribute", resolved on use, or the object itself (tests)


@dataclass(frozen=True, eq=False)
class FeatureSpec:
    """Which target features are read: the inputs of target layers ``aux_layers`` (EAGLE-3), the last hidden
    state before the final norm (EAGLE-3, draft models: teacher logits), the normed final hidden state
    (Medusa). ONE description, returned by a head's ``feature_spec()``, a decoding drafter's ``features()`` and
    the record's ``features``; compares equal to its dict form (``as_dict``), which older heads return."""

    aux_layers: tuple[int, ...] = ()
    last_hidden: bool = False
    final_hidden: bool = False

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"aux_layers": list(self.aux_layers)} if self.aux_layers else {}
        if self.last_hidden:
            out["want_last_hidden"] = True
        if self.final_hidden:
            out["want_final_hidden"] = True
        return out

    @classmethod
    def of(cls, spec) -> FeatureSpec:
        """A FeatureSpec, or the dict form a head may return ({"aux_layers": [...], "want_last_hidden": True})."""
        if isinstance(spec, FeatureSpec):
            return spec
        spec = spec or {}
        return cls(tuple(spec.get("aux_layers") or ()), bool(spec.get("want_last_hidden")),
                   bool(spec.get("want_final_hidden")))

    def __eq__(self, other) -> bool:
        if isinstance(other, (FeatureSpec, dict)):
            o = FeatureSpec.of(other)
            return (tuple(self.aux_layers), self.last_hidden, self.final_hidden) == \
                (tuple(o.aux_layers), o.last_hidden, o.final_hidden)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((tuple(self.aux_layers), self.last_hidden, self.final_hidden))


@runtime_checkable
class TrainableHead(Protocol):
    """The training half of a family's contract: what spectrain/train/loop.py calls on ``Family.train.head``.

    Built by ``Family.train.build`` or ``head.from_recipe(recipe, target, token_counts)``; an ``nn.Module``."""

    def feature_spec(self) -> FeatureSpec | dict:
        """The target features ``train_loss`` reads (online: computed per batch; offline: from the cache)."""

    def train_loss(self, batch: dict, feats: dict, target) -> tuple[Any, dict[str, float]]:
        """(loss tensor, metrics: floats logged per step, e.g. acc_i / sim_tau from train/metrics.py)."""

    def save_pretrained(self, path, state_dict: dict | None = None) -> None:
        """``drafter_config.json`` + weights: what ``Family.decode.drafter`` and the exporters read back."""


@dataclass(frozen=True)
class TrainSide:
    """What recipe validation, `spectrain check`, the training loop and the plan read (module doc)."""

    head: Ref
    features: FeatureSpec | Ref
    build: Ref = ""
    section: type | Ref | None = None  # a dataclass, or "module:Class" (resolved on use, like the hooks)
    validate: Ref = ""
    preflight: Ref = ""
    cost: Ref = ""
    cost_config: Ref = ""
    run_inputs: Ref = ""


@dataclass(frozen=True)
class DecodeSide:
    """What load_drafter and `spectrain eval` read (module doc)."""

    drafter: Ref
    deploy_cost: Ref = ""


@dataclass(frozen=True)
class ServeSide:
    """What `spectrain export` and the serve commands read (module doc)."""

    exports: dict[str, tuple[Ref, Ref]] = field(default_factory=dict)
    engines: dict[str, tuple[str, ...]] = field(default_factory=dict)
    command: Ref = ""
    k: Ref = ""
    engine_problems: Ref = ""


@dataclass(frozen=True)
class Family:
    kind: str
    title: str  # in messages: "EAGLE-3 heads"
    train: TrainSide
    decode: DecodeSide
    serve: ServeSide = field(default_factory=ServeSide)
    capabilities: frozenset[str] = frozenset()


FAMILIES: dict[str, Family] = {}
TRAINING_FREE = ("ngram",)  # drafter kinds with nothing to train


def register(family: Family) -> Family:
    if family.kind in FAMILIES or family.kind in TRAINING_FREE:
        raise ValueError(f"drafter family {family.kind!r} is registered twice")
    FAMILIES[family.kind] = family
    return family


def resolve(ref):
    """ "module:attr.attr" -> the object (an object is returned as it is: tests register local classes)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def family(kind: str) -> Family:
    if kind not in FAMILIES:
        known = ", ".join(sorted(FAMILIES) + list(TRAINING_FREE))
        raise ValueError(f"drafter.kind={kind!r} is not a drafter family (known: {known}); a new family registers "
                         "itself with spectrain.registry.register(Family(...))")
    return FAMILIES[kind]


def hook(kind: str, name: str):
    """A family's hook ``name``, given as "side.hook" ("train.cost", "serve.command", ...), resolved; None when
    the family leaves it to the default (or ``kind`` is training-free)."""
    f = FAMILIES.get(kind)
    side, _, attr = name.partition(".")
    ref = getattr(getattr(f, side), attr) if f is not None else ""
    return resolve(ref) if ref else None


def supports(kind: str, capability: str) -> bool:
    f = FAMILIES.get(kind)
    return f is not None and capability in f.capabilities


def with_capability(capability: str) -> list[str]:
    """The kinds that declare ``capability`` (for messages: "implemented for drafter.kind=eagle3 only")."""
    return [k for k, f in FAMILIES.items() if capability in f.capabilities]


def feature_spec(kind: str, recipe, target) -> FeatureSpec:
    """The target features a recipe's family reads, for this target (the offline feature cache's contents)."""
    spec = family(kind).train.features
    return FeatureSpec.of(spec if isinstance(spec, (FeatureSpec, dict)) else resolve(spec)(recipe, target))


def build_head(kind: str, recipe, target, token_counts):
    """The trained module a recipe asks for, freshly built (or initialised from an existing head)."""
    t = family(kind).train
    return resolve(t.build)(recipe, target, token_counts) if t.build else resolve(t.head).from_recipe(
        recipe, target, token_counts)


def format_family(fmt: str) -> Family | None:
    """The family an export format belongs to (None: no such format)."""
    return next((f for f in FAMILIES.values() if fmt in f.serve.exports), None)


def format_engines(fmt: str) -> tuple[str, ...]:
    """The serving engines that load an export format (() for a format no engine serves)."""
    f = format_family(fmt)
    return tuple(f.serve.engines.get(fmt, ())) if f is not None else ()


# Hooks point into each family's own module or folder; exporters into spectrain/export/<format>.py.
_D, _E = "spectrain.drafters.", "spectrain.export."
_E3 = _D + "eagle3."
register(Family(
    "eagle3", "EAGLE-3 heads",
    train=TrainSide(head=_E3 + "model:Eagle3Head", features=_E3 + "layout:features_for", build=_E3 + "interop:build",
                    preflight=_E3 + "layout:preflight", cost=_E3 + "cost:training_cost"),
    decode=DecodeSide(drafter=_E3 + "decode:load", deploy_cost=_E3 + "cost:deploy_cost"),
    serve=ServeSide(
        exports={"vllm-eagle3": (_E + "eagle3:export_vllm_eagle3", _E + "eagle3:validate_vllm_eagle3"),
                 "sglang-eagle3": (_E + "eagle3:export_sglang_eagle3", _E + "eagle3:validate_sglang_eagle3"),
                 "llama.cpp-eagle3": (_E + "llama_cpp:export_llama_cpp_eagle3",
                                      _E + "llama_cpp:validate_llama_cpp_eagle3")},
        engines={"vllm-eagle3": ("vllm",), "sglang-eagle3": ("sglang", "trtllm")},
        command=_E3 + "serve:serve_command", k=_E3 + "serve:serve_k", engine_problems=_E3 + "serve:engine_problems"),
    capabilities=frozenset({"packing", "rollout"})))
register(Family(
    "medusa", "Medusa heads",
    train=TrainSide(head=_D + "medusa:MedusaHeads", features=FeatureSpec(final_hidden=True),
                    cost=_D + "medusa:training_cost"),
    decode=DecodeSide(drafter=_D + "medusa:load"),
    serve=ServeSide(
        exports={"vllm-medusa": (_E + "medusa:export_vllm_medusa", _E + "medusa:validate_vllm_medusa"),
                 "medusa": (_E + "medusa:export_medusa", _E + "medusa:validate_medusa")},
        engines={"vllm-medusa": ("vllm",), "medusa": ("trtllm",)},
        command=_D + "medusa:serve_command", k=_D + "medusa:serve_k", engine_problems=_D + "medusa:engine_problems"),
    capabilities=frozenset({"one_pass"})))
register(Family(
    "draft", "separate draft models",
    train=TrainSide(head=_D + "draft_lm:DraftStudent", features=FeatureSpec(last_hidden=True),
                    validate=_D + "draft_lm_checks:check_recipe", preflight=_D + "draft_lm_checks:preflight",
                    cost=_D + "draft_lm_checks:training_cost", cost_config=_D + "draft_lm_checks:student_config",
                    run_inputs=_D + "draft_lm_checks:run_inputs"),
    decode=DecodeSide(drafter=_D + "draft_lm:load"),
    serve=ServeSide(
        exports={"hf-draft": (_E + "hf_draft:export_hf_draft", _E + "hf_draft:validate_hf_draft"),
                 "llama.cpp-draft": (_E + "llama_cpp:export_llama_cpp_draft", _E + "llama_cpp:validate_llama_cpp_draft")},
        engines={"hf-draft": ("vllm", "sglang", "trtllm")}, command=_D + "draft_lm_serve:serve_command"),
    capabilities=frozenset({"on_policy"})))
register(Family(
    "dflash", "DFlash block drafters",
    train=TrainSide(head=_D + "dflash.model:DFlashHead", features=_D + "dflash.model:features_for",
                    section=_D + "dflash:DFlashConfig", validate=_D + "dflash:check_recipe"),
    decode=DecodeSide(drafter=_D + "dflash.decode:load"),
    capabilities=frozenset({"one_pass"})))
