"""Run directories and checkpoints for the training loop: atomic writes, exact resume, pruning.

Layout of a run directory (``recipe.output_dir``)::

    recipe.yaml  run_info.json  metrics.jsonl
    step-N/      drafter weights in save_pretrained form (config.json + model.safetensors ...)
                 trainer_state.json  (step, epoch, step in epoch, recipe hash, best tau, world size)
                 accelerate/         (accelerator.save_state: model, optimizer, scheduler, RNG per rank)
                 scheduler.json      (the LR schedule's state: JSON, never a pickle)
                 SHA256SUMS          (sha256 of every file; verified before a resume trusts them)
    last -> step-N                   (symlink to the newest complete checkpoint)
    best/ init/  drafter weights only: the best held-out simulated tau so far (+ best.json) / the untrained head

Nothing is unpickled from a checkpoint: accelerate's own files are read with ``weights_only=True`` (forced
for every torch.load while the state loads), and a pickle spectrain did not write is refused by name.

Every checkpoint is written into ``.tmp-step-N`` and renamed into place only when complete, so a
crash or preemption mid-write never leaves a half checkpoint under a real name; a failed write removes its
temp dir, and the temp dirs of a killed save are removed when the next run starts. ``best/`` and ``init/``
are swapped in with one atomic exchange (renameat2), so there is no moment without them. Optimizer, RNG and
model state go through ``accelerator.save_state`` so DDP / FSDP / DeepSpeed sharded states are
saved by the engine that owns them, not by home-made code.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spectrain import integrity
from spectrain.errors import writing
from spectrain.outputs import (
    MARKER,
    append_text_safe,
    check_placement,
    record_temp,
    remove_leftovers,
    run_lock,
    swap_in,
    write_marker,
    write_text_safe,
)
from spectrain.safe_resume import check_files, load_engine_state

STATE_FILE = "trainer_state.json"
ENGINE_DIR = "accelerate"
SCHEDULER_FILE = "scheduler.json"
_STEP_RE = re.compile(r"^step-(\d+)$")

# Keys that change where/how often things are written or logged but not what is computed; a resume
# may change them freely. Everything else in the recipe must match the checkpoint's recipe.
_HASH_EXEMPT = {
    ("training", "resume_from"), ("training", "checkpoint_every"), ("training", "eval_every"),
    ("training", "keep_checkpoints"), ("training", "num_workers"), ("training", "feature_cache"),
    ("training", "max_nan_steps"),
    ("data", "cache_dir"), ("tracking",), ("launch",), ("output_dir",),
    # used by `regenerate` and `prepare-features` only (a cache records its own dtype in its manifest)
    ("data", "chat_template_kwargs"), ("features",),
    # the run's length may grow on resume (an extended run; the schedule rule: README, "Resume")
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


# ---- run directory bookkeeping ---------------------------------------------------------------------


def _git_sha() -> str | None:
    repo = Path(__file__).resolve().parent.parent
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
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("spectrain", "torch", "transformers", "accelerate", "datasets", "safetensors", "deepspeed",
                 "wandb", "tensorboard"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def write_run_info(output_dir: Path, recipe, world_size: int, extra: dict | None = None) -> None:
    """Main process only: the resolved recipe, command line, git SHA, world size, library versions."""
    output_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(output_dir / "recipe.yaml", recipe.to_yaml())  # a planted symlink is replaced, not followed
    info = {
        "command": [sys.executable, *sys.argv],
        "git_sha": _git_sha(),
        "world_size": world_size,
        "recipe_hash": recipe_hash(recipe.to_dict()),
        "versions": library_versions(),
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
    if recipe.drafter.kind == "draft" and recipe.drafter.draft.model:
        out.append(("draft model", recipe.drafter.draft.model))
    return out


def check_run_dir(recipe) -> Path:
    """``output_dir`` placement (spectrain/outputs.py): a new or empty directory, or a spectrain run
    directory; never /, home, an input or a directory holding one, a checkpoint, a user's directory."""
    return check_placement(recipe.output_dir, "run", run_inputs(recipe), option="output_dir")


