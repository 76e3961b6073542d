"""The frozen target: any Hugging Face causal LM (``model``), GGUF files dequantized once (``gguf``), and the
fingerprint that ties every drafter, checkpoint and feature cache to the exact target it was trained against
(``fingerprint``)."""

from spectrain.targets.model import FrozenTarget, load_target

__all__ = ["FrozenTarget", "load_target"]
