"""`spectrain plot RUN [--out PNG]`: a training run's curves from its metrics.jsonl, against the optimizer step.

Three panels: the training loss (per step and a moving average), the held-out per-position top-1 accuracy
``eval/acc_i`` (teacher-forced: EAGLE-3's TTT step i, Medusa's head i, the draft model's position t+i) and
simulated tau (a greedy PROXY, +1 bonus included) on the held-out evals and, smoothed, on the training batches.
The PNG goes to ``RUN/train_curve.png`` unless ``--out`` names another file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections import Counter
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


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def curves(train: list[dict], evals: list[dict]) -> tuple[dict[str, list[tuple]], Counter]:
    """Every curve's (step, value) points and the points left out, counted by reason. A point is drawn only when
    its step and value are finite numbers: a NaN-skipped step logs a NaN loss (it would blank a moving average over
    the next steps) and a null step has no place on the axis. An absent or null value was not measured (a position
    never verified): no point, nothing to report."""
    # eval/acc_0, eval/acc_1, ... (not eval/acc_t1_i, the T=1 proxy)
    positions = sorted({int(k.rsplit("_", 1)[1]) for r in evals for k in r if re.fullmatch(r"eval/acc_\d+", k)})
    wanted = [("loss", train), ("sim_tau", train), ("eval/sim_tau_proxy", evals),
              *((f"eval/acc_{i}", evals) for i in positions)]
    pts, skipped = {}, Counter()
    for key, recs in wanted:
        pts[key] = []
        for r in recs:
            step, v = r.get("step"), r.get(key)
            if v is None:
                continue
            if not _number(step):
                skipped["with a null or non-numeric step"] += 1
            elif not _number(v):
                skipped["with a NaN, infinite or non-numeric value (e.g. a step skipped for a non-finite loss)"] += 1
            else:
                pts[key].append((step, v))
    return pts, skipped


def usable_curves(run_dir) -> dict[str, list[tuple]]:
    """The run's points; says in one line how many were left out and why, or refuses when none is left."""
    pts, skipped = curves(*read_curves(run_dir))
    if not skipped:
        return pts
    drawn, bad = sum(map(len, pts.values())), sum(skipped.values())
    why = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
    path = Path(run_dir) / "metrics.jsonl"
    if not drawn:
        raise ValueError(f"{path}: nothing to plot: all {bad} points are unusable ({why}); check the run's "
                         "training log for non-finite losses, or repair its metrics.jsonl")
    print(f"note: {bad} of {bad + drawn} points of {path} not drawn: {why}", file=sys.stderr)
    return pts


def plot_run(run_dir, out=None) -> Path:
    """Draw the run's curves into ``out`` (default RUN/train_curve.png); returns the PNG's path."""
    pts = usable_curves(run_dir)
    out, tmp = place_png(run_dir, out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def xy(key: str) -> tuple[list, list]:
        return [s for s, _ in pts[key]], [v for _, v in pts[key]]

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 4))
    if pts["loss"]:  # the training batches' own numbers: noisy, so a moving average is drawn over them
        xs, ys = xy("loss")
        ax0.plot(xs, ys, color="gray", alpha=0.35, lw=0.8, label="per step")
        ax0.plot(xs, smooth(ys), color="black", label=f"moving average ({WINDOW})")
        ax0.legend(fontsize=8)
    if pts["sim_tau"]:
        xs, ys = xy("sim_tau")
        ax2.plot(xs, smooth(ys), color="gray", label=f"training batches, moving average ({WINDOW})")
    ax0.set(xlabel="optimizer step", ylabel="training loss (as the recipe's loss defines it)", title="training loss")
    positions = [k for k in pts if k.startswith("eval/acc_") and pts[k]]
    for key in positions:
        ax1.plot(*xy(key), marker="o", label=f"position {key.rsplit('_', 1)[1]}")
    ax1.set(xlabel="optimizer step", ylabel="held-out top-1 acc (teacher-forced)", title="held-out acc_i per position")
    if positions:
        ax1.legend(fontsize=8)
    if pts["eval/sim_tau_proxy"]:
        ax2.plot(*xy("eval/sim_tau_proxy"), marker="o", color="black", label="held-out")
    ax2.set(xlabel="optimizer step", ylabel="sim tau (proxy, incl. bonus)", title="simulated tau (greedy proxy)")
    if pts["sim_tau"] or pts["eval/sim_tau_proxy"]:
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
