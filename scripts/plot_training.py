"""Plot a training run's curves from its metrics.jsonl against the optimizer step: the training loss,
the held-out per-TTT-step top-1 accuracy acc_i, and simulated tau (a greedy proxy, +1 bonus included)
on held-out evals and, smoothed, on the training batches.

    python scripts/plot_training.py runs/tiny-eagle3            # -> runs/tiny-eagle3/train_curve.png
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

WINDOW = 20


def _smooth(ys: list[float], w: int = WINDOW) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - w] if i >= w else 0.0)
        out.append(total / min(i + 1, w))
    return out


def main(run_dir: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"no {path}: not a spectrain run directory", file=sys.stderr)
        return 2
    recs = list(map(json.loads, path.read_text().splitlines()))
    evals = [r for r in recs if "eval/sim_tau_proxy" in r]
    train = [r for r in recs if "sim_tau" in r and "loss" in r]  # one record per optimizer step
    if not evals and not train:
        print(f"{path} has no training or held-out records yet", file=sys.stderr)
        return 2
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 4))
    if train:  # the training batches' own numbers: noisy, so a moving average is drawn over them
        xs = [r["step"] for r in train]
        ax0.plot(xs, [r["loss"] for r in train], color="gray", alpha=0.35, lw=0.8, label="per step")
        ax0.plot(xs, _smooth([r["loss"] for r in train]), color="black", label=f"moving average ({WINDOW})")
        ax2.plot(xs, _smooth([r["sim_tau"] for r in train]), color="gray",
                 label=f"training batches, moving average ({WINDOW})")
    ax0.set(xlabel="optimizer step", ylabel="training loss (decay-weighted TTT sum)", title="training loss")
    ax0.legend(fontsize=8)
    steps = [r["step"] for r in evals]
    # eval/acc_0, eval/acc_1, ... (not eval/acc_t1_i, the T=1 proxy)
    for i in range(sum(1 for k in (evals[-1] if evals else {}) if re.fullmatch(r"eval/acc_\d+", k))):
        ax1.plot(steps, [r[f"eval/acc_{i}"] for r in evals], marker="o", label=f"TTT step {i}")
    ax1.set(xlabel="optimizer step", ylabel="held-out top-1 acc (teacher-forced)", title="held-out acc_i per TTT step")
    if evals:
        ax1.legend(fontsize=8)
        ax2.plot(steps, [r["eval/sim_tau_proxy"] for r in evals], marker="o", color="black", label="held-out")
    ax2.set(xlabel="optimizer step", ylabel="sim tau (proxy, incl. bonus)", title="simulated tau (greedy proxy)")
    ax2.legend(fontsize=8)
    for ax in (ax0, ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "train_curve.png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1]))
