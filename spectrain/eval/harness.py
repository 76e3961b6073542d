"""`spectrain eval`: lossless speculative decoding over prompt sets, against a plain baseline.

    spectrain eval --target assets/reference-target --drafter ngram --n 10
    spectrain eval --recipe recipes/tiny/eagle3.yaml --drafter runs/tiny-eagle3/best --drafter ngram \
        --prompts heldout --prompts spec_bench/rag --k 3 --k 5 --temperature 0 --temperature 1

For every (drafter, k or tree, temperature) and every prompt set it runs
``spectrain.decoding.loop.speculative_generate`` and, in the same run on the same prompts, the plain
target (``plain_generate``), then writes report.json, report.md and PNG plots under ``--out``
(see spectrain/eval/report.py for the metric conventions).

Prompt sets are a plain dict (``PROMPT_SETS``): the held-out split of a recipe's training data
("held-out") and the shipped public sets in eval/prompts/ ("OOD" unless ``--in-domain`` says the
drafter was trained on that domain). Any other ``--prompts`` value that is a file path is read as
JSONL with ``turns`` / ``messages`` / ``prompt`` / ``question`` records.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.decoding.stats import DecodeStats
from spectrain.drafters import load_drafter
from spectrain.eval import cost_curve as cc
from spectrain.eval import greedy_check, report
from spectrain.eval.hf_baselines import HFBaseline, is_hf_spec, load_hf_baseline, parse_hf_spec
from spectrain.eval.prompts import (
    DEFAULT_OOD_SETS,
    PROMPT_SETS,
    PROMPTS_DIR,
    PromptSet,
    encode_prompts,
    load_prompt_set,
)
from spectrain.eval.sweep import add_sweep_args, batch_sweep, timed, validate_sweep_args
from spectrain.eval.tracking import log_trackers
from spectrain.export.serving import parse_tree  # noqa: F401  (re-exported: tests and callers)
from spectrain.io.outputs import resolve_out, staged_dir
from spectrain.recipe.load import load_recipe
from spectrain.targets.model import load_target, resolve_dtype

# ---- arguments ----------------------------------------------------------------------------------------------


def add_eval_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--target", help="target model (local HF dir, hub id or .gguf file); default: the recipe's target")
    p.add_argument("--gguf-file", default="", help="with --target DIR_OR_REPO: the GGUF file in it (dequantized "
                   "once into a cached checkpoint)")
    p.add_argument("--recipe", help="recipe YAML: gives the held-out prompt set and the default target")
    p.add_argument("--drafter", action="append", default=None,
                   help="'ngram', a trained drafter dir, an HF draft model path, 'none' (baseline only), or an HF "
                        "generate baseline on the same prompts: hf:plain, hf:prompt-lookup (k = "
                        "prompt_lookup_num_tokens), hf:assisted=DRAFT_MODEL_DIR (k = num_assistant_tokens); "
                        "repeatable (default: ngram)")
    p.add_argument("--prompts", action="append", default=None,
                   help=f"prompt set ({', '.join(PROMPT_SETS)}) or a JSONL file; repeatable "
                        f"(default: heldout when --recipe is given, plus {', '.join(DEFAULT_OOD_SETS)})")
    p.add_argument("--prompts-dir", default=str(PROMPTS_DIR), help="where the shipped prompt files are")
    p.add_argument("--in-domain", action="append", default=[],
                   help="tag this prompt set 'in-domain' instead of OOD (the drafter trained on its domain)")
    p.add_argument("--n", type=int, default=10,
                   help="prompts per set: the first N usable ones that fit the context window, in file order")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="cut the middle of longer prompts to fit M tokens (default: skip prompts that do not fit)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the raw prompt text (base models)")
    p.add_argument("--k", action="append", type=int, default=None, help="draft length; repeatable (default 5)")
    p.add_argument("--tree", action="append", default=[],
                   help="tree config, e.g. topk=4,depth=5,total=32; repeatable (drafters with tree support only)")
    p.add_argument("--temperature", action="append", type=float, default=None,
                   help="0 = greedy; repeatable (default: 0 and 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for T > 0 (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling for T > 0 (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="prompt i uses seed+i, for the baseline and every drafter")
    p.add_argument("--no-hf-plain", dest="hf_plain", action="store_false",
                   help="do not decode HF generate plain beside spectrain's plain loop (by default both run on the "
                        "same prompts and speedups are stated against the faster)")
    p.add_argument("--repeats", type=int, default=1,
                   help="time every prompt N times, plain and speculative alternating, and report the median "
                        "(speedup: the median of the paired ratios); outputs and acceptance come from the first")
    p.add_argument("--cost-ratio", type=float, default=None,
                   help="c = one draft step's cost relative to one target pass, for the predicted speedup "
                        "tau/(1+k*c) (default: the c measured in this run, labelled as measured)")
    p.add_argument("--out", default=None, help="output dir (default runs/eval-<UTC timestamp>); must not exist "
                                               "unless --force")
    p.add_argument("--force", action="store_true", help="replace an existing --out whole once the new report is "
                                                        "written (never mixed with its old files)")
    p.add_argument("--report-to", choices=["none", "wandb", "tensorboard"], action="append", default=None,
                   help="also log one scalar per (drafter, decode, prompt set), curves and tables to wandb "
                        "(WANDB_MODE=offline works without network) or tensorboard; repeatable")
    p.add_argument("--wandb-project", default=None,
                   help="wandb project (default: the evaluated training run's, else spectrain)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--device-map", default=None, choices=["auto", "balanced", "balanced_low_0", "sequential"],
                   help="spread a target too large for one GPU over all visible GPUs (HF device_map)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA; on a CPU bf16 only where it is native and a "
                   "measured verify pass is faster, else fp32: docs/decoding.md), float32, bfloat16, float16")

    add_sweep_args(p)  # --batch-size (repeatable), --gpu, --gpu-bandwidth, --gpu-flops
    p.add_argument("--engine", choices=["llama.cpp"], default=None,
                   help="serve the grid with a real engine (llama.cpp, built by `spectrain engine fetch llama.cpp`; "
                        "spectrain/eval/engine.py): --target is then a .gguf file")
    p.add_argument("--threads", type=int, default=2, help="with --engine: threads of each llama-server (default 2)")
    p.add_argument("--conform-to", default=None, help="with --engine: a `spectrain eval` report of the same drafter and "
                   "prompts; writes conformance.md (engine alpha_i inside spectrain's 95%% intervals?)")
    p.add_argument("--cost-curve", action="store_true",
                   help="also measure the target's verification cost curve (one pass over t = 1..32 new tokens, "
                        "per batch size) and pick the chain length it predicts fastest from the measured alpha_i "
                        "and drafter cost (report: cost_curve.md)")
    return p


def validate_args(args) -> None:
    """Bad numbers fail before any model is loaded, each with the fix."""
    args.k = args.k or [5]
    args.temperature = args.temperature if args.temperature is not None else [0.0, 1.0]
    args.drafter = args.drafter or ["ngram"]
    checks = [
        (all(k > 0 for k in args.k), f"--k must be >= 1, got {args.k}"),
        (all(t >= 0 for t in args.temperature), f"--temperature must be >= 0 (0 = greedy), got {args.temperature}"),
        (0.0 < args.top_p <= 1.0, f"--top-p must be in (0, 1], got {args.top_p}"),
        (args.top_k >= 0, f"--top-k must be >= 0 (0 = off), got {args.top_k}"),
        (args.n >= 1, f"--n must be >= 1, got {args.n}"),
        (args.repeats >= 1, f"--repeats must be >= 1 (1 = time each decode once), got {args.repeats}"),
        (args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (args.max_prompt_tokens is None or args.max_prompt_tokens >= 1, "--max-prompt-tokens must be >= 1"),
        (args.cost_ratio is None or args.cost_ratio >= 0, f"--cost-ratio must be >= 0, got {args.cost_ratio}"),
        (args.target or args.recipe, "give --target (a model dir or hub id) or --recipe"),
    ]
    try:
        resolve_dtype(args.dtype)
    except ValueError as e:
        checks.append((False, f"--dtype: {e}"))
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    raw_trees, args.tree = args.tree, [parse_tree(t) for t in args.tree]
    _refuse_repeats(args, raw_trees)
    for d in args.drafter:
        if is_hf_spec(d):
            parse_hf_spec(d)

    validate_sweep_args(args)
    check_out(args)


def _refuse_repeats(args, raw_trees: list[str]) -> None:
    """A value given twice would be decoded twice and then collide in the report, after all the decoding."""
    for flag, values, shown in (("--k", args.k, args.k), ("--temperature", args.temperature, args.temperature),
                                ("--tree", args.tree, raw_trees), ("--drafter", args.drafter, args.drafter),
                                ("--prompts", args.prompts or [], args.prompts or [])):
        for i, v in enumerate(values):
            if v in values[:i]:
                first = shown[values.index(v)]
                also = f" (also as {first})" if str(first) != str(shown[i]) else ""
                raise ValueError(f"{flag} {shown[i]} is given twice{also}: each value is decoded once and is one "
                                 "row of the report; give each value once")


HF_PLAIN = "baseline:hf-plain"  # the cell key of HF generate's plain decoding (the second plain decoder)
HF_SKIPS = {"--batch-size": "HF's generate decodes one row at a time",
            "the chain-length pick": "HF's generate is another decoding loop than the one the cost curve models"}


def _note_hf_skipped(drafters, what: str) -> list[str]:
    """HF baselines are not measured per batch size nor picked a chain length: said, as for --tree, instead of
    leaving a table with a header and no rows."""
    hf = [d for d in dict.fromkeys(drafters) if is_hf_spec(d)]
    if hf:
        print(f"note: {', '.join(hf)}: {what} skipped ({HF_SKIPS[what]})", file=sys.stderr)
    return hf


def check_out(args) -> None:
    """--out is checked before any model is loaded (not after all the decoding): see spectrain/io/outputs.py."""
    drafters = [parse_hf_spec(d)[1] if is_hf_spec(d) else d for d in args.drafter]
    inputs = [("target", args.target), ("recipe", args.recipe)] + [("drafter", d) for d in drafters if d] + \
        [("prompt file", p) for p in (args.prompts or [])]
    args.out = resolve_out(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}",
                           getattr(args, "force", False), inputs=inputs)


# ---- running ------------------------------------------------------------------------------------------------


@dataclass
class DecodeConfig:
    k: int
    tree: dict | None
    temperature: float
    shape: str = ""  # a label without a chain length (hf:plain)

    @property
    def label(self) -> str:
        t = self.tree
        shape = self.shape or (f"k={self.k}" if t is None else
                               f"tree topk={t['topk']},depth={t['depth']},total={t['total_tokens']}")
        return f"{shape} T={self.temperature:g}"


def _new_cell() -> dict:
    return {"tokens": 0, "seconds": 0.0, "outputs": [], "stats": []}


def _decode_into(cell: dict, fn, rep: int = 0, **kw) -> None:
    """One prompt through `fn` (plain or speculative), timed end to end, accumulated into `cell`: the time
    into repeat `rep`'s total, the tokens and statistics from the first repeat (the others decode the same)."""
    out, seconds = timed(fn, **kw)
    reps = cell.setdefault("rep_seconds", [])
    reps.extend([0.0] * (rep + 1 - len(reps)))
    reps[rep] += seconds
    cell["seconds"] = float(np.median(reps))  # one repeat: its total
    if rep == 0:
        cell["tokens"] += len(out.tokens)
        cell["outputs"].append(list(out.tokens))
        cell["stats"].append(out.stats)


