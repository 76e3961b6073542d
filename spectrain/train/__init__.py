"""Training: ONE explicit loop for every drafter family (``loop``) and what it stands on: the distributed
set-up (``distributed``: accelerate, DDP / FSDP / DeepSpeed), where a batch's target features come from (``sources``), run directories and exact
resume (``checkpoint``), trackers (``tracking``), on-policy batches (``on_policy``), the launcher
(``launch``), and the checks and cost plan before any compute (``check``, ``plan``)."""

from spectrain.train.schedule import epoch_order

__all__ = ["epoch_order"]
