"""ONE explicit training loop for every drafter family, on Hugging Face accelerate.

    spectrain train recipes/tiny/eagle3.yaml [a.b=value ...]
    accelerate launch [--config_file recipes/accelerate/X.yaml] -m spectrain train RECIPE [a.b=value ...]

Read top to bottom: ``train`` builds the accelerator, the frozen target, the data, the drafter, the
optimizer and the schedule; then every optimizer step is

    global batch -> this rank's micro-batches (on rollout steps: the hook's rollouts, spectrain/train/on_policy.py)
    -> target features (no grad) -> drafter loss
    -> backward (accumulated; synced on the last micro-batch) -> clip -> AdamW + schedule
    -> metrics -> held-out eval / checkpoint / preemption check.

Data order: one seeded permutation of the whole dataset per epoch. Optimizer step s of an epoch
takes rows perm[s*B:(s+1)*B] (B = global batch), sorts them by length (less padding), cuts them into
micro-batches and deals micro-batch j to rank j % world. Ranks never duplicate a row, the global
batch does not depend on the world size, and (epoch, step in epoch) is all a checkpoint needs to
restore the data position exactly. The trailing partial global batch of an epoch is dropped.

A drafter family's trained module is a ``TrainableHead`` (spectrain/registry.py): ``from_recipe(recipe, target,
token_counts)``, ``feature_spec()``,
``train_loss(batch, feats, target) -> (loss, metrics)`` (metrics with ``acc_i`` per step and
``sim_tau``) and ``save_pretrained(path, state_dict=None)`` (state_dict: the full weights, gathered by
the loop when ZeRO-3 / FSDP shard the module); its record is in spectrain/registry.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate.utils import gather_object
from torch import nn
from tqdm.auto import tqdm

from spectrain.data.packing import pack_rows
from spectrain.recipe.load import load_recipe
from spectrain.targets.fingerprint import target_fingerprint
from spectrain.train import checkpoint as ckpt
from spectrain.train import run_dir
from spectrain.train.distributed import (  # noqa: F401  (make_accelerator, resolve_*: re-exported for tests and scripts)
    full_state_dict,
    is_sharded,
    make_accelerator,
    malloc_setting,
    resolve_num_threads,
    resolve_precision,
)
from spectrain.train.metrics import _all_ranks, _pool, _sum_ranks, aggregate
from spectrain.train.plan import require_train_disk
from spectrain.train.schedule import epoch_order, lr_factor, rank_micro_batches
from spectrain.train.setup import LoopState, Run, setup
from spectrain.train.sources import OnlineSource  # noqa: F401  (re-exported: tests/test_distributed.py records its rows)


class TrainingDiverged(ValueError):
    """Too many consecutive non-finite losses (a ValueError so the CLI prints it as one line)."""


def save_drafter(run, write: Callable[[nn.Module, dict | None], None]) -> None:
    """Collective (every rank calls it): under ZeRO-3 / FSDP the drafter's weights are sharded, so every
    rank takes part in gathering them; the main process then writes ``write(drafter, state_dict)``
    (state_dict None = unsharded: save from the module itself)."""
    drafter = run.acc.unwrap_model(run.model).drafter
    sd = full_state_dict(drafter) if is_sharded(drafter) else None
    if run.acc.is_main_process:
        write(drafter, sd)


# ---- one optimizer step ----------------------------------------------------------------------------


def step_micro_batches(run) -> list[list[int]]:
    """This rank's micro-batches for the current (epoch, step in epoch): a pure function of the position."""
    st, t, acc = run.state, run.recipe.training, run.acc
    if run.order_cache[0] != st.epoch:
        run.order_cache = (st.epoch, epoch_order(len(run.train_src), t.seed, st.epoch))
    b = t.global_batch_size
    rows = run.order_cache[1][st.step_in_epoch * b:(st.step_in_epoch + 1) * b]
    lengths = [run.train_src.lengths[i] for i in rows]
    return rank_micro_batches(rows, lengths, t.micro_batch_size, acc.process_index, acc.num_processes)


def _non_finite_weight(module: nn.Module) -> str | None:
    """The first trainable weight holding NaN / Inf (None: all finite)."""
    return next((n for n, p in module.named_parameters() if p.requires_grad and p.numel()
                 and not bool(torch.isfinite(p.detach()).all())), None)


