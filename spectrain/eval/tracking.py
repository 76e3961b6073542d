"""`spectrain eval --report-to wandb|tensorboard`: the report's numbers as sortable scalars, plus charts.

One tracker run per evaluated drafter, and one scalar per (decode setting, prompt set) and metric, keyed

    {metric}/{decode}/{split}/{prompt set}

so the same cell of two drafters (of one eval, or of two evals of two training runs) has the same key and
their tau and alpha_i overlay in one chart; the drafter is a run attribute (wandb config ``drafter`` and
``drafter_spec``, the run name's suffix when one eval has several drafters; TensorBoard: one sub-directory
per drafter, which TensorBoard shows as runs of one chart).

- metric: ``tau``, ``alpha_1`` .. ``alpha_k``, ``acceptance_rate``, ``measured_speedup``,
  ``predicted_speedup``, ``tokens_per_s`` (a position never verified has no alpha scalar);
- decode: ``k5_T0``, ``tree4x5x32_T1`` ...; split: ``heldout`` | ``ood`` | ``indomain``; prompt set:
  ``spec_bench-rag`` (``/`` -> ``-``); e.g. ``tau/k5_T0/heldout/heldout``, ``alpha_2/k5_T0/ood/humaneval``;
- drafter: ``ngram``, or a checkpoint named after its run (``runs/tiny-eagle3/best`` -> ``tiny-eagle3-best``).

The run is named after the eval's output directory (its final name, never the staging directory: the
trackers run after the report has landed); the config also maps every prompt set to its split
(``prompt_set_splits``). Charts: per decode setting the alpha_i decay with one line per prompt set (wandb
line_series, split in the line's name: wandb's line plots have no dash style, so the solid/dashed PNG is
logged beside it; tensorboard ``add_scalars``, x = draft position), the report table with alpha_i as numeric
columns, and the PNG plots. Evaluating a checkpoint of a training run (a drafter path inside a run
directory with tracking.json) joins that run's wandb project and group. TensorBoard files go to
OUT/tensorboard/<drafter>.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from spectrain.eval.plots import plot_slug
from spectrain.train.tracking import LINK_FILE, read_link

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
    """The drafter-free part of a scalar's key: the same for every drafter evaluated on this cell."""
    return "/".join([decode_label(rec), SPLIT_TAG.get(rec["split"], _slug(rec["split"])), _slug(rec["prompt_set"])])


def scalars(records: list[dict]) -> dict[str, float]:
    """Every (metric, cell) scalar of ONE drafter's records (see the module doc for the key scheme)."""
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


def by_drafter(records: list[dict]) -> dict[str, list[dict]]:
    """Records grouped by drafter spec, in report order (one tracker run each)."""
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["drafter"], []).append(r)
    return out


