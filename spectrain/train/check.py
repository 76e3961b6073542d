"""`spectrain check RECIPE [--plan 8xH100 [--mfu 0.17]] [a.b=value ...]`: print the resolved recipe, then run
every check `train` would run that needs only the recipe, the target's config and tokenizer and a data sample
(the same functions: recipe validation, draft layer ranges, precision, trackers, the feature cache's
presence ...). A failure is one `FAILED:` line and exit status 2. ``--plan`` adds the cost plan
(spectrain/train/plan.py: rows, tokens, steps, wall time, GPU-hours, cache and checkpoint sizes against free disk,
memory per GPU) and fails when the cache or the checkpoints cannot fit the disk. A missing offline feature
cache fails a plain `check`, but not ``--plan``: the plan prints what the cache will need and names the next
stage (`spectrain prepare-features RECIPE`), so a fresh machine learns the cost before paying it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from spectrain import registry
from spectrain.data.chat import load_conversations, tokenize_conversations
from spectrain.recipe.load import load_recipe
from spectrain.recipe.schema import Recipe
from spectrain.targets.gguf import resolve_target_path, split_gguf
from spectrain.targets.model import looks_local
from spectrain.train.distributed import check_trackers, malloc_setting, resolve_precision
from spectrain.train.plan import DEFAULT_MFU, GPUS, check_mfu, data_size, parse_hardware, plan_lines
from spectrain.train.run_dir import check_run_dir


def _fail(msg: str) -> int:
    """One line, exit status 2: the same as every other command's expected failures (spectrain/io/errors.py)."""
    print(f"spectrain check: FAILED: {' '.join(msg.split())}", file=sys.stderr)
    return 2


def _check_target(r: Recipe):
    """Config + tokenizer (no weights) and their consistency with the recipe. Returns (config, tok)."""
    src, trc = r.target.name_or_path, r.target.trust_remote_code
    if split_gguf(src, r.target.gguf_file):  # dequantized once (cached); config + tokenizer come from the copy
        src = resolve_target_path(src, r.target.gguf_file)
    p = Path(src).expanduser()

    if not p.exists() and looks_local(src):
        # Looks like a local path (e.g. assets/reference-target); do not fall through to hub retries.
        raise ValueError(f"target model dir not found: {src} (relative to {Path.cwd()}); build or download it, "
                         "or set target.name_or_path to an HF hub id")
    try:
        cfg = AutoConfig.from_pretrained(src, trust_remote_code=trc)
        tok = AutoTokenizer.from_pretrained(src, trust_remote_code=trc)
    except Exception as e:  # HF raises OSError / ValueError / HTTP errors; all mean "cannot load"
        raise ValueError(f"cannot load target config/tokenizer from {src!r} ({type(e).__name__}: {e}). "
                         "Give a local model dir or a hub id reachable from this machine.") from None
    if hasattr(cfg, "get_text_config"):  # multimodal configs keep the LM's fields in a sub-config
        cfg = cfg.get_text_config()
    if not tok.chat_template:
        raise ValueError(f"target tokenizer {src!r} has no chat template; use an instruct/chat model "
                         "or add chat_template to its tokenizer_config.json")
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens but the model's vocab_size is {cfg.vocab_size}")
    family_checks = registry.hook(r.drafter.kind, "train.preflight")
    if family_checks is not None:  # the family's own checks (spectrain/registry.py): layer ids, vocabularies
        family_checks(r, cfg, tok)
    return cfg, tok


def _missing_cache(r: Recipe) -> str:
    """Why training cannot start yet for lack of the offline feature cache ("" = it exists, or is not used)."""
    if r.training.features == "offline" and not (Path(r.training.feature_cache) / "manifest.json").is_file():
        return (f"training.features=offline but training.feature_cache={r.training.feature_cache!r} holds no "
                "feature cache (manifest.json): write it with `spectrain prepare-features RECIPE`")
    return ""


def _cache_line(r: Recipe) -> str:
    """What the offline feature cache holds, per split (rows, tokens, growth segments), the numerics it was
    written in and its size; refuses an unfinished split as training would ("" = no cache used or none yet)."""
    mfile = Path(r.training.feature_cache) / "manifest.json"
    if r.training.features != "offline" or not mfile.is_file():
        return ""
    m = json.loads(mfile.read_text())
    parts = []
    for name, s in sorted(m["splits"].items(), reverse=True):  # train, then heldout
        if not s.get("complete"):
            raise ValueError(f"feature cache {mfile.parent} has an unfinished {name!r} split ({s['rows']} rows): "
                             f"finish it with `spectrain prepare-features RECIPE` (it resumes)")
        grown = f", grown in {len(s['segments'])} segments {s['segments']}" if len(s.get("segments", [])) > 1 else ""
        parts.append(f"{name} {s['rows']:,} rows ({s['tokens']:,} tokens{grown})")
    size = sum(sh["bytes"] for s in m["splits"].values() for sh in s["shards"])
    made = f"a {m['target_dtype']} target" if "target_dtype" in m else "a target of unrecorded dtype"
    return (f"feature cache {mfile.parent}: {', '.join(parts)}; {m['dtype']} features of {made} (the recipe's "
            f"target.dtype: {r.target.dtype}), {size / 2**20:,.0f} MiB")


