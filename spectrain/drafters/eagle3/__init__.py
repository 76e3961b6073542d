"""EAGLE-3, as a one-way chain: ``model`` (the head and its training-time test) <- ``rollout`` (draft-path
rollouts) ; ``decode`` (single-row drafting, chains and EAGLE-2 trees) <- ``batch`` (all rows at once);
``interop`` maps public formats (speculators / vLLM, EAGLE / SGLang) onto the model."""

from spectrain.drafters.eagle3.model import Eagle3Head

Eagle3Drafter = Eagle3Head  # the name before the rename (docs/layout.md); ../shared/anchors imports it

__all__ = ["Eagle3Head"]
