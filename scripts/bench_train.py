"""Training throughput: EAGLE-3 steps (online and offline features) vs a plain target forward, same batches.

Usage (from the repository root):

    python scripts/bench_train.py recipes/tiny/eagle3.yaml                  # CPU, reference target
    python scripts/bench_train.py recipes/tiny/eagle3.yaml --batches 6 --threads 2 --json /tmp/bench.json
    python scripts/bench_train.py recipes/eagle3.yaml --batches 20          # a GPU and the 8B target

Every variant runs over the SAME micro-batches (the loop's first global batches, length-sorted), after
one warm-up batch, with the recipe's precision (bf16 autocast on CUDA, fp32 on CPU):

- target forward: a plain ``model(input_ids)`` with logits, what a serving step of the target costs;
- online step:    target features (hooks, no logits) + draft TTT forward + backward + AdamW;
- offline step:   features read back from bf16 tensors on the host (what the offline cache stores)
                  + the same draft work: the target forward drops out, the teacher logits are
                  rebuilt from the stored last hidden state with the frozen norm + lm_head;
- packed:         the same steps with ``training.packing`` (each micro-batch's real tokens in one row,
                  TTT attention per document: spectrain/data/packing.py); the padding share is printed;
- per TTT step:   draft forward+backward time of ttt_steps=K minus ttt_steps=1, over K-1.

``--repeats R`` runs every variant R times, interleaved, and reports each phase's median round.
Threads: ``--threads``, else what ``training.num_threads=0`` picks (``engine.resolve_num_threads``).

Not a test; prints a table (and writes JSON with --json) for docs/training.md (stored under eval/reference/).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from spectrain.train import loop as T
from spectrain.train import schedule as S
from spectrain.train.setup import drafter_class


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


class Clock:
    """Accumulates wall time per named phase (device-synchronised); with cpu=True the process's CPU
    time instead, which a shared host's load barely moves (use it with --threads 1 on CPU)."""

    def __init__(self, device, cpu: bool = False):
        self.device, self.t, self.now = device, {}, time.process_time if cpu else time.perf_counter

    def __call__(self, name: str):
        clock = self

        class _Ctx:
            def __enter__(self):
                _sync(clock.device)
                self.t0 = clock.now()

            def __exit__(self, *exc):
                _sync(clock.device)
                clock.t[name] = clock.t.get(name, 0.0) + clock.now() - self.t0

        return _Ctx()


def build(recipe_path: str, overrides: list[str], n_batches: int):
    from spectrain.data.dataset import build_dataset, token_frequencies
    from spectrain.data.features import _pad_id
    from spectrain.recipe.load import load_recipe
    from spectrain.targets.model import load_target

    recipe = load_recipe(recipe_path, overrides)
    target = load_target(recipe.target.name_or_path, dtype=recipe.target.dtype,
                         trust_remote_code=recipe.target.trust_remote_code)
    rows = build_dataset(recipe.data, target.tokenizer, "train")
    t = recipe.training
    order = S.epoch_order(len(rows), t.seed, 0)
    batches: list[list[int]] = []
    for s in range(0, len(order), t.global_batch_size):
        g = order[s:s + t.global_batch_size]
        batches += S.rank_micro_batches(g, [int(rows.lengths[i]) for i in g], t.micro_batch_size, 0, 1)
        if len(batches) > n_batches:
            break
    torch.manual_seed(t.seed)
    drafter = drafter_class(recipe.drafter.kind).from_recipe(
        recipe, target, token_frequencies(rows, target.vocab_size)).to(target.device)
    src = T.OnlineSource(rows, target, _pad_id(target), target.device)
    src.bind(drafter.feature_spec())
    return recipe, target, drafter, src, batches[: n_batches + 1]


def autocast_ctx(recipe, device):
    mp = T.resolve_precision(recipe.training.precision)
    if mp == "no":
        return torch.autocast(str(device).split(":")[0], enabled=False)
    return torch.autocast(str(device).split(":")[0], dtype=torch.bfloat16 if mp == "bf16" else torch.float16)


