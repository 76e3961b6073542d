"""spectrain: train speculative-decoding drafters from a frozen HF target, evaluate them losslessly."""

__version__ = "0.1.0"

from spectrain.target import FrozenTarget, load_target  # noqa: E402

__all__ = ["FrozenTarget", "load_target", "load_drafter", "speculative_generate", "__version__"]


def __getattr__(name):
    # Lazy so `import spectrain` stays cheap and the decoder/drafters can import the target.
    if name == "speculative_generate":
        from spectrain.decoding import speculative_generate

        return speculative_generate
    if name == "load_drafter":
        from spectrain.drafters import load_drafter

        return load_drafter
    raise AttributeError(name)