def claim_run_dir(recipe):
    """Check ``output_dir``, then (main process: RANK 0) lock it for this process and mark it a run
    directory. A context manager: the lock is released when the run ends."""
    import contextlib

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
    from spectrain.tracking import init_trackers

    write_run_info(Path(recipe.output_dir), recipe, accelerator.num_processes, extra)
    init_trackers(accelerator, recipe, extra, resumed=bool(extra.get("resumed_at_step")))


def append_metrics(accelerator, path: Path, rec: dict) -> None:
    """Main process: one JSON line per record, and the numeric fields to the trackers."""
    if not accelerator.is_main_process:
        return
    append_text_safe(path, json.dumps(rec) + "\n")  # refuses a symlink planted at metrics.jsonl
    if accelerator.trackers:
        from spectrain.tracking import log_record

        log_record(accelerator, rec)  # train/... and eval/... metrics; bookkeeping into the run config


def _atomic_write_text(path: Path, text: str) -> None:
    record_temp(path.parent, f".{path.name}.tmp{os.getpid()}")  # write_text_safe's temp name
    write_text_safe(path, text)


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


# ---- checkpoints ----------------------------------------------------------------------------------


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    if not output_dir.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def save_drafter_dir(drafter, path: Path, state_dict: dict | None = None) -> None:
    """``drafter.save_pretrained``; ``state_dict`` = the full weights when the module holds only a shard.
    Non-finite weights are never written (and so never sealed as good)."""
    import torch

    for name, t in (state_dict if state_dict is not None else drafter.state_dict()).items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"refusing to save {path}: drafter weight {name} holds NaN or Inf values; lower "
                             "training.lr or use training.precision=fp32 and resume from the last good checkpoint")
    with integrity.deferred_seal():  # the checkpoint is sealed once, over all its files, by the caller
        if state_dict is None:
            drafter.save_pretrained(str(path))
        else:
            drafter.save_pretrained(str(path), state_dict=state_dict)


def save_checkpoint(accelerator, drafter, output_dir: Path, state: dict, keep: int,
                    state_dict: dict | None = None, scheduler=None, extra=None) -> Path:
    """Collective (every rank calls it). Writes step-N atomically, repoints `last`, prunes old ones.
    ``state_dict``: the drafter's gathered weights when ZeRO-3 / FSDP shard it (see save_drafter_dir);
    ``scheduler``: the LR scheduler, saved as JSON (accelerate would pickle it); ``extra(dir)``: writes
    more state into the checkpoint (main process, before it is sealed)."""
    step = int(state["step"])
    final = output_dir / f"step-{step}"
    tmp = output_dir / f".tmp-step-{step}"  # same name on every rank: they share the directory
    if accelerator.is_main_process:
        record_temp(output_dir, tmp.name)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    # the main process removes the temp dir when a write fails (e.g. disk full): nothing half-written stays
    with writing(tmp, name=final, remove=accelerator.is_main_process):
        accelerator.save_state(str(tmp / ENGINE_DIR))
        accelerator.wait_for_everyone()  # other ranks may still be writing RNG state / ZeRO shards into tmp
        if accelerator.is_main_process:
            save_drafter_dir(drafter, tmp, state_dict)
            if scheduler is not None:
                (tmp / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            if extra is not None:
                extra(tmp)
            integrity.seal(tmp)
    if accelerator.is_main_process:
        if final.is_symlink():  # never followed: the link goes, what it points to stays
            final.unlink()
        elif final.exists():  # a re-run of the same step (e.g. resumed then preempted again)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _point_last(output_dir, final.name)
        prune_checkpoints(output_dir, keep)
    accelerator.wait_for_everyone()
    return final


def _point_last(output_dir: Path, name: str) -> None:
    link = output_dir / "last"
    tmp = output_dir / f".last.tmp{os.getpid()}"
    record_temp(output_dir, tmp.name)
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)  # relative, so the run dir can be moved
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(tmp, link)


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    ckpts = list_checkpoints(output_dir)
    last = (output_dir / "last").resolve() if (output_dir / "last").is_symlink() else None
    for _, path in ckpts[: max(0, len(ckpts) - keep)]:
        if last is not None and path.resolve() == last:
            continue
        shutil.rmtree(path, ignore_errors=True)


