"""`spectrain plot RUN [--out PNG]`: a training run's curves from its metrics.jsonl, against the optimizer step.

Three panels: the training loss (per step and a moving average), the held-out per-position top-1 accuracy
``eval/acc_i`` (teacher-forced: EAGLE-3's TTT step i, Medusa's head i, the draft model's position t+i) and
simulated tau (a greedy PROXY, +1 bonus included) on the held-out evals and, smoothed, on the training batches.
The PNG goes to ``RUN/train_curve.png`` unless ``--out`` names another file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from spectrain.io.outputs import check_file_placement, open_nofollow

WINDOW = 20
PNG = "train_curve.png"


def add_plot_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("run", metavar="RUN", help="a training run directory (the recipe's output_dir)")
    p.add_argument("--out", default=None, help=f"the PNG to write (default RUN/{PNG})")
    return p


def smooth(ys: list[float], w: int = WINDOW) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - w] if i >= w else 0.0)
        out.append(total / min(i + 1, w))
    return out


def read_curves(run_dir) -> tuple[list[dict], list[dict]]:
    """(per-step training records, held-out records) of a run's metrics.jsonl; a clear error for a missing run
    directory, a missing metrics.jsonl, or one without the fields the plot draws."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist (give the recipe's output_dir)")
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run} has no metrics.jsonl: not a spectrain run directory, or its training has "
                                "not logged a step yet")
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    recs = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            recs.append(rec if isinstance(rec, dict) else {})
        except json.JSONDecodeError:
            if n < len(lines):  # only the last line may be cut short (a run stopped mid-write)
                raise ValueError(f"{path}: line {n} is not JSON (a damaged metrics.jsonl)") from None
    train = [r for r in recs if "loss" in r and "sim_tau" in r and "step" in r]  # one record per optimizer step
    evals = [r for r in recs if "eval/sim_tau_proxy" in r and "step" in r]
    if not train and not evals:
        raise ValueError(f"{path} has no training or held-out records yet (none with step + loss + sim_tau, or "
                         "step + eval/sim_tau_proxy): nothing to plot")
    return train, evals


def place_png(run_dir, out=None) -> tuple[Path, Path]:
    """The PNG's path and its temp name, checked before anything is drawn (spectrain/io/outputs.py): a rerun
    replaces its own PNG, never a checkpoint's file, the run's own records, the metrics.jsonl it reads, and
    never through a link."""
    out = Path(out) if out else Path(run_dir) / PNG
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}.png")
    check_file_placement(out, [("metrics file", Path(run_dir) / "metrics.jsonl")], [tmp], replace=True)
    return out, tmp


def plot_run(run_dir, out=None) -> Path:
    """Draw the run's curves into ``out`` (default RUN/train_curve.png); returns the PNG's path."""
    train, evals = read_curves(run_dir)
    out, tmp = place_png(run_dir, out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 4))
    if train:  # the training batches' own numbers: noisy, so a moving average is drawn over them
        xs = [r["step"] for r in train]
        ax0.plot(xs, [r["loss"] for r in train], color="gray", alpha=0.35, lw=0.8, label="per step")
        ax0.plot(xs, smooth([r["loss"] for r in train]), color="black", label=f"moving average ({WINDOW})")
        ax2.plot(xs, smooth([r["sim_tau"] for r in train]), color="gray",
                 label=f"training batches, moving average ({WINDOW})")
        ax0.legend(fontsize=8)
    ax0.set(xlabel="optimizer step", ylabel="training loss (as the recipe's loss defines it)", title="training loss")
    # eval/acc_0, eval/acc_1, ... (not eval/acc_t1_i, the T=1 proxy); a position missing from a record is skipped
    positions = sorted({int(k.rsplit("_", 1)[1]) for r in evals for k in r if re.fullmatch(r"eval/acc_\d+", k)})
    for i in positions:
        pts = [(r["step"], r[f"eval/acc_{i}"]) for r in evals if r.get(f"eval/acc_{i}") is not None]
        ax1.plot([s for s, _ in pts], [v for _, v in pts], marker="o", label=f"position {i}")
    ax1.set(xlabel="optimizer step", ylabel="held-out top-1 acc (teacher-forced)", title="held-out acc_i per position")
    if positions:
        ax1.legend(fontsize=8)
    pts = [(r["step"], r["eval/sim_tau_proxy"]) for r in evals if r["eval/sim_tau_proxy"] is not None]
    if pts:
        ax2.plot([s for s, _ in pts], [v for _, v in pts], marker="o", color="black", label="held-out")
    ax2.set(xlabel="optimizer step", ylabel="sim tau (proxy, incl. bonus)", title="simulated tau (greedy proxy)")
    if train or pts:
        ax2.legend(fontsize=8)
    for ax in (ax0, ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with open_nofollow(tmp, "wb") as f:  # a link planted at the temp name after the check is refused
            fig.savefig(f, dpi=110, format="png")
        os.replace(tmp, out)  # never a half-written PNG at the final name
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def main(args: argparse.Namespace) -> int:
    print(plot_run(args.run, args.out))
    return 0
