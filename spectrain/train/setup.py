"""Building a run, once, before the first step: threads, the accelerator, the frozen target (sharded under
ZeRO-3 / FSDP), the data sources, the drafter from its family record, the optimizer and the schedule;
everything the loop then touches is one Run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, set_seed
from torch import nn

from spectrain import registry
from spectrain.data.dataset import build_dataset, token_frequencies
from spectrain.data.features import _pad_id
from spectrain.targets.model import gathered
from spectrain.train import on_policy
from spectrain.train.distributed import (
    keep_freed_memory,
    load_target_for,
    make_accelerator,
    resolve_num_threads,
    shard_target,
    shard_target_fsdp,
    zero3,
)
from spectrain.train.schedule import build_optimizer, lr_factor
from spectrain.train.sources import make_sources, require_feature_cache


def drafter_class(kind: str) -> type:
    """The trained module class of a family (spectrain/registry.py)."""
    if kind in registry.TRAINING_FREE:
        raise ValueError(f"drafter.kind={kind} is training-free: evaluate it directly with "
                         f"`spectrain eval --drafter {kind}`; there is nothing to train")
    return registry.resolve(registry.family(kind).train.head)


class _LossModule(nn.Module):
    """Routes ``drafter.train_loss`` through ``forward`` so DDP / FSDP / DeepSpeed hooks see the call."""

    def __init__(self, drafter: nn.Module, target):
        super().__init__()
        self.drafter = drafter
        self._target = (target,)  # a tuple keeps the frozen target out of the module tree and state dict

    def forward(self, batch: dict, feats: dict):
        return self.drafter.train_loss(batch, feats, self._target[0])


@dataclass
class LoopState:
    """Where the loop stands: what a checkpoint's trainer_state.json restores (with these names)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0  # the data position within the epoch (spectrain/train/schedule.py)
    best_sim_tau: float | None = None  # the best held-out sim_tau proxy so far (best/ holds its weights)
    best_step: int | None = None
    nan_streak: int = 0  # consecutive non-finite losses (training.max_nan_steps)

    def __getitem__(self, key: str):  # run.state["step"]: the dict the state was before, for older callers
        return getattr(self, key)


@dataclass
class Run:
    """Everything the loop touches, built once by ``setup``; ``state`` is what a checkpoint saves and restores."""

    acc: Any  # the accelerate Accelerator
    recipe: Any
    target: Any
    drafter: nn.Module
    model: nn.Module  # the drafter's loss module as accelerate prepared it (DDP / FSDP / DeepSpeed)
    opt: torch.optim.Optimizer
    sched: Any
    on_policy: Any  # the rollout hook (training.on_policy / drafter.eagle3.rollout) or None
    params: list
    train_src: Any
    held_src: Any
    out: Path
    total: int  # optimizer steps of the run
    steps_per_epoch: int
    metrics_path: Path
    state: LoopState = field(default_factory=lambda: LoopState())
    stop_signal: str | None = None
    order_cache: tuple = (-1, [])  # (epoch, its seeded row order)


def setup(recipe, target=None, train_rows=None, heldout_rows=None) -> Run:
    t = recipe.training
    torch.set_num_threads(resolve_num_threads(t.num_threads))
    acc = make_accelerator(recipe)
    if acc.device.type == "cpu":
        torch.set_flush_denormal(True)  # tiny Adam/grad values as denormals make CPU kernels crawl
        keep_freed_memory()  # $SPECTRAIN_MALLOC=keep: reuse freed logit buffers instead of re-faulting them
    set_seed(t.seed)
    if target is None:
        target = load_target_for(recipe, acc)
    if zero3(acc):
        shard_target(target)
    require_feature_cache(recipe)
    if train_rows is None:  # offline too: the feature cache must hold exactly these rows (FeatureCache.match)
        with acc.main_process_first():  # rank 0 tokenises and caches; the others read the cache
            train_rows = build_dataset(recipe.data, target.tokenizer, "train", verbose=acc.is_main_process)
            heldout_rows = build_dataset(recipe.data, target.tokenizer, "heldout", verbose=acc.is_main_process)
    drafter_class(recipe.drafter.kind)  # an unknown or training-free kind fails before the data is read
    train_src, held_src = make_sources(recipe, target, train_rows, heldout_rows, acc.device)
    counts = train_src.token_frequencies() if t.features == "offline" else \
        token_frequencies(train_rows, target.vocab_size)
    set_seed(t.seed)  # the drafter init must not depend on how much RNG the data loading used
    with gathered([p for m in (target.embed_tokens, target.lm_head, target.norm) for p in m.parameters()]):
        drafter = registry.build_head(recipe.drafter.kind, recipe, target, counts).to(acc.device)  # (Medusa copies the lm_head)

    if acc.distributed_type == DistributedType.FSDP:
        shard_target_fsdp(target, acc.device.type)  # after the drafter copied what it needs
    drafter.train()
    for src in (train_src, held_src):
        if src is not None:
            src.bind(drafter.feature_spec())
    opt, params = build_optimizer(recipe, drafter, target)
    steps_per_epoch = len(train_src) // t.global_batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"the train split has {len(train_src)} rows, fewer than training.global_batch_size="
                         f"{t.global_batch_size}; lower the batch size or add data")
    total = t.max_steps if t.max_steps > 0 else t.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t.schedule, t.warmup_steps, total))
    # The schedule is saved as JSON by spectrain.train.checkpoint, not registered with accelerate (which pickles it).
    model, opt = acc.prepare(_LossModule(drafter, target), opt)
    out = Path(recipe.output_dir)
    return Run(acc=acc, recipe=recipe, target=target, drafter=drafter, model=model, opt=opt, sched=sched,
               on_policy=_on_policy_hook(recipe, acc, target),
               params=params, train_src=train_src, held_src=held_src, out=out, total=total,
               steps_per_epoch=steps_per_epoch, metrics_path=out / "metrics.jsonl")


def _on_policy_hook(recipe, acc, target):
    """The rollout hook of training.on_policy or drafter.eagle3.rollout (spectrain/train/on_policy.py), or None."""
    if recipe.training.on_policy.fraction > 0 and (zero3(acc) or acc.distributed_type == DistributedType.FSDP):
        raise ValueError("training.on_policy runs single-process or DDP: under ZeRO-3 / FSDP the student's weights "
                         "are sharded and sampling would need a collective per token; use DDP or ZeRO-1/2")

    return on_policy.make(recipe, target, _pad_id(target))