def save_drafter_atomic(drafter, final: Path, state_dict: dict | None = None, extra: dict | None = None) -> Path:
    """Main process only: ``final`` (best/, init/) = loadable drafter weights (+ JSON files ``extra``) + SHA256SUMS,
    written into a temp dir and swapped in atomically."""
    tmp = final.with_name(f".tmp-{final.name}")
    for name in (tmp.name, f".old-{final.name}"):  # swap_in's fallback name
        record_temp(final.parent, name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with writing(tmp, name=final):
        save_drafter_dir(drafter, tmp, state_dict)
        for name, obj in (extra or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2))
        integrity.seal(tmp)
    swap_in(tmp, final)
    return final


def save_best(drafter, output_dir: Path, info: dict, state_dict: dict | None = None) -> Path:
    """Main process only: best/ = loadable drafter weights + best.json, swapped in atomically."""
    return save_drafter_atomic(drafter, output_dir / "best", state_dict, {"best.json": info})


def find_resume_dir(output_dir: Path, resume_from: str) -> Path | None:
    """"" -> None (fresh run); "auto" -> the newest checkpoint in output_dir or None; else that path."""
    if not resume_from:
        return None
    if resume_from == "auto":
        last = output_dir / "last"
        if last.exists() and (last / STATE_FILE).is_file():
            return last.resolve()
        ckpts = [p for _, p in list_checkpoints(output_dir) if (p / STATE_FILE).is_file()]
        return ckpts[-1] if ckpts else None
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"training.resume_from={resume_from!r} is not a checkpoint directory (no {STATE_FILE} in it); "
            f"give a step-N/ or last/ directory of a run, or resume_from=auto to pick the newest in output_dir")
    path = path.resolve()
    later = [p.name for n, p in list_checkpoints(output_dir) if path.parent == output_dir.resolve()
             and n > int(read_state(path).get("step", 0))]
    if later:  # resuming here would overwrite them with a branch of the run
        raise ValueError(f"training.resume_from={resume_from!r}: {output_dir} holds later checkpoints "
                         f"({', '.join(later)}) that this resume would overwrite; resume from the newest "
                         "(training.resume_from=auto) or set a new output_dir")
    return path


def read_state(ckpt: Path) -> dict:
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except ValueError as e:
        raise ValueError(f"{ckpt / STATE_FILE} is not valid JSON ({e}): the checkpoint is damaged; resume from "
                         "another checkpoint of the run or start a fresh run") from None
    if not isinstance(state, dict) or not {"step", "epoch", "step_in_epoch"} <= set(state):
        raise ValueError(f"{ckpt / STATE_FILE} lacks step/epoch/step_in_epoch: not a spectrain trainer state")
    return state


def _check_recipe(ckpt: Path, state: dict, recipe_dict: dict) -> None:
    """Refuse a checkpoint written by a recipe whose training-relevant fields differ, listing them."""
    want = recipe_hash(recipe_dict)
    if state.get("recipe_hash") in (want, recipe_hash(recipe_dict, legacy=True)):
        return
    saved = ckpt.parent / "recipe.yaml"
    detail = ""
    if saved.is_file():
        import yaml

        diffs = _diff(training_fields(yaml.safe_load(saved.read_text())), training_fields(recipe_dict))
        detail = "\n  " + "\n  ".join(diffs[:20]) if diffs else ""
    raise ValueError(
        f"cannot resume from {ckpt}: it was written by a different recipe (hash {state.get('recipe_hash')} "
        f"vs {want}); training-relevant fields differ:{detail or ' (run recipe.yaml not found)'}\n"
        "Resume with the same recipe (only training.max_steps / training.epochs may grow), or start a fresh "
        "run (training.resume_from='' and a new output_dir).")


