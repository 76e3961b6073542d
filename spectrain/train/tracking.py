"""Experiment trackers for training (wandb / tensorboard through accelerate): what goes where.

- Metrics, per optimizer step, under namespaces: ``train/loss``, ``train/acc_i`` (teacher-forced top-1
  agreement at TTT step / head i), ``train/sim_tau_proxy``, ``train/lr``, ``train/grad_norm``,
  ``train/tokens_per_s``, and the held-out pass ``eval/loss``, ``eval/acc_i``, ``eval/sim_tau_proxy``.
  The x axis is ``train/step`` (wandb ``define_metric``), so a resumed run that redoes a few steps
  after its last checkpoint adds points instead of being dropped by wandb's monotonic step.
  ``eval/sim_tau_proxy`` is summarised by its maximum (``summary="max"``): the runs table shows each
  run's best held-out simulated tau, not its last.
- Bookkeeping (epoch, held-out row count, wall time, how the run ended, world size, accumulation,
  the resolved recipe) goes into the run *config*, not the metric history.
- The run name is the output directory's name (``tracking.run_name`` overrides it); the wandb group
  is the same name, so an eval of this run's checkpoints joins it (spectrain/eval/tracking.py).
- ``RUN_DIR/tracking.json`` records project, name, group and the wandb run id; a resumed run
  (``training.resume_from``) continues the same wandb run.

metrics.jsonl keeps every record exactly as the loop wrote it; the mapping applies to trackers only.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

LINK_FILE = "tracking.json"
STEP_KEY = "train/step"
BEST_KEY = "eval/sim_tau_proxy"  # summarised by its max (wandb define_metric)
BOOKKEEPING = ("epoch", "split", "heldout_rows", "event", "wall_s", "interrupted_by", "tokens", "loss_tokens")
_RENAME = {"sim_tau": "train/sim_tau_proxy"}


def metric_key(key: str) -> str | None:
    """The tracker key of a metrics.jsonl field, or None for the step and bookkeeping fields."""
    if key == "step" or key in BOOKKEEPING or key.endswith("/loss_tokens"):  # eval/loss_tokens: a fixed count
        return None
    if "/" in key:  # already namespaced (eval/...)
        return key
    return _RENAME.get(key, f"train/{key}")


def split_record(rec: dict) -> tuple[dict[str, float], dict]:
    """(metrics for the history, bookkeeping for the config) of one metrics.jsonl record."""
    metrics, book = {}, {}
    for k, v in rec.items():
        name = metric_key(k)
        if name is not None:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[name] = v
        elif k in BOOKKEEPING and k not in ("tokens", "loss_tokens", "split") and v is not None:
            book[f"run/{k}"] = v
        elif k == "eval/loss_tokens":
            book["run/heldout_loss_tokens"] = v
    return metrics, book


def read_link(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / LINK_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None  # a damaged link only costs the continuity of the wandb run


def _write_link(run_dir: Path, info: dict) -> None:
    tmp = run_dir / f".{LINK_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, run_dir / LINK_FILE)


def run_name(recipe) -> str:
    return recipe.tracking.run_name or Path(recipe.output_dir).resolve().name


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def init_trackers(accelerator, recipe, extra: dict, resumed: bool) -> None:
    """Main process: start accelerate's trackers with the recipe + run facts as config, write tracking.json."""
    out = Path(recipe.output_dir)
    project, name = recipe.tracking.project, run_name(recipe)
    old = (read_link(out) or {}) if resumed else {}
    link = {"project": project, "name": name, "group": old.get("group") or name}
    config = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in _flatten(recipe.to_dict()).items()}
    config.update({f"run/{k}": v for k, v in extra.items() if isinstance(v, (int, float, str, bool))})
    config["run/world_size"] = accelerator.num_processes
    kwargs = {}
    if "wandb" in recipe.tracking.report_to:
        same = old.get("project") == project and old.get("wandb_id")
        link["wandb_id"] = old["wandb_id"] if same else uuid.uuid4().hex[:12]  # kept in tracking.json
        kwargs["wandb"] = {"name": name, "id": link["wandb_id"], "resume": "allow", "group": link["group"],
                           "job_type": "train", "dir": os.environ.get("WANDB_DIR") or str(out)}
    accelerator.init_trackers(project, config=config, init_kwargs=kwargs)
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            run = tracker.tracker
            run.define_metric(STEP_KEY)
            for ns in ("train/*", "eval/*"):
                run.define_metric(ns, step_metric=STEP_KEY)
            # the runs table's column is the best held-out sim tau of the run, not the last
            run.define_metric(BEST_KEY, step_metric=STEP_KEY, summary="max")
        elif tracker.name == "tensorboard":
            link["tensorboard_dir"] = str(Path(tracker.logging_dir).resolve())
    _write_link(out, link)


def log_record(accelerator, rec: dict) -> None:
    """Main process: one metrics.jsonl record to every tracker (history: metrics; config: bookkeeping)."""
    metrics, book = split_record(rec)
    step = rec.get("step")
    for tracker in accelerator.trackers:
        seen = tracker.__dict__.setdefault("_spectrain_book", {})
        changed = {k: v for k, v in book.items() if seen.get(k) != v}
        seen.update(changed)
        if tracker.name == "wandb":
            run = tracker.tracker
            if metrics:
                run.log({**metrics, STEP_KEY: step})
            if changed:
                run.config.update(changed, allow_val_change=True)
        elif tracker.name == "tensorboard":
            for k, v in metrics.items():
                tracker.tracker.add_scalar(k, v, global_step=step)
            if changed:
                tracker.tracker.add_text("run", json.dumps(changed), global_step=step)
            tracker.tracker.flush()
        elif metrics:
            tracker.log(metrics, step=step)
