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
saved by the backend that owns them, not by home-made code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
from pathlib import Path

import torch
import yaml

from spectrain.io import integrity
from spectrain.io.errors import writing
from spectrain.io.outputs import (
    record_temp,
    remove_leftovers,
    swap_in,
)
from spectrain.io.safe_resume import check_files, load_engine_state
from spectrain.targets.fingerprint import same_target, target_fingerprint
from spectrain.train.run_dir import _diff, recipe_hash, training_fields, truncate_metrics

STATE_FILE = "trainer_state.json"
ENGINE_DIR = "accelerate"
SCHEDULER_FILE = "scheduler.json"
_STEP_RE = re.compile(r"^step-(\d+)$")


# ---- checkpoints ----------------------------------------------------------------------------------


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    if not output_dir.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def save_drafter_dir(drafter, path: Path, state_dict: dict | None = None) -> None:
    """``drafter.save_pretrained``; ``state_dict`` = the full weights when the module holds only a shard.
    Non-finite weights are never written (and so never sealed as good)."""
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