def decode_weight(ids: list[int], args) -> int:
    """What one decode of a prompt counts on the progress bar: the tokens the target reads and writes (a long
    RAG prompt costs more than a short chat turn, which a bar counting prompts hides)."""
    return len(ids) + args.max_new_tokens


def progress_total(encoded: dict, plan: dict, args) -> int:
    """The progress bar's total: every decode (baselines included, every repeat) weighted by its tokens."""
    weight = sum(decode_weight(ids, args) for v in encoded.values() for ids in v)
    plains = len(args.temperature) * (1 + bool(getattr(args, "hf_plain", False)))
    return weight * (plains + sum(len(c) for c in plan.values())) * getattr(args, "repeats", 1)


def run_cells(target, drafters: dict, plan: dict, sets: list[PromptSet], encoded: dict, args, bar) -> dict:
    """Every cell of the grid, prompt by prompt: the baseline and each drafter config take turns on the same
    prompt, `--repeats` times in a row (plain, spec, ..., plain, spec, ...), so load drift on a shared machine
    hits both sides of the measured speedup alike and no speedup rests on one slow moment of the baseline. With
    ``args.hf_plain`` HF generate's plain decoding takes its turn too (the other plain decoder a user has)."""
    cells: dict = {}
    hf_plain = HFBaseline("hf:plain", "plain") if getattr(args, "hf_plain", False) else None
    for ps in sets:
        for temp in args.temperature:
            todo = [(d, cfg) for d, cfgs in plan.items() for cfg in cfgs if cfg.temperature == temp]
            base = cells.setdefault(("plain", f"T={temp:g}", ps.name), _new_cell())
            hf_base = cells.setdefault((HF_PLAIN, f"T={temp:g}", ps.name), _new_cell()) if hf_plain else None
            bar.set_postfix_str(f"T={temp:g} {ps.name}")
            for i, ids in enumerate(encoded[ps.name]):
                common = dict(target=target, input_ids=torch.tensor(ids, device=target.device),
                              max_new_tokens=args.max_new_tokens, temperature=temp, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed + i)
                for rep in range(getattr(args, "repeats", 1)):
                    _decode_into(base, plain_generate, rep, **common)
                    if hf_plain:
                        _decode_into(hf_base, hf_plain.generate, rep, **common)
                    for d, cfg in todo:
                        fn = drafters[d].generate if is_hf_spec(d) else speculative_generate  # same signature
                        _decode_into(cells.setdefault((d, cfg.label, ps.name), _new_cell()), fn,
                                     rep, drafter=drafters[d], k=cfg.k, tree=cfg.tree, **common)
                    bar.update(decode_weight(ids, args) * (1 + bool(hf_plain) + len(todo)))
    return cells