def train_step(run) -> dict:
    acc, t, st = run.acc, run.recipe.training, run.state
    losses, parts, tokens, finite = [], [], 0, True
    op = run.on_policy if run.on_policy is not None and run.on_policy.active(st.step) else None
    if op is not None:
        op.begin_step(run)
    for j, mb in enumerate(step_micro_batches(run)):
        # on-policy steps: the student's rollouts of these rows' prompts (j: the global micro-batch index)
        batch, feats = op.batch(run, mb, acc.process_index + j * acc.num_processes) if op else run.train_src.get(mb)
        if t.packing:  # one row of real tokens per micro-batch, attention masked per document
            batch, feats = pack_rows(batch, feats)
        tokens += int(batch["attention_mask"].sum())
        with acc.accumulate(run.model):
            with acc.autocast():
                loss, metrics = run.model(batch, feats)
            # Agreed across ranks before backward: a rank skipping a synced backward would hang the others.
            finite = finite and not _all_ranks(acc, not bool(torch.isfinite(loss.detach()).all()))
            if finite:
                acc.backward(loss)
        losses.append(float(loss.detach()))
        parts.append(({k: float(v) for k, v in metrics.items() if k != "loss"},
                      float(metrics.get("tokens", batch["loss_mask"].sum()))))
    rec = _pool(acc, losses, parts)
    if finite:
        norm = acc.clip_grad_norm_(run.model.parameters(), t.grad_clip) if t.grad_clip > 0 else None
        run.opt.step()
        bad = _non_finite_weight(run.drafter)
        if _all_ranks(acc, bad is not None):  # sharded (ZeRO-3 / FSDP): each rank checks its shard
            raise TrainingDiverged(
                f"step {st.step + 1}: the update made the drafter's weights non-finite ({bad or 'on another rank'}; "
                f"training.lr={t.lr}): the run stops and nothing of this step is saved; lower training.lr or use "
                "training.precision=fp32, then resume from the last checkpoint (training.resume_from=auto)")
        st.nan_streak = 0
        if norm is not None:
            rec["grad_norm"] = float(norm)
    else:
        st.nan_streak += 1
        limit = max(1, t.max_nan_steps)
        if st.nan_streak >= limit:
            raise TrainingDiverged(
                f"non-finite loss for {st.nan_streak} consecutive steps (training.max_nan_steps={t.max_nan_steps}) "
                f"at step {st.step + 1}: lower training.lr, use training.precision=fp32, or check the data")
        warnings.warn(f"step {st.step + 1}: non-finite loss {losses}; update skipped "
                      f"({st.nan_streak}/{limit} in a row before stopping)", stacklevel=2)
        rec["skipped"] = 1
    run.opt.zero_grad(set_to_none=True)
    rec["lr"] = run.sched.get_last_lr()[0]
    with warnings.catch_warnings():  # torch warns when a skipped step leaves optimizer.step() uncalled
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        run.sched.step()  # also on a skipped step, so lr, step count and data position stay aligned
    rec["tokens"] = _sum_ranks(acc, tokens)
    if run.on_policy is not None:  # 1 on rollout steps; this rank's generation time, tokens of all ranks
        rec["on_policy"] = float(op is not None)
        if run.on_policy.generates:
            rec["gen_s"], rec["gen_tokens"] = (op.gen_s, _sum_ranks(acc, op.gen_tokens)) if op else (0.0, 0.0)
    st.step += 1
    st.step_in_epoch += 1
    if st.step_in_epoch >= run.steps_per_epoch:
        st.epoch, st.step_in_epoch = st.epoch + 1, 0
    return rec


# ---- evaluation, logging, checkpoints -----------------------------------------------------------


@torch.no_grad()
def evaluate(run) -> dict | None:
    """Held-out split: per-step acc, conditional acc and the simulated-tau PROXY (greedy, +1 bonus)."""
    if run.held_src is None:
        return None
    acc, src = run.acc, run.held_src
    module = acc.unwrap_model(run.model)  # plain module: no DDP collectives in a ragged eval loop
    idx = sorted(range(acc.process_index, len(src), acc.num_processes), key=lambda i: src.lengths[i])
    micro, parts = run.recipe.training.micro_batch_size, []
    # Every rank runs the same number of forwards: under ZeRO-3 each one is collective (weight gathers).
    n_batches = math.ceil(math.ceil(len(src) / acc.num_processes) / micro)
    run.drafter.eval()
    try:
        for i in range(0, n_batches * micro, micro):
            rows = idx[i:i + micro]
            batch, feats = src.get(rows or [0])  # a rank with no rows left runs a filler batch, discarded
            with acc.autocast():
                loss, metrics = module(batch, feats)
            if not rows:
                continue
            m = {k: float(v) for k, v in metrics.items()}
            m["loss"] = float(loss)
            parts.append((m, float(metrics.get("tokens", batch["loss_mask"].sum()))))
    finally:
        run.drafter.train()
    if acc.num_processes > 1:
        parts = gather_object(parts)
    agg = aggregate(parts)
    rec = {"step": run.state.step, "split": "heldout", "heldout_rows": len(src)}
    rec.update({f"eval/{k}": v for k, v in agg.items() if k != "sim_tau"})
    rec["eval/sim_tau_proxy"] = agg.get("sim_tau")
    return rec


