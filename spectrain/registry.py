"""One record per drafter family: everything the pipeline needs to know about a family, in one place.

A family is one module (or folder) under spectrain/drafters/ plus one ``register(Family(...))`` line here;
recipes name it with ``drafter.kind`` and configure it in the ``drafter.<kind>`` section (``section``).
References are "module:attribute" strings, resolved on use, so importing spectrain (or training one family)
never imports every family's dependencies, and this module sits below every other layer.

The record holds:
- ``head``: the trained module class (``feature_spec()``, ``train_loss(batch, feats, target)``,
  ``save_pretrained(dir)``; the training loop's side);
- ``build``: ``(recipe, target, token_counts) -> head`` (default: ``head.from_recipe``);
- ``drafter``: ``(path, target) -> Drafter``, the decoding side loaded from a saved head;
- ``section``: the dataclass of its recipe keys (``drafter.<kind>``), or None for a family the recipe
  schema already carries;
- ``features``: the ONE description of the target features it reads (``FeatureSpec``), used by training,
  the offline feature cache and decoding alike;
- ``exports``: export format name -> ("module:export_function", "module:validate_function");
- ``preflight``: "module:function(recipe, target_config)" raising ValueError before any compute, or "".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FeatureSpec:
    """Which target features a family reads: the aux layers' inputs (EAGLE-3), the last hidden state before
    the final norm (EAGLE-3, draft models: teacher logits), the normed final hidden state (Medusa)."""

    aux_layers: bool = False
    last_hidden: bool = False
    final_hidden: bool = False


@dataclass(frozen=True)
class Family:
    kind: str
    title: str  # in messages: "EAGLE-3 heads"
    head: str
    drafter: str
    features: FeatureSpec
    build: str = ""
    section: type | None = None
    exports: dict[str, tuple[str, str]] = field(default_factory=dict)
    preflight: str = ""


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


def build_head(kind: str, recipe, target, token_counts):
    """The trained module a recipe asks for, freshly built (or initialised from an existing head)."""
    f = family(kind)
    return resolve(f.build)(recipe, target, token_counts) if f.build else resolve(f.head).from_recipe(
        recipe, target, token_counts)


def format_family(fmt: str) -> Family | None:
    """The family an export format belongs to (None: no such format)."""
    return next((f for f in FAMILIES.values() if fmt in f.exports), None)


_E = "spectrain.export."
register(Family("eagle3", "EAGLE-3 heads", head="spectrain.drafters.eagle3.model:Eagle3Drafter",
                build="spectrain.drafters.eagle3.interop:build", drafter="spectrain.drafters.eagle3.decode:load",
                features=FeatureSpec(aux_layers=True, last_hidden=True),
                exports={"vllm-eagle3": (_E + "eagle3:export_vllm_eagle3", _E + "eagle3:validate_vllm_eagle3"),
                         "sglang-eagle3": (_E + "eagle3:export_sglang_eagle3", _E + "eagle3:validate_sglang_eagle3")}))
register(Family("medusa", "Medusa heads", head="spectrain.drafters.medusa:MedusaHeads",
                drafter="spectrain.drafters.medusa:load", features=FeatureSpec(final_hidden=True),
                exports={"vllm-medusa": (_E + "medusa:export_vllm_medusa", _E + "medusa:validate_vllm_medusa"),
                         "medusa": (_E + "medusa:export_medusa", _E + "medusa:validate_medusa")}))
register(Family("draft", "separate draft models", head="spectrain.drafters.draft_lm:DraftStudent",
                drafter="spectrain.drafters.draft_lm:load", features=FeatureSpec(last_hidden=True),
                exports={"hf-draft": (_E + "hf_draft:export_hf_draft", _E + "hf_draft:validate_hf_draft")}))
