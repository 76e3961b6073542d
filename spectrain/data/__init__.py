"""Training data: chat rows -> token ids with an assistant-only loss mask (``chat``), answers the target
wrote itself (``regenerate``, ``regen_server``), sequence packing (``packing``) and the offline cache of the
target's features (``features``)."""

from spectrain.data.dataset import build_dataset, token_frequencies

__all__ = ["build_dataset", "token_frequencies"]