def _by_decode(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(decode_label(r), []).append(r)
    return out


def drafter_link(spec: str) -> tuple[dict | None, Path | None]:
    """(tracking.json of the training run the drafter belongs to, that run's dir), or (None, None)."""
    run = training_run(spec)
    if run is None:
        return None, None
    return read_link(run) or {"name": run.resolve().name, "group": run.resolve().name}, run


def run_name(out_dir: Path, spec: str, n_drafters: int) -> str:
    """The eval output directory's name; with several drafters in one eval, each run adds its drafter."""
    name = Path(out_dir).resolve().name
    return name if n_drafters == 1 else f"{name}-{drafter_label(spec)}"


def _wandb_run(wandb, out_dir: Path, meta: dict, spec: str, recs: list[dict], n: int, project: str | None):
    link, _ = drafter_link(spec)
    config = {**meta, "drafter": drafter_label(spec), "drafter_spec": spec,
              "prompt_set_splits": {r["prompt_set"]: r["split"] for r in recs}, "eval_of_run": link}
    return wandb.init(project=project or (link or {}).get("project") or "spectrain", name=run_name(out_dir, spec, n),
                      job_type="eval", group=(link or {}).get("group"), dir=os.environ.get("WANDB_DIR") or str(out_dir),
                      config=config)


def log_wandb(out_dir: Path, meta: dict, records: list[dict], plots: list[Path], project: str | None) -> list[str]:
    """One wandb run per drafter; returns the runs' directories (offline: what `wandb sync` takes)."""
    try:
        import wandb
    except ImportError:
        raise ValueError("--report-to wandb needs the wandb package: pip install 'spectrain[wandb]'") from None
    groups, dirs = by_drafter(records), []
    for spec, recs in groups.items():
        run = _wandb_run(wandb, out_dir, meta, spec, recs, len(groups), project)
        try:
            run.log(_wandb_payload(wandb, spec, recs, plots))
            dirs.append(str(Path(run.dir).parent))
        finally:
            run.finish()
    return dirs


def _wandb_payload(wandb, spec: str, recs: list[dict], plots: list[Path]) -> dict:
    logged: dict = dict(scalars(recs))
    for decode, rs in _by_decode(recs).items():
        keep = [r for r in rs if any(a is not None for a in r["alpha"])]
        if keep:
            logged[f"acceptance/{decode}"] = wandb.plot.line_series(
                xs=[[i + 1 for i, a in enumerate(r["alpha"]) if a is not None] for r in keep],
                ys=[[a for a in r["alpha"] if a is not None] for r in keep],
                keys=[f"{r['prompt_set']} ({r['split']}, {'solid' if r['split'] == 'held-out' else 'dashed'} "
                      "in the PNG)" for r in keep],
                title=f"alpha_i vs draft position: {drafter_label(spec)} {decode}", xname="draft position i")
    kmax = max((len(r["alpha"]) for r in recs), default=0)
    cols = ["drafter", "decode", "prompt_set", "split", "n_prompts", *METRICS, *(f"alpha_{i}" for i in range(1, kmax + 1))]
    rows = [[drafter_label(r["drafter"]), decode_label(r), r["prompt_set"], r["split"], r["n_prompts"],
             *(r.get(m) for m in METRICS), *(r["alpha"] + [None] * (kmax - len(r["alpha"])))] for r in recs]
    logged["report"] = wandb.Table(columns=cols, data=rows)

    mine = f"acceptance_{plot_slug(spec)}_"  # this drafter's alpha plots (keyed without it), and tau.png ...
    for p in plots:
        if p.stem.startswith(mine):
            logged[f"plots/acceptance_{p.stem[len(mine):]}"] = wandb.Image(str(p))
        elif not p.stem.startswith("acceptance_"):
            logged[f"plots/{p.stem}"] = wandb.Image(str(p))
    return logged


def log_tensorboard(out_dir: Path, meta: dict, records: list[dict], plots: list[Path]) -> Path:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--report-to tensorboard needs the tensorboard package: "
                         "pip install 'spectrain[tensorboard]'") from None
    logdir = out_dir / "tensorboard"  # inside a run dir when --out is (runs/x/eval): one logdir for both
    for spec, recs in by_drafter(records).items():  # a sub-directory per drafter = a TensorBoard run
        writer = SummaryWriter(str(logdir / drafter_label(spec)))
        try:
            _tensorboard_drafter(writer, recs)
        finally:
            writer.close()
    writer = SummaryWriter(str(logdir / "report"))
    try:
        md = out_dir / "report.md"
        if md.is_file():
            writer.add_text("report", md.read_text())
        import matplotlib.image as mpimg

        for p in plots:
            writer.add_image(f"plots/{p.stem}", mpimg.imread(str(p))[..., :3], dataformats="HWC")
    finally:
        writer.close()
    return logdir


def _tensorboard_drafter(writer, recs: list[dict]) -> None:
    for k, v in scalars(recs).items():
        writer.add_scalar(k, v, global_step=0)
    for decode, rs in _by_decode(recs).items():
        for i in range(max(len(r["alpha"]) for r in rs)):
            curve = {f"{SPLIT_TAG.get(r['split'], 'x')}-{_slug(r['prompt_set'])}": r["alpha"][i] for r in rs
                     if i < len(r["alpha"]) and r["alpha"][i] is not None}
            if curve:  # one chart per decode setting, x = draft position, one line per prompt set
                writer.add_scalars(f"acceptance/{decode}", curve, global_step=i + 1)


def log_trackers(out_dir: Path, meta: dict, records: list[dict], plots: list[Path], report_to: list[str],
                 project: str | None) -> None:
    """Call with the report's FINAL directory (after it landed), so every path the trackers write or print
    is one that exists afterwards."""
    if "wandb" in report_to:
        for d in log_wandb(out_dir, meta, records, plots, project):
            print(f"wandb: {d}" + (f"  (offline: `wandb sync {d}`)" if os.environ.get("WANDB_MODE") == "offline"
                                   else ""))
    if "tensorboard" in report_to:
        print(f"tensorboard: tensorboard --logdir {log_tensorboard(out_dir, meta, records, plots)}")
