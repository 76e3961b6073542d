"""Evaluation: ``harness`` (``spectrain eval``: drafters x prompt sets x settings against plain decoding),
``report`` (JSON, Markdown, PNG), ``stats`` (intervals), ``sweep`` and ``roofline`` (throughput against
batch size, measured and predicted), ``cost_curve`` (measured verification cost and the k it picks),
``compare`` (two reports, paired) and ``tracking`` (wandb / tensorboard)."""
