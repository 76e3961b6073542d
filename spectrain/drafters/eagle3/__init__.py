"""EAGLE-3, as a one-way chain: ``model`` (the head and its training-time test) <- ``rollout`` (draft-path
rollouts) ; ``decode`` (single-row drafting, chains and EAGLE-2 trees) <- ``batch`` (all rows at once);
``interop`` maps public formats (speculators / vLLM, EAGLE / SGLang) onto the model."""

from spectrain.drafters.eagle3.model import Eagle3Drafter

__all__ = ["Eagle3Drafter"]