def load_checkpoint(accelerator, ckpt: Path, recipe_dict: dict, scheduler=None) -> dict:
    """Verify, then restore model/optimizer/RNG through accelerate and the schedule from JSON; return the
    trainer state. Every torch.load accelerate makes meanwhile is forced to ``weights_only=True``."""
    check_files(ckpt, legacy=not (ckpt / SCHEDULER_FILE).is_file())
    state = read_state(ckpt)
    _check_recipe(ckpt, state, recipe_dict)
    if state.get("world_size") != accelerator.num_processes and accelerator.is_main_process:
        print(f"resume: checkpoint was written with {state.get('world_size')} processes, now "
              f"{accelerator.num_processes}; the data order and global batch are unchanged (gradient "
              "accumulation re-derived), but per-rank RNG streams are not carried over exactly.")
    # An older spectrain registered the schedule with accelerate (custom_checkpoint_0.pkl): accelerate reads
    # it this once, as plain data like everything else.
    legacy = scheduler is not None and not (ckpt / SCHEDULER_FILE).is_file()
    load_engine_state(accelerator, ckpt / ENGINE_DIR, scheduler if legacy else None)
    if not legacy and scheduler is not None:
        scheduler.load_state_dict(json.loads((ckpt / SCHEDULER_FILE).read_text()))
    return state


def check_target(ckpt: Path, state: dict, target) -> None:
    """Refuse to resume on another target: the checkpoint's fingerprint (its trainer state, or for an older
    spectrain's checkpoint the run's run_info.json) must name this one."""
    from spectrain.features import same_target, target_fingerprint

    recorded = state.get("target_fingerprint")
    info = ckpt.parent / "run_info.json"
    if recorded is None and info.is_file() and not info.is_symlink():
        try:
            recorded = json.loads(info.read_text()).get("target_fingerprint")
        except ValueError:
            recorded = None
    if same_target(recorded, target) is False:
        raise ValueError(f"cannot resume from {ckpt}: it was trained on another target (fingerprint {recorded}; "
                         f"{target.name_or_path!r} has {target_fingerprint(target)}: its config or weights differ); "
                         "resume with the run's own target, or start a fresh run (a new output_dir)")


def resume(accelerator, output_dir: Path, resume_from: str, recipe_dict: dict, metrics_path: Path,
           scheduler=None, target=None) -> dict | None:
    """Apply training.resume_from: restore everything and return the trainer state, or None (fresh run)."""
    if accelerator.is_main_process:
        gone = remove_leftovers(output_dir)
        if gone:
            print(f"removed leftovers of an interrupted save in {output_dir}: {', '.join(sorted(gone))}")
    path = find_resume_dir(output_dir, resume_from)
    if path is None:
        if not resume_from and list_checkpoints(output_dir):
            raise ValueError(f"output_dir {output_dir} already holds checkpoints of a run: continue it with "
                             "training.resume_from=auto, or choose a new output_dir")
        if accelerator.is_main_process:
            if resume_from == "auto":
                print(f"resume=auto: no checkpoint in {output_dir}; starting fresh")
            truncate_metrics(metrics_path, 0)  # records of an attempt that died before its first checkpoint
        return None
    state = load_checkpoint(accelerator, path, recipe_dict, scheduler)
    state["checkpoint_dir"] = str(path)  # where extra state (e.g. the on-policy snapshot) is read from
    if target is not None:
        check_target(path, state, target)
    accelerator.step = 0  # accelerate's micro-step counter: we always stop at an optimizer-step boundary
    if accelerator.is_main_process:
        truncate_metrics(metrics_path, state["step"])
        print(f"resumed from {path} at step {state['step']} (epoch {state['epoch']}, step {state['step_in_epoch']} "
              "in the epoch)")
    return state


class Preemption:
    """SIGTERM / SIGINT set ``.signal``; the loop checkpoints at the end of the step and exits.
    A second signal while one is pending raises KeyboardInterrupt (stop now, no checkpoint)."""

    def __init__(self):
        import threading

        self.signal: int | None = None
        self._prev: dict = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._prev = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum

    def restore(self) -> None:
        for s, h in self._prev.items():
            signal.signal(s, h)
        self._prev = {}