def log(run, rec: dict) -> None:
    run_dir.append_metrics(run.acc, run.metrics_path, rec)


def maybe_best(run, ev: dict | None) -> None:
    tau = ev and ev.get("eval/sim_tau_proxy")
    if tau is None:
        if ev is not None:
            raise ValueError(f"{type(run.drafter).__name__}.train_loss reports no acc_i/sim_tau metrics; "
                             "best/ is chosen by held-out simulated tau, so the family must report them")
        return
    best = run.state.best_sim_tau
    if best is None or tau > best:
        run.state.best_sim_tau, run.state.best_step = tau, run.state.step
        info = {"step": run.state.step, "sim_tau_proxy": tau,
                "criterion": "held-out simulated tau (greedy teacher-forced proxy, +1 bonus)",
                **{k: v for k, v in ev.items() if k.startswith("eval/")}}
        save_drafter(run, lambda d, sd: ckpt.save_best(d, run.out, info, sd))


def save(run) -> Path:
    state = dict(dataclasses.asdict(run.state), recipe_hash=run_dir.recipe_hash(run.recipe.to_dict()),
                 world_size=run.acc.num_processes, total_steps=run.total,
                 target_fingerprint=target_fingerprint(run.target))  # resume refuses another target
    drafter = run.acc.unwrap_model(run.model).drafter
    sd = full_state_dict(drafter) if is_sharded(drafter) else None  # collective
    return ckpt.save_checkpoint(run.acc, drafter, run.out, state, run.recipe.training.keep_checkpoints,
                                state_dict=sd, scheduler=run.sched,
                                extra=run.on_policy.save if run.on_policy is not None else None)


def extend(run, saved: dict) -> None:
    """A resume whose training.max_steps / epochs changed the run's length. It may grow (the run goes on);
    the LR schedule is then the one of the new length, from the resumed step on (docs/reliability.md, "Extending a finished run")."""
    old = saved.get("total_steps", run.total)
    if run.total < saved["step"]:
        raise ValueError(f"the recipe now stops at step {run.total} but the checkpoint is at step {saved['step']}: "
                         "a resume can only keep or grow the run's length (training.max_steps / training.epochs)")
    if run.total == old:
        return
    t = run.recipe.training
    for group, base in zip(run.opt.param_groups, run.sched.base_lrs):  # the step about to run, on the new curve
        group["lr"] = base * lr_factor(saved["step"], t.schedule, t.warmup_steps, run.total)
    run.sched._last_lr = [g["lr"] for g in run.opt.param_groups]
    if run.acc.is_main_process:
        print(f"resume: the run's length changed from {old} to {run.total} steps; the {t.schedule} LR schedule "
              f"continues on the curve of the new length from step {saved['step']} (lr now "
              f"{run.opt.param_groups[0]['lr']:.3g})")


# ---- the loop ----------------------------------------------------------------------------------------


def train(recipe, target=None, train_rows=None, heldout_rows=None,
          on_step: Callable[[Run, dict], None] | None = None) -> dict:
    """Train `recipe`'s drafter; returns a summary. target/rows may be passed in (tests, notebooks).
    ``output_dir`` is checked and locked first (spectrain/io/outputs.py): nothing is written before."""
    malloc_setting()  # a mistyped $SPECTRAIN_MALLOC is refused before the run directory is touched
    with run_dir.claim_run_dir(recipe):
        return _train(recipe, target, train_rows, heldout_rows, on_step)


