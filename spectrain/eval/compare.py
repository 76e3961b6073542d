"""`spectrain compare EVAL_A EVAL_B`: two eval reports side by side, paired per prompt.

    spectrain compare runs/run-a/eval runs/run-b/eval        # directories or their report.json

Cells are matched by (decode config, prompt set); within a cell, prompts are matched by id (a hash of the
token ids the target saw, ``per_prompt.ids`` in report.json), so only prompts both evals decoded count.
For each cell it prints tau of A and of B and the paired difference B - A with its 95% interval
(prompts resampled jointly: ``spectrain.eval.stats.paired_diff_ci``), which is much tighter than comparing the
two marginal intervals; then a one-line verdict. When a report holds several drafters, ``--drafter-a`` /
``--drafter-b`` pick one (a spec as evaluated, or its last path parts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spectrain.eval import stats


def add_compare_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("a", metavar="EVAL_A", help="an eval output directory or its report.json (the baseline)")
    p.add_argument("b", metavar="EVAL_B", help="an eval output directory or its report.json (compared with A)")
    p.add_argument("--drafter-a", default=None, help="the drafter of A to compare, when A holds several")
    p.add_argument("--drafter-b", default=None, help="the drafter of B to compare, when B holds several")
    return p


def load_report(path) -> dict:
    p = Path(path)
    file = p / "report.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"{p}: no report.json there; give a `spectrain eval --out` directory or its report.json")
    try:
        report = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); rerun the eval") from None
    if not isinstance(report, dict) or not isinstance(report.get("records"), list):
        raise ValueError(f"{file} is not a spectrain eval report (no 'records' list)")
    return report


def _matches(spec: str, want: str) -> bool:
    return spec == want or Path(spec).parts[-len(Path(want).parts):] == Path(want).parts


def pick(records: list[dict], want: str | None, side: str) -> list[dict]:
    """The records of one drafter: ``want``, or the only drafter of the report."""
    drafters = list(dict.fromkeys(r["drafter"] for r in records))
    chosen = [d for d in drafters if _matches(d, want)] if want else drafters
    if len(chosen) != 1:
        what = f"--drafter-{side} {want!r} matches {len(chosen)}" if want else f"report {side.upper()} holds {len(chosen)}"
        raise ValueError(f"{what} drafters ({', '.join(drafters)}): pick one with --drafter-{side}")
    return [r for r in records if r["drafter"] == chosen[0]]


def paired(ra: dict, rb: dict) -> dict | None:
    """tau of both and the paired difference B - A over the prompts both decoded, or None if none is shared."""
    pa, pb = ra.get("per_prompt") or {}, rb.get("per_prompt") or {}
    if not pa or not pb:
        return None
    ida, idb = pa.get("ids"), pb.get("ids")
    if ida and idb:
        where_b = {i: n for n, i in enumerate(idb)}
        pairs = [(n, where_b[i]) for n, i in enumerate(ida) if i in where_b]
        how = "id"
    else:  # a report written before prompt ids: the same set in the same order, as far as both go
        pairs = [(n, n) for n in range(min(len(pa["tokens"]), len(pb["tokens"])))]
        how = "position"
    if not pairs:
        return None
    ta, na = [pa["tokens"][i] for i, _ in pairs], [pa["passes"][i] for i, _ in pairs]
    tb, nb = [pb["tokens"][j] for _, j in pairs], [pb["passes"][j] for _, j in pairs]
    diff, ci = stats.paired_diff_ci(tb, nb, ta, na)
    return {"config": ra["config"], "prompt_set": ra["prompt_set"], "split": ra["split"], "n": len(pairs),
            "matched_by": how, "tau_a": sum(ta) / sum(na), "tau_b": sum(tb) / sum(nb), "diff": diff, "ci": ci}


def compare(a: dict, b: dict, drafter_a: str | None = None, drafter_b: str | None = None) -> list[dict]:
    """One paired row per (config, prompt set) cell both reports hold."""
    ra, rb = pick(a["records"], drafter_a, "a"), pick(b["records"], drafter_b, "b")
    by_cell = {(r["config"], r["prompt_set"]): r for r in rb}
    rows = [row for r in ra if (r["config"], r["prompt_set"]) in by_cell
            for row in [paired(r, by_cell[(r["config"], r["prompt_set"])])] if row]
    if not rows:
        cells = lambda rs: ", ".join(sorted({f"{r['config']} {r['prompt_set']}" for r in rs}))  # noqa: E731
        raise ValueError(f"the reports share no (config, prompt set) cell with paired prompts: A has {cells(ra)}; "
                         f"B has {cells(rb)}. Evaluate both with the same --k/--tree, --temperature and --prompts")
    return rows


def verdict(rows: list[dict]) -> str:
    up = sum(r["ci"][0] is not None and r["ci"][0] > 0 for r in rows)
    down = sum(r["ci"][1] is not None and r["ci"][1] < 0 for r in rows)
    mean = sum(r["diff"] for r in rows) / len(rows)
    who = "B is better" if up and not down else "A is better" if down and not up else \
        "mixed" if up and down else "no clear difference"
    return (f"verdict: {who}: tau B - A averages {mean:+.3f} over {len(rows)} cells; the paired 95% interval is above 0 "
            f"on {up}, below 0 on {down}, and contains 0 on {len(rows) - up - down}")


def table(rows: list[dict]) -> str:
    lines = ["| config | prompt set | split | prompts paired | tau A | tau B | B - A [95% paired CI] |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci"]
        ci = "-" if lo is None else f"[{lo:+.3f}, {hi:+.3f}]"
        mark = " *" if lo is not None and (lo > 0 or hi < 0) else ""
        lines.append(f"| {r['config']} | {r['prompt_set']} | {r['split']} | {r['n']}"
                     f"{' (by position)' if r['matched_by'] == 'position' else ''} | {r['tau_a']:.3f} | "
                     f"{r['tau_b']:.3f} | {r['diff']:+.3f} {ci}{mark} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    a, b = load_report(args.a), load_report(args.b)
    rows = compare(a, b, args.drafter_a, args.drafter_b)
    da, db = pick(a["records"], args.drafter_a, "a")[0]["drafter"], pick(b["records"], args.drafter_b, "b")[0]["drafter"]
    print(f"A: {args.a} (drafter {da})\nB: {args.b} (drafter {db})\n")
    print(table(rows))
    print("\n* = the paired interval excludes 0 (prompts matched by id, resampled jointly; "
          f"{stats.N_BOOT} bootstrap replicates)")
    print(verdict(rows))
    return 0
