"""On-policy distillation for the separate draft model (``training.on_policy``, DistillSpec / TRL GKD style).

For a ``fraction`` of the optimizer steps the loop replaces every micro-batch of fixed rows by rollouts:

1. prompt = each row's tokens up to its first trained (assistant) token (the whole row when none is);
2. the student samples ``max_new_tokens`` tokens (or up to an eos) at ``temperature`` (0 = greedy),
   from itself (``refresh_every: 1``) or from a snapshot of itself refreshed every N optimizer steps;
3. the new rows are prompt + continuation with the loss mask on the continuation; the frozen target
   scores them in the step's usual feature pass, and the student's ``train_loss`` pulls its distribution
   towards the target's at every generated position with ``drafter.loss`` (fkl / rkl / jsd / tvd ...).

Which steps roll out is a pure function of the step (evenly spaced: step s is on-policy iff
floor((s+1) f) > floor(s f)), the same on every rank. The sampling RNG of a micro-batch is seeded from
(training.seed, step, global micro-batch index), so the rollouts depend on the checkpointed step alone: a
resumed run samples exactly what the uninterrupted one did, and 1 process with gradient accumulation
samples what N DDP ranks do (each rank rolls out its own micro-batches, its shard). The one piece of state,
the snapshot when refresh_every > 1, is saved in every checkpoint (``on_policy_sampler.safetensors``).
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from spectrain import registry
from spectrain.data.dataset import collate
from spectrain.decoding.left_padded import left_padded_decode
from spectrain.decoding.sampling import Sampler
from spectrain.decoding.step import resolve_eos
from spectrain.train.sources import target_features

SNAPSHOT_FILE = "on_policy_sampler.safetensors"


def is_on_policy_step(step: int, fraction: float) -> bool:
    """Step `step` (0-based) of a run with ``training.on_policy.fraction`` rolls out (evenly spaced)."""
    return math.floor((step + 1) * fraction + 1e-9) > math.floor(step * fraction + 1e-9)


def prompt_of(row: dict) -> list[int]:
    """The row's tokens before its first trained token (at least one token)."""
    ids, lm = torch.as_tensor(row["input_ids"]), torch.as_tensor(row["loss_mask"]).bool()
    first = int(lm.nonzero()[0]) if lm.any() else len(ids)
    return ids[: max(first, 1)].tolist()


def sample_continuations(model, prompts: list[list[int]], max_new: int, sampler: Sampler, vocab: int,
                         eos: set[int], pad_id: int) -> list[list[int]]:
    """Batched sampling with a KV cache: prompts left-padded (position ids count real tokens only, so a row
    sees exactly what it would alone); each continuation ends at its first eos (kept) or at max_new tokens."""
    new, done = [[] for _ in prompts], [False] * len(prompts)

    def forward(ids, am, pos, cache):
        return model(input_ids=ids, attention_mask=am, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]

    def pick(logits):
        # sampled on the CPU with the CPU generator: the same draws on every device
        x = sampler.sample(sampler.probs(logits[:, :vocab].float().cpu()))
        for r, tok in enumerate(x.tolist()):
            if not done[r]:
                new[r].append(tok)
                done[r] = tok in eos
        return None if all(done) else x

    left_padded_decode(forward, prompts, pad_id, max_new, pick, model.get_input_embeddings().weight.device)
    return new