def _train(recipe, target, train_rows, heldout_rows, on_step) -> dict:
    run = setup(recipe, target, train_rows, heldout_rows)
    acc, t = run.acc, recipe.training

    n = lambda ps: sum(getattr(p, "ds_numel", p.numel()) for p in ps)  # noqa: E731 (ZeRO-3: the full size)
    require_train_disk(run.out, n(run.drafter.parameters()), n(run.params),
                       t.keep_checkpoints)
    saved = ckpt.resume(acc, run.out, t.resume_from, recipe.to_dict(), run.metrics_path, run.sched, run.target)
    if saved is not None:
        run.state = LoopState(**{f.name: saved[f.name] for f in dataclasses.fields(LoopState)})
        extend(run, saved)
        if run.on_policy is not None:
            run.on_policy.restore(run, saved["checkpoint_dir"])
    else:
        # the untrained head: the baseline a report compares the trained one against
        save_drafter(run, lambda d, sd: ckpt.save_drafter_atomic(d, run.out / "init", sd))

    run_dir.start_run(acc, recipe, {"target_fingerprint": target_fingerprint(run.target),
                                 "total_steps": run.total, "steps_per_epoch": run.steps_per_epoch,
                                 "grad_accum": acc.gradient_accumulation_steps,
                                 "mixed_precision": str(acc.mixed_precision), "resumed_at_step": run.state.step})
    preempt = ckpt.Preemption()
    bar = tqdm(total=run.total, initial=run.state.step, disable=not acc.is_main_process, dynamic_ncols=True,
               desc=f"train {recipe.drafter.kind}")
    start, t0, ev, saved_at = run.state.step, time.perf_counter(), None, None
    try:
        while run.state.step < run.total:
            ts = time.perf_counter()
            rec = train_step(run)
            dt = max(time.perf_counter() - ts, 1e-9)
            rec = {"step": run.state.step, "epoch": run.state.epoch, **rec, "tokens_per_s": rec["tokens"] / dt,
                   **({"gen_frac": rec["gen_s"] / dt} if "gen_s" in rec else {})}  # share of the step spent sampling
            log(run, rec)
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec.get('acc_0', float('nan')):.2f}")
            if on_step is not None:
                on_step(run, rec)
            step, done = run.state.step, run.state.step >= run.total
            if (t.eval_every and step % t.eval_every == 0) or done:
                ev = evaluate(run)
                if ev is not None:
                    log(run, ev)
                if ev is not None and acc.is_main_process:  # tqdm.write prints on every rank
                    bar.write(f"step {step}: held-out sim_tau (proxy) {ev['eval/sim_tau_proxy']:.3f}  "
                              f"acc_0 {ev.get('eval/acc_0', float('nan')):.3f}")
                maybe_best(run, ev)
            stop = _all_ranks(acc, preempt.signal is not None)
            if (t.checkpoint_every and step % t.checkpoint_every == 0) or done or stop:
                saved_at = save(run)
            if stop:
                run.stop_signal = preempt.signal or "peer"  # "peer": another rank was signalled
                break
    finally:
        bar.close()
        preempt.restore()
    wall = time.perf_counter() - t0
    if run.state.best_sim_tau is None and run.stop_signal is None:
        info = {"step": run.state.step, "criterion": "final weights (no held-out split to choose by)"}
        save_drafter(run, lambda d, sd: ckpt.save_best(d, run.out, info, sd))
    summary = {"step": run.state.step, "total_steps": run.total, "steps_this_run": run.state.step - start,
               "wall_s": wall, "interrupted_by": run.stop_signal, "checkpoint": str(saved_at) if saved_at else None,
               "best_sim_tau_proxy": run.state.best_sim_tau, "best_step": run.state.best_step,
               "last_eval": ev, "output_dir": str(run.out)}
    if acc.is_main_process:
        log(run, {"step": run.state.step, "event": "end", "wall_s": wall,
                  "interrupted_by": run.stop_signal})
    acc.end_training()
    return summary


def main(recipe_path: str, overrides: list[str] | None = None) -> int:
    """`spectrain train RECIPE [a.b=value ...]`. 0 = done; 128+signal = stopped by SIGTERM/SIGINT after
    writing a checkpoint (resume with training.resume_from=auto)."""
    recipe = load_recipe(recipe_path, list(overrides or []))
    summary = train(recipe)
    if summary["interrupted_by"] is not None:
        print(f"stopped by signal {summary['interrupted_by']} at step {summary['step']}/{summary['total_steps']}; "
              f"checkpoint {summary['checkpoint']}. Resume: spectrain train {recipe_path} "
              f"{' '.join(overrides or [])} training.resume_from=auto".rstrip(), file=sys.stderr)
        sig = summary["interrupted_by"]
        return 128 + (int(sig) if isinstance(sig, int) else 15)
    tau = summary["best_sim_tau_proxy"]
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # one summary per run, from rank 0
    print(f"done: {summary['step']} steps in {summary['wall_s']:.0f}s; best held-out sim_tau (proxy) "
          f"{'n/a' if tau is None else f'{tau:.3f}'} at step {summary['best_step']}; run dir {summary['output_dir']}")
    return 0