def run_variant(name, batches, get, drafter, opt, clock, amp, steps=None, packed=False):
    """Train steps over `batches` (the first is warm-up, untimed). `get(idx)` -> (batch, feats)."""
    from spectrain.data.packing import pack_rows

    if steps is not None:
        drafter.config["ttt_steps"] = steps
    for j, idx in enumerate(batches):
        tag = name if j else "warmup"
        with clock(f"{tag}/features"):
            batch, feats = get(idx)
            if packed:  # training.packing: one row of real tokens, attention per document
                batch, feats = pack_rows(batch, feats)
        with clock(f"{tag}/draft_fwd"), amp():
            loss, _ = drafter.train_loss(batch, feats, get.target)
        with clock(f"{tag}/draft_bwd"):
            loss.backward()
        with clock(f"{tag}/optimizer"):
            if opt is not None:
                opt.step()
            opt.zero_grad(set_to_none=True) if opt is not None else drafter.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--batches", type=int, default=6, help="timed micro-batches per variant")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = what training.num_threads=0 "
                    "picks: $SPECTRAIN_NUM_THREADS, $OMP_NUM_THREADS, else the CPU affinity)")
    ap.add_argument("--json", default="", help="also write the numbers to this file")
    ap.add_argument("--cpu-time", action="store_true", help="time phases by the process's CPU time, not wall "
                    "time (CPU only; with --threads 1 it is what the work costs, whatever else loads the host)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all variants, interleaved; each phase's "
                    "median round is reported (a shared machine's load drifts)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or T.resolve_num_threads(0))  # as the training loop does
    torch.set_flush_denormal(True)  # as the training loop does on CPU (denormals make CPU math crawl)
    recipe, target, drafter, src, batches = build(args.recipe, args.overrides, args.batches)
    dev = target.device
    amp = lambda: autocast_ctx(recipe, dev)  # noqa: E731
    timed = batches[1:]
    tokens = sum(int(src.lengths[i]) for b in timed for i in b)
    from spectrain.data.dataset import collate

    opt, _ = S.build_optimizer(recipe, drafter, target)
    online = _Getter(src.get, target)
    # offline: features precomputed once, stored as bf16 on the host like the cache, read back per step
    store = {}
    for idx in batches:
        b, f = src.get(idx)
        store[tuple(idx)] = ({k: v.cpu() for k, v in b.items()}, {k: v.to(torch.bfloat16).cpu() for k, v in f.items()})

    def offline_get(idx):
        b, f = store[tuple(idx)]
        return ({k: v.to(dev) for k, v in b.items()},
                {k: v.to(dev, torch.float32 if T.resolve_precision(recipe.training.precision) == "no" else v.dtype)
                 for k, v in f.items()})

    offline, k = _Getter(offline_get, target), int(recipe.drafter.eagle3.ttt_steps)
    rounds = []
    for _ in range(args.repeats):  # every variant once per round; the median round per phase is reported
        clock = Clock(dev, cpu=args.cpu_time)
        # 1. plain target forward (logits), the reference cost
        for j, idx in enumerate(batches):
            batch = {k: v.to(dev) for k, v in collate([src.rows[i] for i in idx], src.pad_id).items()}
            with clock("target_forward" if j else "warmup/tf"), torch.no_grad(), amp():
                target.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        # 2. training steps: online / offline features, padded rows / packed rows
        run_variant("online", batches, online, drafter, opt, clock, amp)
        run_variant("offline", batches, offline, drafter, opt, clock, amp)
        run_variant("offline_packed", batches, offline, drafter, opt, clock, amp, packed=True)
        run_variant("online_packed", batches, online, drafter, opt, clock, amp, packed=True)
        # 3. per TTT step: draft fwd+bwd at ttt_steps=1 and =K on the offline batches (no optimizer)
        run_variant("ttt1", batches, offline, drafter, None, clock, amp, steps=1)
        run_variant(f"ttt{k}", batches, offline, drafter, None, clock, amp, steps=k)
        drafter.config["ttt_steps"] = k
        rounds.append(clock.t)
    med = {key: sorted(r[key] for r in rounds)[len(rounds) // 2] for key in rounds[0]}
    padded = sum(len(b) * max(int(src.lengths[i]) for i in b) for b in timed)
    report(med, tokens, k, len(timed), recipe, target, args.json, 1 - tokens / padded, args.repeats,
           "CPU time" if args.cpu_time else "wall time")
    return 0


class _Getter:
    def __init__(self, fn, target):
        self.fn, self.target = fn, target

    def __call__(self, idx):
        return self.fn(idx)


def report(t: dict, tokens: int, k: int, n: int, recipe, target, json_path: str, padding: float,
           repeats: int, clock: str) -> None:
    def step(name):
        return sum(v for key, v in t.items() if key.startswith(f"{name}/"))

    tf, on, off = t["target_forward"], step("online"), step("offline")
    onp, offp = step("online_packed"), step("offline_packed")
    per_ttt = (t[f"ttt{k}/draft_fwd"] + t[f"ttt{k}/draft_bwd"] - t["ttt1/draft_fwd"] - t["ttt1/draft_bwd"]) / max(k - 1, 1)
    out = {
        "target": target.name_or_path, "device": str(target.device), "threads": torch.get_num_threads(),
        "precision": T.resolve_precision(recipe.training.precision), "micro_batch_size": recipe.training.micro_batch_size,
        "ttt_steps": k, "batches": n, "tokens": tokens, "repeats": repeats, "clock": clock,
        "tokens_per_s": {"target_forward": tokens / tf, "train_online": tokens / on, "train_offline": tokens / off,
                         "train_online_packed": tokens / onp, "train_offline_packed": tokens / offp},
        "padding_share": padding,
        "ratio_train_step_over_target_forward": {"online": on / tf, "offline": off / tf},
        "seconds_per_batch": {
            "target_forward": tf / n,
            "online": {p: t[f"online/{p}"] / n for p in ("features", "draft_fwd", "draft_bwd", "optimizer")},
            **{v: {p: t[f"{v}/{p}"] / n for p in ("features", "draft_fwd", "draft_bwd", "optimizer")}
               for v in ("offline", "online_packed", "offline_packed")},
            "draft_fwd_bwd_per_ttt_step": per_ttt / n,
            "draft_fwd_bwd_ttt1": (t["ttt1/draft_fwd"] + t["ttt1/draft_bwd"]) / n,
        },
    }
    print(f"\n{out['target']} on {out['device']} ({out['threads']} threads, precision {out['precision']}), "
          f"{n} micro-batches of {out['micro_batch_size']} rows, {tokens} tokens, ttt_steps={k}, "
          f"median of {repeats} interleaved round(s), {clock}")
    print(f"{'':28}{'tokens/s':>10}{'s/batch':>10}{'x target fwd':>14}")
    print(f"{'target forward (logits)':28}{tokens / tf:10.0f}{tf / n:10.3f}{1.0:14.2f}")
    print(f"{'EAGLE-3 train, online':28}{tokens / on:10.0f}{on / n:10.3f}{on / tf:14.2f}")
    print(f"{'EAGLE-3 train, offline':28}{tokens / off:10.0f}{off / n:10.3f}{off / tf:14.2f}")
    print(f"{'  packed, online':28}{tokens / onp:10.0f}{onp / n:10.3f}{onp / tf:14.2f}")
    print(f"{'  packed, offline':28}{tokens / offp:10.0f}{offp / n:10.3f}{offp / tf:14.2f}")
    print(f"padding: {100 * padding:.1f}% of the padded micro-batches' positions")
    print("\nwhere the time goes, s per batch (online | offline | online packed | offline packed):")
    for p, label in (("features", "target features / cache read"), ("draft_fwd", "draft forward (all TTT steps)"),
                     ("draft_bwd", "draft backward"), ("optimizer", "AdamW step")):
        print(f"  {label:32}" + " | ".join(f"{t[f'{v}/{p}'] / n:8.3f}" for v in
                                          ("online", "offline", "online_packed", "offline_packed")))
    print(f"  {'draft fwd+bwd per extra TTT step':32}{per_ttt / n:8.3f}   (ttt_steps=1 alone: "
          f"{out['seconds_per_batch']['draft_fwd_bwd_ttt1']:.3f}, incl. teacher logits)")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
