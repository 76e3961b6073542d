"""`spectrain eval --report-to wandb|tensorboard`: the report's numbers as sortable scalars, plus charts.

One scalar per (drafter, decode setting, prompt set) and metric, keyed

    {metric}/{drafter}/{decode}/{split}/{prompt set}

- metric: ``tau``, ``alpha_1`` .. ``alpha_k``, ``acceptance_rate``, ``measured_speedup``,
  ``predicted_speedup``, ``tokens_per_s`` (a position never verified has no alpha scalar);
- drafter: ``ngram``, or a checkpoint named after its run (``runs/tiny-eagle3/best`` ->
  ``tiny-eagle3-best``); decode: ``k5_T0``, ``tree4x5x32_T1`` ...; split: ``heldout`` | ``ood`` |
  ``indomain``; prompt set: ``spec_bench-rag`` (``/`` -> ``-``).

e.g. ``tau/tiny-eagle3-best/k5_T0/heldout/heldout``, ``alpha_2/ngram/k5_T0/ood/humaneval``.
The run config also maps every prompt set to its split (``prompt_set_splits``).

Charts: per (drafter, decode) the alpha_i decay with one line per prompt set (wandb line_series, split in
the line's name: wandb's line plots have no dash style, so the solid/dashed PNG is logged beside it;
tensorboard ``add_scalars``, x = draft position), the report table with alpha_i as numeric columns,
tau per cell, and the PNG plots. Evaluating a checkpoint of a training run (a drafter path inside a run
directory with tracking.json) joins that run's wandb project and group. TensorBoard files go to
OUT/tensorboard.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from spectrain.tracking import LINK_FILE, read_link

METRICS = ("tau", "acceptance_rate", "measured_speedup", "predicted_speedup", "tokens_per_s")
SPLIT_TAG = {"held-out": "heldout", "OOD": "ood", "in-domain": "indomain"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_=-]+", "-", text).strip("-") or "x"


def training_run(spec: str) -> Path | None:
    """The training run directory a drafter spec lives in (the dir itself or its parent), if any."""
    p = Path(spec)
    for d in (p, p.parent):
        if (d / LINK_FILE).is_file() or (d / "run_info.json").is_file():
            return d
    return None


def drafter_label(spec: str) -> str:
    run = training_run(spec)
    p = Path(spec)
    if run is not None and run != p:
        return _slug(f"{run.resolve().name}-{p.name}")
    return _slug(p.name if p.name else spec)


def decode_label(rec: dict) -> str:
    t = rec.get("tree")
    shape = f"k{rec['k']}" if not t else f"tree{t['topk']}x{t['depth']}x{t['total_tokens']}"
    return f"{shape}_T{rec['temperature']:g}".replace(".", "p")


def cell_key(rec: dict) -> str:
    return "/".join([drafter_label(rec["drafter"]), decode_label(rec), SPLIT_TAG.get(rec["split"], _slug(rec["split"])),
                     _slug(rec["prompt_set"])])


def scalars(records: list[dict]) -> dict[str, float]:
    """Every (metric, cell) scalar the trackers get (see the module doc for the key scheme)."""
    out: dict[str, float] = {}
    for r in records:
        cell = cell_key(r)
        for m in METRICS:
            if r.get(m) is not None:
                out[f"{m}/{cell}"] = float(r[m])
        for i, a in enumerate(r["alpha"], 1):
            if a is not None:
                out[f"alpha_{i}/{cell}"] = float(a)
    return out


def _groups(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        out.setdefault((drafter_label(r["drafter"]), decode_label(r)), []).append(r)
    return out


def run_link(meta: dict) -> tuple[dict | None, Path | None]:
    """(tracking.json of the first evaluated drafter that belongs to a training run, that run's dir)."""
    for spec in meta.get("drafters") or []:
        run = training_run(spec)
        if run is not None:
            return read_link(run) or {"name": run.resolve().name, "group": run.resolve().name}, run
    return None, None


def log_wandb(out_dir: Path, meta: dict, records: list[dict], plots: list[Path], project: str | None) -> None:
    try:
        import wandb
    except ImportError:
        raise ValueError("--report-to wandb needs the wandb package: pip install 'spectrain[wandb]'") from None
    link, _ = run_link(meta)
    name = out_dir.resolve().name
    if link and not name.startswith(link["name"]):
        name = f"{link['name']}-{name}"
    config = {**meta, "prompt_set_splits": {r["prompt_set"]: r["split"] for r in records},
              "eval_of_run": link}
    run = wandb.init(project=project or (link or {}).get("project") or "spectrain", name=name, job_type="eval",
                     group=(link or {}).get("group"), dir=os.environ.get("WANDB_DIR") or str(out_dir), config=config)
    try:
        logged: dict = dict(scalars(records))
        for (drafter, decode), recs in _groups(records).items():
            keep = [r for r in recs if any(a is not None for a in r["alpha"])]
            if keep:
                logged[f"acceptance/{drafter}/{decode}"] = wandb.plot.line_series(
                    xs=[[i + 1 for i, a in enumerate(r["alpha"]) if a is not None] for r in keep],
                    ys=[[a for a in r["alpha"] if a is not None] for r in keep],
                    keys=[f"{r['prompt_set']} ({r['split']}, {'solid' if r['split'] == 'held-out' else 'dashed'} "
                          "in the PNG)" for r in keep],
                    title=f"alpha_i vs draft position: {drafter} {decode}", xname="draft position i")
        kmax = max((len(r["alpha"]) for r in records), default=0)
        cols = ["drafter", "decode", "prompt_set", "split", "n_prompts", *METRICS, *(f"alpha_{i}" for i in
                                                                                      range(1, kmax + 1))]
        rows = [[drafter_label(r["drafter"]), decode_label(r), r["prompt_set"], r["split"], r["n_prompts"],
                 *(r.get(m) for m in METRICS), *(r["alpha"] + [None] * (kmax - len(r["alpha"])))] for r in records]
        logged["report"] = wandb.Table(columns=cols, data=rows)
        logged.update({f"plots/{p.stem}": wandb.Image(str(p)) for p in plots})
        run.log(logged)
    finally:
        run.finish()


def log_tensorboard(out_dir: Path, meta: dict, records: list[dict], plots: list[Path]) -> Path:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--report-to tensorboard needs the tensorboard package: "
                         "pip install 'spectrain[tensorboard]'") from None
    logdir = out_dir / "tensorboard"  # inside a run dir when --out is (runs/x/eval): one logdir for both
    writer = SummaryWriter(str(logdir))
    try:
        for k, v in scalars(records).items():
            writer.add_scalar(k, v, global_step=0)
        for (drafter, decode), recs in _groups(records).items():
            for i in range(max(len(r["alpha"]) for r in recs)):
                curve = {f"{SPLIT_TAG.get(r['split'], 'x')}-{_slug(r['prompt_set'])}": r["alpha"][i] for r in recs
                         if i < len(r["alpha"]) and r["alpha"][i] is not None}
                if curve:  # one chart per (drafter, decode), x = draft position, one line per prompt set
                    writer.add_scalars(f"acceptance/{drafter}/{decode}", curve, global_step=i + 1)
        md = out_dir / "report.md"
        if md.is_file():
            writer.add_text("report", md.read_text())
        import matplotlib.image as mpimg

        for p in plots:
            writer.add_image(f"plots/{p.stem}", mpimg.imread(str(p))[..., :3], dataformats="HWC")
    finally:
        writer.close()
    return logdir


def log_trackers(out_dir: Path, meta: dict, records: list[dict], plots: list[Path], report_to: list[str],
                 project: str | None) -> None:
    if "wandb" in report_to:
        log_wandb(out_dir, meta, records, plots, project)
    if "tensorboard" in report_to:
        print(f"tensorboard: {log_tensorboard(out_dir, meta, records, plots)}")
