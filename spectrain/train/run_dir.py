"""Run directory bookkeeping: which recipe fields define a run (its hash), run_info.json (versions, git sha,
inputs), claiming an output_dir, metrics.jsonl appends and truncation on resume."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spectrain import registry
from spectrain.io.outputs import (
    MARKER,
    append_text_safe,
    check_placement,
    record_temp,
    run_lock,
    write_marker,
    write_text_safe,
)
from spectrain.train.distributed import malloc_in_effect
from spectrain.train.tracking import init_trackers, log_record

# Keys that change where/how often things are written or logged but not what is computed; a resume
# may change them freely. Everything else in the recipe must match the checkpoint's recipe.
_HASH_EXEMPT = {
    ("training", "resume_from"), ("training", "checkpoint_every"), ("training", "eval_every"),
    ("training", "keep_checkpoints"), ("training", "num_workers"), ("training", "feature_cache"),
    ("training", "max_nan_steps"),
    ("data", "cache_dir"), ("tracking",), ("launch",), ("output_dir",),
    # used by `regenerate` and `prepare-features` only (a cache records its own dtype in its manifest)
    ("data", "chat_template_kwargs"), ("features",),
    # the run's length may grow on resume (an extended run; the schedule rule: docs/reliability.md, "Extending a finished run")
    ("training", "max_steps"), ("training", "epochs"),
}


_LENGTH_KEYS = {("training", "max_steps"), ("training", "epochs")}


# Option sections that leave the hash when switched off (fraction 0), so checkpoints written before the
# option existed still resume.
_OFF_WHEN_ZERO = {("training", "on_policy"): "fraction", ("drafter", "eagle3", "rollout"): "fraction"}


def training_fields(recipe_dict: dict, legacy: bool = False) -> dict:
    """The recipe without the fields a resume may change (see _HASH_EXEMPT). ``legacy``: the fields of
    checkpoints written before runs could be extended (the length was part of the hash)."""
    out = json.loads(json.dumps(recipe_dict))
    for path in _HASH_EXEMPT - (_LENGTH_KEYS if legacy else set()):
        node = out
        for key in path[:-1]:
            node = node.get(key, {})
        node.pop(path[-1], None)
    for path, key in _OFF_WHEN_ZERO.items():
        node = out
        for k in path[:-1]:
            node = node.get(k, {})
        if not (node.get(path[-1]) or {}).get(key, 0):
            node.pop(path[-1], None)
    return out


def recipe_hash(recipe_dict: dict, legacy: bool = False) -> str:
    blob = json.dumps(training_fields(recipe_dict, legacy), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if a == b else [f"{prefix}: checkpoint {a!r} vs now {b!r}"]


def _git_sha() -> str | None:
    repo = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("spectrain", "torch", "transformers", "accelerate", "datasets", "safetensors", "deepspeed",
                 "wandb", "tensorboard"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def write_run_info(output_dir: Path, recipe, world_size: int, extra: dict | None = None) -> None:
    """Main process only: the resolved recipe, command line, git SHA, world size, library versions, the allocator
    setting in effect."""
    output_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(output_dir / "recipe.yaml", recipe.to_yaml())  # a planted symlink is replaced, not followed
    info = {
        "command": [sys.executable, *sys.argv],
        "git_sha": _git_sha(),
        "world_size": world_size,
        "recipe_hash": recipe_hash(recipe.to_dict()),
        "versions": library_versions(),
        "malloc": malloc_in_effect(),  # $SPECTRAIN_MALLOC as given, and whether glibc keeps freed memory
        "host": platform.node(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }
    _atomic_write_text(output_dir / "run_info.json", json.dumps(info, indent=2))


def run_inputs(recipe) -> list[tuple[str, str]]:
    """What a training run reads: its output_dir may be none of these, nor hold one."""
    t = recipe.training
    out = [("target", recipe.target.name_or_path), *(("data file", f) for f in recipe.data.train_files)]
    if t.features == "offline":
        out.append(("feature cache", t.feature_cache))
    own = Path(recipe.output_dir).expanduser().resolve()
    if t.resume_from and t.resume_from != "auto" and Path(t.resume_from).expanduser().resolve().parent != own:
        out.append(("checkpoint (training.resume_from)", t.resume_from))  # one of this run's own: resume's rules
    extra = registry.hook(recipe.drafter.kind, "train.run_inputs")  # a family's own inputs, e.g. a draft model
    return out + (extra(recipe) if extra is not None else [])


def check_run_dir(recipe) -> Path:
    """``output_dir`` placement (spectrain/io/outputs.py): a new or empty directory, or a spectrain run
    directory; never /, home, an input or a directory holding one, a checkpoint, a user's directory."""
    return check_placement(recipe.output_dir, "run", run_inputs(recipe), option="output_dir")


def claim_run_dir(recipe):
    """Check ``output_dir``, then (main process: RANK 0) lock it for this process and mark it a run
    directory. A context manager: the lock is released when the run ends."""
    out = check_run_dir(recipe)
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext(out)
    lock = run_lock(out)

    @contextlib.contextmanager
    def held():
        with lock:
            if not (out / MARKER).is_file():  # placement passed: new, or an older run dir known by its files
                write_marker(out, "run")
            yield out

    return held()


def start_run(accelerator, recipe, extra: dict) -> None:
    """Main process: run_info.json + recipe.yaml, and the trackers (wandb / tensorboard) via accelerate."""
    if not accelerator.is_main_process:
        return

    write_run_info(Path(recipe.output_dir), recipe, accelerator.num_processes, extra)
    init_trackers(accelerator, recipe, extra, resumed=bool(extra.get("resumed_at_step")))


def append_metrics(accelerator, path: Path, rec: dict) -> None:
    """Main process: one JSON line per record, and the numeric fields to the trackers."""
    if not accelerator.is_main_process:
        return
    append_text_safe(path, json.dumps(rec) + "\n")  # refuses a symlink planted at metrics.jsonl
    if accelerator.trackers:
        log_record(accelerator, rec)  # train/... and eval/... metrics; bookkeeping into the run config


def _atomic_write_text(path: Path, text: str) -> None:
    record_temp(path.parent, f".{path.name}.tmp{os.getpid()}")  # write_text_safe's temp name
    write_text_safe(path, text)


def read_run(run_dir: str | Path) -> dict | None:
    """A finished run's metrics.jsonl, for the study scripts: its optimizer-step records, the last held-out
    eval and the end record; None while the run has not ended (no end record yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    ends = [r for r in recs if r.get("event") == "end"]
    if not ends:
        return None
    return {"steps": [r for r in recs if "loss" in r and "split" not in r],
            "heldout": ([r for r in recs if r.get("split") == "heldout"] or [{}])[-1], "end": ends[-1]}


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records the interrupted run logged after its last checkpoint (they are redone)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the interruption
        if rec.get("step", 0) <= step:
            keep.append(line)
    _atomic_write_text(path, "".join(x + "\n" for x in keep))