def _configs(args, drafter) -> list[DecodeConfig]:
    if isinstance(drafter, HFBaseline) and drafter.kind == "plain":
        return [DecodeConfig(1, None, temp, shape="plain") for temp in args.temperature]  # drafts nothing
    shapes = [(k, None) for k in args.k]
    if getattr(drafter, "supports_tree", False):
        shapes += [(t["depth"], t) for t in args.tree]
    elif args.tree:
        print(f"note: drafter {getattr(drafter, 'name', drafter)!r} proposes chains only; --tree skipped for it",
              file=sys.stderr)
    return [DecodeConfig(k, t, temp) for temp in args.temperature for k, t in shapes]


def main(args) -> int:
    validate_args(args)
    recipe = None
    if args.recipe:
        recipe = load_recipe(args.recipe)
    target_name = args.target or recipe.target.name_or_path
    names = list(dict.fromkeys(args.prompts or ((["heldout"] if recipe else []) + DEFAULT_OOD_SETS)))
    sets = [load_prompt_set(n, Path(args.prompts_dir), recipe, tuple(args.in_domain)) for n in names]
    device_map = args.device_map or (recipe.target.device_map if recipe and not args.target else "") or None
    gguf_file = args.gguf_file or (recipe.target.gguf_file if recipe and not args.target else "")
    target = load_target(target_name, dtype=args.dtype, device=args.device, device_map=device_map, gguf_file=gguf_file,
                         verify_tokens=max(args.k) + 1)  # `auto` on a CPU times the widest chain's verify pass
    if not args.no_chat_template and not getattr(target.tokenizer, "chat_template", None):
        raise ValueError(f"target {target_name!r} has no chat template in its tokenizer config; "
                         "pass --no-chat-template to feed the raw prompt text")
    ctx = target.max_positions
    max_len = None if ctx is None else ctx - args.max_new_tokens  # the decoder refuses anything longer
    if max_len is not None and max_len < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's context "
                         f"window of {ctx} positions: use --max-new-tokens < {ctx}")
    encoded = _encode_all(sets, target.tokenizer, max_len, args)
    drafters = _load_drafters(args.drafter, target)
    plan = {d: _configs(args, drafters[d]) for d in drafters}
    _warm_up(target, encoded[sets[0].name][0], args.hf_plain)
    with tqdm(total=progress_total(encoded, plan, args), desc="decoding (prompt + new tokens)", unit="tok",
              unit_scale=True) as bar:
        cells = run_cells(target, drafters, plan, sets, encoded, args, bar)
    greedy_check.judge_cells(target, plan, sets, cells, encoded)  # T = 0: identical, near-tie or FAIL per prompt

    baselines = {(t, ps.name): cells[("plain", f"T={t:g}", ps.name)] for t in args.temperature for ps in sets}
    hf_baselines = {(t, ps.name): cells[(HF_PLAIN, f"T={t:g}", ps.name)] for t in args.temperature for ps in sets
                    if (HF_PLAIN, f"T={t:g}", ps.name) in cells}
    records = []
    for d, cfgs in plan.items():
        for cfg in cfgs:
            for ps in sets:
                cell = cells[(d, cfg.label, ps.name)]
                cell["prompt_stats"], cell["stats"] = cell["stats"], DecodeStats.merge(cell["stats"])
                cell["prompt_ids"] = [prompt_id(ids) for ids in encoded[ps.name]]  # `spectrain compare` pairs by these
                records.append(report.make_record(d, cfg, ps, cell, baselines[(cfg.temperature, ps.name)],
                                                  args.cost_ratio, hf_baselines.get((cfg.temperature, ps.name))))
    meta = report.run_metadata(args, target_name, target, sets, baselines, hf_baselines)

    own = {d: c for d, c in plan.items() if not is_hf_spec(d)}  # HF's assisted generation decodes B = 1 only
    sweep = None
    if getattr(args, "batch_size", None):
        skipped = _note_hf_skipped(plan, "--batch-size")
        sweep = batch_sweep(target, drafters, own, encoded, args) if own else None  # no rows: no table at all
        if sweep is not None and skipped:
            sweep["skipped"] = {d: HF_SKIPS["--batch-size"] for d in skipped}
    costs = _cost_curve(target, records, args, meta) if args.cost_curve else None
    if sweep is not None and costs:
        curves = {int(b): {int(t): v for t, v in c.items()} for b, c in meta["cost_curve"]["seconds"].items()}
        cc.annotate_sweep(sweep, curves, records)
    with staged_dir(args.out, "eval") as tmp:  # lands whole or not at all; --force replaces, never mixes
        paths = report.write_all(tmp, meta, records, batch_sweep=sweep)
        if costs:
            (tmp / "cost_curve.md").write_text(costs + "\n")
            paths.append(tmp / "cost_curve.md")
    paths = [args.out / p.relative_to(tmp) for p in paths]
    trackers = [t for t in args.report_to or [] if t != "none"]
    if trackers:  # after the report landed: the runs are named after, and write into, the final directory

        log_trackers(args.out, meta, records, [p for p in paths if p.suffix == ".png"], trackers, args.wandb_project)
    print(report.summary_table(records, meta))
    if sweep is not None:
        print("\n".join(report.sweep_markdown(sweep)))
    if costs:
        print(costs)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    failed = report.greedy_failures(records)
    for line in failed:
        print(f"FAILURE: {line}", file=sys.stderr)
    return 1 if failed else 0