def _check_data(r: Recipe, tok) -> list[str]:
    rows, report = load_conversations(r.data.train_files, r.data.format, max_rows=64)
    encoded = tokenize_conversations(tok, [row["messages"] for row in rows[:16]], r.data.max_length)
    good = [res for res in encoded if not isinstance(res, ValueError) and any(res[1])]
    errors = [str(res) for res in encoded if isinstance(res, ValueError)]
    if not good:
        why = f"the chat template failed: {errors[0]}" if errors else \
            f"raise data.max_length (now {r.data.max_length}) or check the chat template"
        raise ValueError(f"no sampled conversation has an assistant token under the loss mask; {why}")
    ids, mask = good[0]
    reply = tok.decode([t for t, m in zip(ids, mask) if m])
    return [f"data sample: {len(rows)} rows read ({sum(report.skipped.values())} skipped), "
            f"{len(good)}/{len(encoded)} tokenised with assistant tokens ({len(errors)} template errors), "
            f"mean length {sum(len(g[0]) for g in good) / len(good):.0f}, "
            f"mean assistant tokens {sum(sum(g[1]) for g in good) / len(good):.0f}",
            f"first reply under the mask: {reply[:70]!r}"]


def add_check_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--plan", default=None, metavar="NxGPU",  # None: not asked; '' is a bad value, refused
                   help=f"also print a cost plan for N GPUs of a kind ({', '.join(GPUS)}), e.g. 8xH100")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help=f"model FLOPs utilisation the plan assumes (default {DEFAULT_MFU}: measured once, one H200 "
                        "EAGLE-3 run on a 1.24B target; see spectrain/train/plan.py)")
    return p


def _student_config(r: Recipe):
    """A model config of the family's own that its cost reads (a draft LM's), or None (the record's
    ``train.cost_config`` hook)."""
    hook = registry.hook(r.drafter.kind, "train.cost_config")
    return hook(r) if hook is not None else None


def _plan(r: Recipe, cfg, tok, hardware: str, mfu: float | None) -> list[str]:
    """The plan's lines; raises ValueError with its problems (a cache or checkpoints that cannot fit)."""
    mfu = DEFAULT_MFU if mfu is None else mfu
    lines, problems = plan_lines(r, cfg, data_size(r, tok), parse_hardware(hardware), mfu, _student_config(r))
    if problems:
        print("\n".join(lines))
        raise ValueError("plan: " + "; ".join(problems))
    return lines


def main(recipe_path: str, overrides: list[str], plan: str | None = None, mfu: float | None = None) -> int:
    """`spectrain check`: print the resolved recipe, then verify target, tokenizer and a data sample."""
    try:
        r = load_recipe(recipe_path, overrides)
        if plan is not None:
            parse_hardware(plan)  # a bad --plan (also '') fails before anything loads
        if mfu is not None:
            check_mfu(mfu)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    print(r.to_yaml().rstrip())
    print("---")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        accum = r.training.grad_accum(world)

        resolve_precision(r.training.precision)  # the same checks `train` runs before it loads anything
        check_trackers(r)
        malloc_setting()  # $SPECTRAIN_MALLOC: keep or unset

        check_run_dir(r)  # output_dir: never /, home, an input, a user's directory (spectrain/io/outputs.py)
        kind = r.drafter.kind
        if kind in registry.TRAINING_FREE:
            print(f"note: drafter.kind={kind} is training-free: `spectrain train` refuses it; evaluate it with "
                  f"`spectrain eval --drafter {kind}`")
        cfg, tok = _check_target(r)
        missing = _missing_cache(r)
        if missing and plan is None:
            raise ValueError(missing)
        cache = _cache_line(r)
        data_lines = _check_data(r, tok) + ([cache] if cache else [])
        plan_lines = _plan(r, cfg, tok, plan, mfu) if plan is not None else []
    except (ValueError, OSError) as e:
        return _fail(str(e))
    print(f"OK target {r.target.name_or_path}: {cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size} (tokenizer {len(tok)}), chat template present")
    print(f"OK batch: global {r.training.global_batch_size} = micro {r.training.micro_batch_size} "
          f"x world {world} x grad_accum {accum}")
    for line in data_lines:
        print(f"OK {line}")
    print(f"OK recipe {recipe_path} ({r.drafter.kind}, loss {r.drafter.loss}) -> {r.output_dir}")
    for line in plan_lines:
        print(line)
    if missing:  # --plan: the plan is what says how large the cache will be, so it comes before paying for it
        print(f"NEXT: the feature cache {r.training.feature_cache} does not exist yet (its size is in the plan "
              f"above): write it with `spectrain prepare-features {recipe_path}`, then `spectrain train "
              f"{recipe_path}`")
    return 0
