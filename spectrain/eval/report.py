"""Evaluation reports: report.json, report.md, PNG plots, and optionally wandb.

One record per (drafter, decode config, prompt set). The metric conventions (also written into
every report):
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from spectrain.eval import stats
from spectrain.eval.divergence import judge_divergence, summarize
from spectrain.eval.hf_baselines import is_hf_spec
from spectrain.eval.plots import plot_acceptance, plot_batch_sweep, plot_tau
from spectrain.eval.stats import fmt_ci, fmt_value
from spectrain.io.resources import VERSION

CONVENTIONS = {
    "alpha_i": "conditional per-position acceptance: of the times draft position i was verified "
               "(all earlier positions accepted), the fraction accepted",
    "tau": "tokens emitted per target forward pass, INCLUDING the bonus/corrected token (plain decoding = 1)",
    "acceptance_rate": "vLLM style: accepted draft tokens / drafted tokens",
    "measured_speedup": "speculative tokens/s divided by the FASTEST plain decoder's tokens/s on the same prompts "
                        "in the same run: spectrain's plain loop or HF generate (both decoded, alternating prompt by "
                        "prompt with the speculative rows; plain decoder = the one named); with --repeats N the median "
                        "over the N interleaved repeats of that ratio (tok/s: tokens / the median repeat's seconds); "
                        "a speedup over spectrain's own plain loop above tau is flagged",
    "predicted_speedup": "tau / (1 + k*c), c = one draft step's cost relative to one target pass "
                         "(k = tree depth for trees); a record with `predicted_from` says where its prediction comes "
                         "from instead (an engine's: its measured verification cost curve)",
    "95% intervals": "[lo, hi] after tau: percentile bootstrap over prompts (prompts resampled with replacement, "
                     "the ratio of sums recomputed); after alpha_i: Wilson score interval of the pooled accepts / "
                     "verifications (it does not collapse at 0 or 1 as the bootstrap does)",
    "target loops": "target tokens = the plain target's mean output length on the set; rep-4g = share of its "
                    "output 4-grams that repeat an earlier 4-gram of the same output; LOOPS flags sets where "
                    f"rep-4g >= {stats.LOOP_FLAG} (a looping target inflates every drafter's acceptance)",
    "split": "held-out = the recipe's training distribution, never trained on; OOD = another distribution; "
             "in-domain = a public set whose domain the drafter was trained on (user-declared)",
}
__doc__ += "\n" + "\n".join(f"- {k}: {v}" for k, v in CONVENTIONS.items()) + "\n"



def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _finite(x) -> float | None:
    return None if x is None or x != x else float(x)  # NaN is not valid JSON


def make_record(drafter: str, cfg, ps, res: dict, base: dict, cost_ratio: float | None,
                hf_base: dict | None = None, plain: str = "spectrain") -> dict:
    """Everything about one (drafter, config, prompt set) cell; `res`/`base` (the same loop's plain decoding:
    `plain` names it, a PLAIN_DECODERS key) / `hf_base` (HF generate plain, when decoded) are cells from
    harness.run_cells. Speedups are against the faster plain decoder."""
    s = res["stats"]
    # Pad to k so every record has alpha_1..alpha_k (None = position never verified).
    pad = max(cfg.k - len(s.attempts), 0)
    attempts, accepts = [int(a) for a in s.attempts] + [0] * pad, [int(a) for a in s.accepts] + [0] * pad
    passes = int(s.target_passes)
    accepted = sum(accepts)
    drafted = int(getattr(s, "drafted", 0) or 0)
    measured_c = _ratio(s.draft_time_s, cfg.k * s.target_time_s)
    c = cost_ratio if cost_ratio is not None else measured_c
    tau = _ratio(res["tokens"], passes)
    rec = {
        "drafter": drafter, "config": cfg.label, "k": cfg.k, "tree": cfg.tree, "temperature": cfg.temperature,
        "prompt_set": ps.name, "split": ps.split, "source": ps.source,
        "n_prompts": len(res["outputs"]), "n_skipped": sum(ps.skipped.values()),
        "skipped": dict(ps.skipped), "n_truncated": ps.truncated,
        "emitted_tokens": res["tokens"], "target_passes": passes,
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        # Passes on which the drafter proposed at least one token (n-gram: a suffix match); tau falls
        # short of 1 + sum_i prod_j alpha_j by the passes without a draft.
        "draft_coverage": _ratio(attempts[0] if attempts else 0, passes),
        "attempts": attempts, "accepts": accepts,
        "alpha": [_ratio(a, n) for a, n in zip(accepts, attempts)],
        "tau": tau, "tau_decoder": _finite(s.tau), "acceptance_rate": _ratio(accepted, drafted),
        "tokens_per_s": _ratio(res["tokens"], res["seconds"]),
        "draft_time_s": float(s.draft_time_s), "target_time_s": float(s.target_time_s),
        "wall_time_s": res["seconds"],
        "c": c, "c_source": "user (--cost-ratio)" if cost_ratio is not None else "measured in this run",
        "c_measured": measured_c,
        "predicted_speedup": None if tau is None or c is None else tau / (1 + cfg.k * c),
    }
    per = res.get("prompt_stats")  # per-prompt counters -> 95% intervals (spectrain/eval/stats.py)
    if per:
        rec.update(stats.decode_intervals([len(o) for o in res["outputs"]], [int(p.target_passes) for p in per],
                                          [p.accepts for p in per], [p.attempts for p in per],
                                          [int(getattr(p, "drafted", 0) or 0) for p in per], cfg.k))
        if res.get("prompt_ids"):
            rec["per_prompt"]["ids"] = res["prompt_ids"]
    rec.update(stats.loop_stats(base["outputs"]))  # the target's own outputs on this set, same T
    _speedups(rec, res, base, hf_base, plain)
    # A pass emits tau tokens and costs at least one plain pass of the same loop: a measured speedup over that
    # loop's own plain decoding above tau is timing noise. HF's generate is another loop: no such bound.
    own = rec[f"measured_speedup_vs_{plain}_plain"]
    rec["speedup_above_tau"] = bool(own is not None and tau is not None and own > tau and not is_hf_spec(drafter))
    if rec["speedup_above_tau"]:
        print(f"WARNING: {flag_line(rec)}", file=sys.stderr)
    if cfg.temperature == 0:
        _greedy_check(rec, res, base)
    return rec


def _greedy_check(rec: dict, res: dict, base: dict) -> None:
    """Greedy speculative decoding must reproduce plain greedy decoding token for token, or part only at a near-tie
    of the target's logits. Per prompt records (spectrain/eval/divergence.py) come from the harness, which knows
    the margins; without them any divergence counts as a FAIL."""
    checks = res.get("greedy_check") or [judge_divergence(b, s, None, None)
                                         for s, b in zip(res["outputs"], base["outputs"])]
    n = summarize(checks)
    rec["greedy_identical_to_plain"] = f"{n['identical']}/{n['n']}"
    rec["greedy_check"] = {**n, "prompts": checks}
    if n["fail"] or n["near_tie"]:
        print(f"{'FAILURE' if n['fail'] else 'note'}: {rec['drafter']} {rec['config']} {rec['prompt_set']}: "
              f"{greedy_line(rec)}", file=sys.stderr)


def greedy_line(r: dict) -> str:
    g = r["greedy_check"]
    margins = ", ".join(f"{c['margin']:.3g}" for c in g["prompts"] if c["verdict"] == "near-tie")
    return (f"{g['identical']}/{g['n']} identical to plain greedy, {g['near_tie']} part at a near-tie of the "
            f"target{f' (margins {margins})' if margins else ''}, {g['fail']} FAIL")


PLAIN_DECODERS = {"spectrain": "spectrain plain loop", "hf": "HF generate plain", "engine": "engine plain"}


def _speedup_against(res: dict, base: dict) -> tuple[float | None, list[float]]:
    """(tokens/s ratio, or the median of the per-repeat ratios with --repeats; those ratios)."""
    spec, plain = _ratio(res["tokens"], res["seconds"]), _ratio(base["tokens"], base["seconds"])
    paired = _paired_speedups(res, base)
    if len(paired) > 1:
        return float(statistics.median(paired)), paired
    return (None if not plain or spec is None else spec / plain), paired


def _speedups(rec: dict, res: dict, base: dict, hf_base: dict | None, plain: str = "spectrain") -> None:
    """Speedup against each plain decoder measured, and the headline one against the faster of them."""
    plains = {plain: base, **({"hf": hf_base} if hf_base and hf_base["tokens"] else {})}
    tps = {name: _ratio(b["tokens"], b["seconds"]) for name, b in plains.items()}
    fastest = max(tps, key=lambda n: tps[n] or 0.0)
    rec["plain_tokens_per_s"] = {PLAIN_DECODERS[n]: v for n, v in tps.items()}
    rec["fastest_plain"] = PLAIN_DECODERS[fastest]
    rec["baseline_tokens"], rec["baseline_wall_time_s"] = plains[fastest]["tokens"], plains[fastest]["seconds"]
    rec["baseline_tokens_per_s"] = tps[fastest]
    for name, b in plains.items():
        rec[f"measured_speedup_vs_{name}_plain"], paired = _speedup_against(res, b)
        if name == fastest:
            rec["measured_speedup"] = rec[f"measured_speedup_vs_{name}_plain"]
            if len(paired) > 1:
                rec["measured_speedup_repeats"] = paired


def _paired_speedups(res: dict, base: dict) -> list[float]:
    """Per repeat: (spec tokens / spec seconds) / (plain tokens / plain seconds), both timed in that repeat."""
    rs, bs = res.get("rep_seconds") or [], base.get("rep_seconds") or []
    if len(rs) != len(bs) or not res["tokens"] or not base["tokens"]:
        return []
    return [(res["tokens"] / r) / (base["tokens"] / b) for r, b in zip(rs, bs) if r > 0 and b > 0]


def _git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(args, target_name: str, target, sets, baselines: dict, hf_baselines: dict | None = None) -> dict:
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "target": target_name, "target_architecture": type(target.model).__name__,
        "target_parameters": sum(p.numel() for p in target.model.parameters()),
        "drafters": args.drafter, "k": args.k, "trees": args.tree, "temperatures": args.temperature,
        "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
        "n_per_set": args.n, "repeats": getattr(args, "repeats", 1), "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
        "prompt_sets": [{"name": ps.name, "split": ps.split, "source": ps.source, "n_prompts": ps.n_used, "n_candidates": len(ps.prompts),
                         "skipped": dict(ps.skipped), "n_truncated": ps.truncated,
                         "malformed_lines": ps.bad_lines[:50]} for ps in sets],
        "dropped_sets": getattr(args, "dropped_sets", []),
        "baselines": [{"decoder": PLAIN_DECODERS[who], "temperature": t, "prompt_set": name, "tokens": b["tokens"],
                       "wall_time_s": b["seconds"], "tokens_per_s": _ratio(b["tokens"], b["seconds"])}
                      for who, group in (("spectrain", baselines), ("hf", hf_baselines or {}))
                      for (t, name), b in group.items()],
        "versions": {"spectrain": VERSION, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "git_sha": _git_sha(), "conventions": CONVENTIONS,
        "dtype_choice": _dtype_meta(target),
    }


def _dtype_meta(target) -> dict | None:
    """The dtype and why (targets/auto_dtype.py), and where the logits are computed."""
    choice = getattr(target, "dtype_choice", None)
    if choice is None:
        return None
    upcast = target.upcasts_logits() if hasattr(target, "upcasts_logits") else False
    shown = {"screened": "fp32 where they decide a token, else the 16-bit head (screened)",
             "fp32": "fp32 (norm + lm_head upcast)"}
    return {**choice.to_dict(), "logits": shown.get(target.logits_mode, "?") if upcast else str(target.dtype)[6:]}


# ---- markdown ------------------------------------------------------------------------------------------------


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def flag_line(r: dict) -> str:
    return (f"{r['drafter']} {r['config']} {r['prompt_set']}: measured speedup {r['measured_speedup']:.2f}x exceeds "
            f"tau {r['tau']:.2f}, which no speculative decoder reaches (a pass emits tau tokens and costs at least "
            "one plain pass): the timing is noise (a plain run at a slow moment); rerun with --repeats 3 (interleaved, "
            "median) or on a quiet machine")


def greedy_failures(records: list[dict]) -> list[str]:
    """One line per prompt whose greedy output parted from plain greedy at a margin above rounding noise."""
    out = []
    for r in records:
        for i, c in enumerate((r.get("greedy_check") or {}).get("prompts", [])):
            if c["verdict"] == "FAIL":
                margin = "unknown" if c["margin"] is None else f"{c['margin']:.4g}"
                tol = "-" if c["tolerance"] is None else f"{c['tolerance']:.3g}"
                out.append(f"{r['drafter']} {r['config']} {r['prompt_set']} prompt {i}: differs from plain greedy at "
                           f"token {c['first_divergence']}, target top-2 margin {margin} (near-tie tolerance {tol}): "
                           "not a rounding tie, a lossless-decoding bug")
    return out


def flags(records: list[dict]) -> list[str]:
    """One line per record whose numbers cannot be right as measured."""
    return [f"FLAG: {flag_line(r)}" for r in records if r.get("speedup_above_tau")]


def _speedup(r: dict) -> str:
    return f"{fmt_value(r['measured_speedup'])}x{' > tau!' if r.get('speedup_above_tau') else ''}"


def _fastest_plain(r: dict) -> str:
    """The faster plain decoder's tok/s and which it was (HF generate or spectrain's loop)."""
    who = {v: k for k, v in PLAIN_DECODERS.items()}.get(r.get("fastest_plain"), "spectrain")
    return f"{fmt_value(r['baseline_tokens_per_s'], 1)} ({'HF' if who == 'hf' else who})"


def _loops(r: dict) -> str:
    share = r.get("target_repeated_4gram_share")
    return "-" if share is None else f"{_pct(share)}{' LOOPS' if r.get('target_loops_dominate') else ''}"


def interval_table(records: list[dict]) -> str:
    """alpha_i with its 95% interval, one line per record (the summary table has the point values)."""
    lines = ["| drafter | config | prompt set | tau [95% CI] | alpha_i [95% CI], i = 1..k |", "|---|---|---|---|---|"]
    for r in records:
        alphas = "; ".join(fmt_ci(a, c) for a, c in zip(r["alpha"], r.get("alpha_ci") or [None] * len(r["alpha"])))
        lines.append(f"| {r['drafter']} | {r['config']} | {r['prompt_set']} | {fmt_ci(r['tau'], r.get('tau_ci'))} "
                     f"| {alphas} |")
    return "\n".join(lines)


def summary_table(records: list[dict], meta: dict) -> str:
    head = ("| drafter | config | prompt set | split | n (skipped) | tokens | alpha_1..k | tau [95% CI] | acc. rate "
            "| drafted passes | tok/s | fastest plain tok/s | speedup vs fastest plain | c | predicted | target tokens "
            "| target rep-4g |")
    sources = {r["predicted_from"] for r in records if r.get("predicted_from")}
    if sources:  # one prediction per record, named by where it comes from
        head = head.replace("| predicted |", f"| predicted ({'; '.join(sorted(sources))}) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        alphas = " ".join(fmt_value(a) for a in r["alpha"])
        lines.append(
            f"| {r['drafter']} | {r['config']} | {r['prompt_set']} | {r['split']} | {r['n_prompts']} "
            f"({r['n_skipped']}) | {r['emitted_tokens']} | {alphas} | {fmt_ci(r['tau'], r.get('tau_ci'))} "
            f"| {fmt_value(r['acceptance_rate'])} "
            f"| {_pct(r['draft_coverage'])} | {fmt_value(r['tokens_per_s'], 1)} | {_fastest_plain(r)} | {_speedup(r)} "
            f"| {fmt_value(r['c'], 3)} | {fmt_value(r['predicted_speedup'])}x | {fmt_value(r.get('target_mean_tokens'), 1)} | {_loops(r)} |")
    warn = flags(records)
    return "\n".join(lines + ([""] + warn if warn else []))


def write_markdown(path: Path, meta: dict, records: list[dict], plots: list[Path]) -> None:
    c_note = ("c given by the user (--cost-ratio)" if records and records[0]["c_source"].startswith("user")
              else "c measured in this run: drafter time / (k x target time), on this machine")
    md = [f"# spectrain eval: {meta['target']}", "",
          f"{meta['date_utc']} · {meta['device']} {meta['dtype']} · max_new_tokens={meta['max_new_tokens']} · "
          f"seed={meta['seed']} · top_p={meta['top_p']} top_k={meta['top_k']} · git {meta['git_sha'] or '-'}", "",
          f"`{meta['command']}`", ""]
    if meta.get("dtype_choice"):
        d = meta["dtype_choice"]
        md += [f"Target dtype: **{d['dtype']}**, logits {d['logits']}. Why: {d['reason']}", ""]
    if greedy_failures(records):
        md += ["**FAILURE: greedy speculative output parted from plain greedy decoding away from any near-tie of the "
               "target (lossless decoding is broken): see Greedy losslessness below.**", ""]
    md += ["Conventions:", ""]
    md += [f"- **{k}**: {v}" for k, v in CONVENTIONS.items()]
    md += [f"- **c** here: {c_note}",
           "- **drafted passes**: target passes on which the drafter proposed >= 1 token; tau = 1 + accepted "
           "tokens / passes, so passes without a draft pull tau below 1 + sum_i prod_j<=i alpha_j", "", "## Results", "", summary_table(records, meta), "",
           "### 95% intervals (tau: bootstrap over prompts; alpha_i: Wilson)", "", interval_table(records), ""]
    greedy = [r for r in records if "greedy_check" in r]
    if greedy:
        md += ["### Greedy losslessness (T = 0, per prompt: identical to plain greedy, or parted at a near-tie of the "
               "target: top-2 margin <= tolerance, docs/evaluation.md)", ""]
        md += [f"- {r['drafter']} {r['config']} {r['prompt_set']}: {greedy_line(r)}" for r in greedy]
        md += [f"- **FAILURE: {line}**" for line in greedy_failures(records)] + [""]
    md += ["## Plain decoders (same prompts, same run; speedups are against the faster one)", "",
           "| decoder | T | prompt set | tokens | seconds | tok/s |", "|---|---|---|---|---|---|"]
    md += [f"| {b.get('decoder', PLAIN_DECODERS['spectrain'])} | {b['temperature']:g} | {b['prompt_set']} | {b['tokens']} "
           f"| {b['wall_time_s']:.2f} | {fmt_value(b['tokens_per_s'], 1)} |" for b in meta["baselines"]]
    md += ["", "## Prompt sets", "", "| set | split | prompts | skipped | truncated | source |", "|---|---|---|---|---|---|"]
    for ps in meta["prompt_sets"]:
        why = "; ".join(f"{n} {r}" for r, n in ps["skipped"].items()) or "0"
        md.append(f"| {ps['name']} | {ps['split']} | {ps['n_prompts']} | {why} | {ps['n_truncated']} | "
                  f"{ps['source']} |")
    md += [f"- dropped from the default mix: **{d['name']}**: {d['reason']}" for d in meta["dropped_sets"]]
    md += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    path.write_text("\n".join(md) + "\n")


# ---- batch-size sweep (spectrain/eval/sweep.py) -----------------------------------------------------------------


def sweep_markdown(sw: dict) -> list[str]:
    """The throughput-vs-batch-size table, the crossovers, and what the prediction assumed."""
    dep, cpu = sw.get("deployment", {}), sw.get("cpu_peaks", {})
    md = ["## Batch size: throughput and the crossover", "",
          f"{sw['rows']} rows ({sw['distinct_prompts']} distinct prompts), {sw['max_new_tokens']} new tokens each, the "
          "same rows at every batch size; plain = the target alone in the same batched loop. tok/s = tokens over "
          f"the whole batch per second (median of {sw.get('repeats', 1)} interleaved repeats); latency = mean "
          "per-row seconds from the start of its batch to its last token. **predicted** = roofline model (docs/batching.md), on this machine "
          f"({cpu.get('name', '-')}: {fmt_value(cpu.get('bandwidth_GBps'), 1)} GB/s, {fmt_value(cpu.get('TFLOPs'), 3)} TFLOP/s) "
          f"and for a deployment of this target in bf16 on {dep.get('name', '-')} "
          f"({fmt_value(dep.get('bandwidth_GBps'), 0)} GB/s, {fmt_value(dep.get('TFLOPs'), 0)} TFLOP/s).", "",
          "| drafter | config | B | plain tok/s | spec tok/s | **speedup** | latency plain / spec (s) | tau "
          "| predicted, this machine | predicted, measured cost curve | predicted, deployment | greedy == plain |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sw["cells"]:
        md.append(f"| {c['drafter']} | {c['config']} | {c['batch_size']} | {fmt_value(c['plain_tokens_per_s'], 1)} "
                  f"| {fmt_value(c['tokens_per_s'], 1)} | **{fmt_value(c['speedup'])}x** | {fmt_value(c['plain_latency_s'])} / "
                  f"{fmt_value(c['latency_s'])} | {fmt_value(c['tau'])} | {fmt_value(c.get('predicted_cpu'))}x "
                  f"| {fmt_value(c.get('predicted_cost_curve'))}x | {fmt_value(c.get('predicted_deployment'))}x "
                  f"| {c.get('greedy_identical_to_plain', '-')} |")
    md += ["", "| drafter | config | crossover, measured | predicted, this machine (roofline) "
           "| predicted, measured cost curve | predicted, deployment |", "|---|---|---|---|---|---|"]

    def where(b):
        return "none in range" if b is None else f"B = {b}"

    for x in sw.get("crossover", []):
        curve = where(x["predicted_cost_curve"]) if "predicted_cost_curve" in x else "- (add --cost-curve)"
        md.append(f"| {x['drafter']} | {x['config']} | {where(x['measured'])} | {where(x['predicted_cpu'])} "
                  f"| {curve} | {where(x.get('predicted_deployment'))} |")
    md += ["", "Crossover = the largest batch size whose speculative throughput still beats plain decoding "
           f"(measured over B = {', '.join(map(str, sw['batch_sizes']))}; the deployment prediction over B = 1..512)."]
    if sw.get("skipped"):  # HF baselines: said, not silently missing
        md += ["", "Not in these tables: " + "; ".join(f"{d} ({why})" for d, why in sw["skipped"].items()) + "."]
    return md


# ---- all ---------------------------------------------------------------------------------------------------


def write_all(out_dir: Path, meta: dict, records: list[dict], batch_sweep: dict | None = None) -> list[Path]:
    """report.json, report.md and the plots (trackers are logged by the harness once the report has landed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_acceptance(out_dir, records, meta["target"]) + ([plot_tau(out_dir, records, meta["target"])]
                                                                  if records else [])
    if batch_sweep is not None:
        plots.append(plot_batch_sweep(out_dir, batch_sweep, meta["target"]))
    body = {"meta": meta, "records": records, **({"batch_sweep": batch_sweep} if batch_sweep is not None else {})}
    (out_dir / "report.json").write_text(json.dumps(body, indent=2, allow_nan=False) + "\n")
    write_markdown(out_dir / "report.md", meta, records, plots)
    if batch_sweep is not None:  # its own section, after the per-prompt-set results
        with open(out_dir / "report.md", "a") as f:
            f.write("\n" + "\n".join(sweep_markdown(batch_sweep)) + "\n")
    return [out_dir / "report.json", out_dir / "report.md", *plots]
