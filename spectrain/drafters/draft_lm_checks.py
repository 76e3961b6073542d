"""The draft-model family's training-side hooks, as its registry record names them (``train.*``): recipe
validation, the preflight of `spectrain check` / `train`, the student's own config and the training cost for the
plan, and the extra run input. Kept apart from draft_lm.py so that recipe validation does not import the model
code; its serving hook: draft_lm_serve.py."""

from __future__ import annotations

from transformers import AutoConfig, AutoTokenizer

from spectrain.drafters.costs import Shape, TrainingCost
from spectrain.recipe.load import check_draft_layers


def check_recipe(recipe) -> None:
    """A draft family recipe names its student: a model, or a layer subset of the target."""
    d = recipe.drafter.draft
    if not (d.model or d.init.startswith("layers:")):
        raise ValueError(f"drafter.draft.model is empty but init={d.init}: give a model id/path, "
                         "or use init=layers:... to take a layer subset of the target")


def preflight(recipe, cfg, tok) -> None:
    """Layer ids within the target; a separate draft model shares the target's tokenizer (token strings, not
    just sizes)."""
    d = recipe.drafter.draft
    check_draft_layers(d.init, cfg.num_hidden_layers)
    if d.model:
        dtok = AutoTokenizer.from_pretrained(d.model, trust_remote_code=recipe.target.trust_remote_code)
        if dtok.get_vocab() != tok.get_vocab():
            raise ValueError(f"draft model {d.model!r} has a different tokenizer vocabulary than the target "
                             f"({len(dtok)} vs {len(tok)} tokens): a draft must share the target's tokenizer")


def student_config(recipe):
    """The draft LM's own config (its size for the plan), or None for a layer subset of the target."""
    if not recipe.drafter.draft.model:
        return None
    return AutoConfig.from_pretrained(recipe.drafter.draft.model, trust_remote_code=recipe.target.trust_remote_code)


def run_inputs(recipe) -> list[tuple[str, str]]:
    """A separate draft model is an input of the run (its output_dir may not be or hold it)."""
    return [("draft model", recipe.drafter.draft.model)] if recipe.drafter.draft.model else []


def training_cost(recipe, t: Shape, student: Shape | None = None, seq: float = 0.0) -> TrainingCost:
    """Its own config (``student``, from ``student_config``), or a layer subset of the target (``train.cost``)."""
    d = recipe.drafter
    s = student or t
    layers = len(d.draft.init.split(":", 1)[1].split(",")) if d.draft.init.startswith("layers:") else s.layers
    p = layers * s.layer() + s.vocab * s.hidden * (1 if s.tied else 2)
    flops = 6 * (layers * s.layer() + s.vocab * s.hidden) + 12 * layers * s.hidden * seq
    return TrainingCost(p, p, flops, 4 * 4 * t.vocab, layers * (10 * s.hidden + 3 * s.inter) * 2, 0)
