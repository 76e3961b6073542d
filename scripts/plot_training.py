"""Plot a training run's held-out curves from its metrics.jsonl: per-TTT-step top-1 accuracy acc_i
and simulated tau (a greedy proxy, +1 bonus included) against the optimizer step.

    python scripts/plot_training.py runs/tiny-eagle3            # -> runs/tiny-eagle3/train_curve.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(run_dir: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"no {path}: not a spectrain run directory", file=sys.stderr)
        return 2
    evals = [r for r in map(json.loads, path.read_text().splitlines()) if "eval/sim_tau_proxy" in r]
    if not evals:
        print(f"{path} has no held-out eval records (training.eval_every=0 or no held-out split)", file=sys.stderr)
        return 2
    steps = [r["step"] for r in evals]
    n_acc = sum(1 for k in evals[-1] if k.startswith("eval/acc_"))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i in range(n_acc):
        ax1.plot(steps, [r[f"eval/acc_{i}"] for r in evals], marker="o", label=f"TTT step {i}")
    ax1.set(xlabel="optimizer step", ylabel="held-out top-1 acc (teacher-forced)", title="acc_i per TTT step")
    ax1.legend(fontsize=8)
    ax2.plot(steps, [r["eval/sim_tau_proxy"] for r in evals], marker="o", color="black")
    ax2.set(xlabel="optimizer step", ylabel="sim tau (proxy, incl. bonus)", title="simulated tau (greedy proxy)")
    for ax in (ax1, ax2):
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