class OnPolicy:
    """The loop's hook: ``batch(run, indices, micro_index)`` -> (batch, feats) of rollouts for on-policy steps."""

    generates = True  # the loop logs gen_s / gen_tokens / gen_frac

    def __init__(self, cfg, seed: int, target, pad_id: int):
        self.cfg, self.seed, self.target, self.pad_id = cfg, seed, target, pad_id

        self.eos = resolve_eos(target, None)
        self.snapshot, self._window = None, -1  # refresh_every > 1: the student copy that samples, its window
        self.gen_s, self.gen_tokens = 0.0, 0  # this step's generation time / generated tokens (this rank)

    def active(self, step: int) -> bool:
        return is_on_policy_step(step, self.cfg.fraction)

    def seed_for(self, step: int, micro_index: int) -> int:
        """The rollout RNG seed of global micro-batch `micro_index` at `step`: nothing else to checkpoint."""
        return (self.seed * 1_000_003 + step) * 10_007 + micro_index

    def begin_step(self, run) -> None:
        self.gen_s, self.gen_tokens = 0.0, 0
        step, n = run.state.step, self.cfg.refresh_every
        # refresh_every > 1: one snapshot per window of n steps, taken at the window's first on-policy step
        if n > 1 and self.active(step) and (self.snapshot is None or self._window != step // n):
            self.snapshot = copy.deepcopy(student(run)).eval().requires_grad_(False)
            self._window = step // n

    def batch(self, run, indices: list[int], micro_index: int) -> tuple[dict, dict]:
        rows = run.train_src.token_rows(indices)
        prompts = [prompt_of(r) for r in rows]
        g = torch.Generator().manual_seed(self.seed_for(run.state.step, micro_index))
        model = self.snapshot if self.snapshot is not None else student(run)
        t0, was_training = time.perf_counter(), model.training
        model.eval()  # no dropout while sampling: the rollout is the policy that decoding would run
        try:
            with run.acc.autocast() if run.acc.device.type != "cpu" else nullcontext():
                new = sample_continuations(model, prompts, self.cfg.max_new_tokens,
                                           Sampler(temperature=self.cfg.temperature, generator=g),
                                           self.target.vocab_size, self.eos, self.pad_id)
        finally:
            model.train(was_training)
        self.gen_s += time.perf_counter() - t0
        self.gen_tokens += sum(len(c) for c in new)
        made = [{"input_ids": torch.tensor(p + c), "loss_mask": torch.tensor([0] * len(p) + [1] * len(c))}
                for p, c in zip(prompts, new)]
        batch = {k: v.to(run.acc.device) for k, v in collate(made, self.pad_id).items()}
        return batch, target_features(self.target, batch, run.train_src.spec)

    # ---- checkpoint state (only the snapshot; everything else follows from the step) --------------------
    def save(self, path: Path) -> None:
        if self.snapshot is not None:
            save_model(self.snapshot, str(path / SNAPSHOT_FILE), metadata={"window": str(self._window)})

    def restore(self, run, ckpt_dir: Path) -> None:
        f = Path(ckpt_dir) / SNAPSHOT_FILE
        if self.cfg.refresh_every > 1 and f.is_file():
            self.snapshot = copy.deepcopy(student(run)).eval().requires_grad_(False)
            load_model(self.snapshot, str(f), device=str(run.acc.device))
            with safe_open(str(f), "pt") as h:
                self._window = int(h.metadata()["window"])


def student(run):
    """The plain HF model of the run's DraftStudent (unwrapped: sampling must not run DDP hooks)."""
    return run.acc.unwrap_model(run.model).drafter.model


class RolloutSteps(OnPolicy):
    """drafter.eagle3.rollout's hook: a rollout step's batches are the fixed rows, marked with the seed of the
    head's rollout (the drafting and the target's verification pass run inside Eagle3Head.train_loss)."""

    generates = False

    def begin_step(self, run) -> None:
        self.gen_s, self.gen_tokens = 0.0, 0

    def batch(self, run, indices: list[int], micro_index: int) -> tuple[dict, dict]:
        batch, feats = run.train_src.get(indices)
        batch["rollout_seed"] = self.seed_for(run.state.step, micro_index)
        return batch, feats

    def save(self, path: Path) -> None:
        pass  # no state: the seed follows from the step

    def restore(self, run, ckpt_dir: Path) -> None:
        pass


def make(recipe, target, pad_id: int) -> OnPolicy | None:
    """The hook for ``training.on_policy`` or ``drafter.eagle3.rollout`` (None when both are off)."""
    op, ro = recipe.training.on_policy, recipe.drafter.eagle3.rollout
    if registry.supports(recipe.drafter.kind, "rollout") and ro.fraction > 0:
        return RolloutSteps(ro, recipe.training.seed, target, pad_id)
    return OnPolicy(op, recipe.training.seed, target, pad_id) if op.fraction > 0 else None
