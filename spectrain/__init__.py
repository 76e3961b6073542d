"""spectrain: train speculative-decoding drafters from a frozen HF target, evaluate them losslessly."""

from spectrain.io.resources import VERSION as __version__

__all__ = ["FrozenTarget", "load_target", "load_drafter", "speculative_generate", "plain_generate", "__version__"]

# Lazy: `import spectrain` (and so `spectrain --help`) must not pay for torch and transformers.
_LAZY = {"FrozenTarget": "spectrain.targets.model", "load_target": "spectrain.targets.model",
         "speculative_generate": "spectrain.decoding.loop",
         "plain_generate": "spectrain.decoding.loop", "load_drafter": "spectrain.drafters"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spectrain' has no attribute {name!r}")