def prompt_id(ids: list[int]) -> str:
    """A prompt's identity across evals: a hash of the token ids the target saw (same set, template, cut)."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]


def _cost_curve(target, records: list[dict], args, meta: dict) -> str:
    """The measured verification cost curve (B = 1 and every --batch-size) and the chain length it picks."""
    curves = {b: cc.measure_curve(target, batch=b) for b in sorted({1, *(getattr(args, "batch_size", None) or [])})}
    recs = cc.recommend([r for r in records if not is_hf_spec(r["drafter"])], curves[1])
    skipped = _note_hf_skipped([r["drafter"] for r in records], "the chain-length pick")
    pick = cc.recommend_markdown(recs) if recs else ["No chain length to pick: no spectrain drafter drafting "
                                                     "chains was evaluated."]
    if skipped:
        pick += ["", f"Not in this table: {', '.join(skipped)} ({HF_SKIPS['the chain-length pick']})."]
    meta["cost_curve"] = {"seconds": {str(b): {str(t): v for t, v in c.items()} for b, c in curves.items()},
                          "recommendations": recs, "context_tokens": 200}
    return "\n".join(["## Verification cost curve (measured: one target pass over t new tokens, 200 cached)", "",
                      cc.curve_table(curves), "", "## Chain length picked from the measured curve (B = 1)", "",
                      *pick])


def _encode_all(sets: list[PromptSet], tokenizer, max_len: int | None, args) -> dict[str, list[list[int]]]:
    """A set named with --prompts that cannot fit is an error; one from the default mix is dropped with a note
    (e.g. Spec-Bench RAG on a short-context target) so the rest of the mix still runs."""
    encoded = {}
    for ps in list(sets):
        try:
            encoded[ps.name] = encode_prompts(ps, tokenizer, args.n, max_len, args.max_prompt_tokens,
                                              not args.no_chat_template)
        except ValueError as e:
            if args.prompts or len(sets) == 1:
                raise
            print(f"note: dropping {ps.name!r} from the default mix: {e}", file=sys.stderr)
            sets.remove(ps)
            args.dropped_sets = [*getattr(args, "dropped_sets", []), {"name": ps.name, "reason": str(e)}]
            continue
        ps.n_used = len(encoded[ps.name])
    return encoded


def _load_drafters(specs: list[str], target) -> dict:
    """'none' means baseline only; everything else goes through spectrain.drafters.load_drafter."""
    out = {}
    for spec in specs:
        if spec.lower() != "none" and spec not in out:
            out[spec] = load_hf_baseline(spec, target, load_drafter) if is_hf_spec(spec) else load_drafter(spec, target)
    return out


def _warm_up(target, ids: list[int], hf_plain: bool = False) -> None:
    """One short untimed generation per plain decoder so lazy init (kernels, allocator, generate's set-up) does not
    land in the first timing."""
    x = torch.tensor(ids, device=target.device)
    plain_generate(target=target, input_ids=x, max_new_tokens=2)
    if hf_plain:
        HFBaseline("hf:plain", "plain").generate(target, x, max_new_tokens=2)
