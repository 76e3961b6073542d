"""`spectrain compare EVAL_A EVAL_B`: two eval reports side by side, paired per prompt.

    spectrain compare runs/run-a/eval runs/run-b/eval        # directories or their report.json

Cells are matched by (decode config, prompt set); within a cell, prompts are matched by id (a hash of the
token ids the target saw, ``per_prompt.ids`` in report.json), so only prompts both evals decoded count.
For each cell it prints tau of A and of B and the paired difference B - A with its 95% interval
(prompts resampled jointly: ``spectrain.eval.stats.paired_diff_ci``), which is much tighter than comparing the
two marginal intervals; then a one-line verdict. When a report holds several drafters, ``--drafter-a`` /
``--drafter-b`` pick one (a spec as evaluated, or its last path parts).

Only comparable reports are compared. A difference in what tau depends on is refused in one line listing
each one (REFUSED: the target (fingerprint, or architecture, parameter count and model name where no
fingerprint is recorded), max_new_tokens, dtype, the chat template (recorded, or whether
``--no-chat-template`` was given), top_p, top_k). A difference that leaves tau's meaning alone is printed
above the table (SHOWN: the target's path when only its directory differs, seed, device, prompts per set,
a prompt set's source or size: prompts are paired by id, so only prompts both evals decoded count; a report
without ids is paired by position and such a set difference is refused). A fact only one report records is
shown as unchecked. Counts are checked on load: a NaN, infinite, negative or fractional count, a record
whose per-prompt lists differ in length, or a missing field is refused naming the file and the field.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from spectrain.eval import stats


def add_compare_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("a", metavar="EVAL_A", help="an eval output directory or its report.json (the baseline)")
    p.add_argument("b", metavar="EVAL_B", help="an eval output directory or its report.json (compared with A)")
    p.add_argument("--drafter-a", default=None, help="the drafter of A to compare, when A holds several")
    p.add_argument("--drafter-b", default=None, help="the drafter of B to compare, when B holds several")
    return p


class ReportError(ValueError):
    """A report that cannot be compared: damaged, hand-edited, or made under other settings."""


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
    if not isinstance(report.get("meta", {}), dict):
        _bad(file, "meta", "is not an object")
    for i, rec in enumerate(report["records"]):
        _check_record(file, f"records[{i}]", rec)
    return report


def _bad(file, field: str, problem: str):
    raise ReportError(f"{file}: {field} {problem}: the report was edited or damaged; rerun the eval that wrote it")


def _check_record(file, where: str, rec) -> None:
    """The fields compare reads, and counts that can be real: whole numbers >= 0, lists of one length."""
    if not isinstance(rec, dict):
        _bad(file, where, "is not an object")
    for key in ("drafter", "config", "prompt_set", "split"):
        if not isinstance(rec.get(key), str):
            _bad(file, f"{where}.{key}", "is missing or not a string")
    pp = rec.get("per_prompt")
    if pp is None or pp == {}:
        return  # a record without per-prompt data is not paired (older reports)
    if not isinstance(pp, dict):
        _bad(file, f"{where}.per_prompt", "is not an object")
    lists = {k: pp.get(k) for k in ("tokens", "passes", "ids") if k in pp and (k != "ids" or pp[k] is not None)}
    for k in ("tokens", "passes"):
        if not isinstance(lists.get(k), list):
            _bad(file, f"{where}.per_prompt.{k}", "is missing or not a list")
    if "ids" in lists and (not isinstance(lists["ids"], list) or not all(isinstance(x, str) for x in lists["ids"])):
        _bad(file, f"{where}.per_prompt.ids", "is not a list of prompt ids (strings)")
    if len({len(v) for v in lists.values()}) > 1:
        sizes = ", ".join(f"{k} has {len(v)}" for k, v in lists.items())
        _bad(file, f"{where}.per_prompt", f"lists disagree in length ({sizes}; one entry per prompt each)")
    for k in ("tokens", "passes"):
        for j, x in enumerate(lists[k]):
            _check_count(file, f"{where}.per_prompt.{k}[{j}]", x)
    for j, (t, n) in enumerate(zip(lists["tokens"], lists["passes"])):
        if t > 0 and n == 0:
            _bad(file, f"{where}.per_prompt.passes[{j}]", f"is 0 while tokens[{j}] is {t} (every token takes a "
                 "target pass)")


def _check_count(file, field: str, x) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        _bad(file, field, f"is {x!r}, not a number")
    if not math.isfinite(x):
        _bad(file, field, f"is {x} (a count is finite)")
    if x < 0 or x != int(x):
        _bad(file, field, f"is {x} (a count is a whole number >= 0)")


def _template_use(meta: dict) -> str | None:
    """Whether the eval rendered prompts with the target's chat template (its command line says)."""
    if not meta.get("command"):
        return None
    return "none (--no-chat-template)" if "--no-chat-template" in str(meta["command"]).split() else "the target's"


# What tau depends on: a difference is refused. Each is a meta key or a function of meta.
MUST_MATCH = {"target fingerprint": "target_fingerprint", "target architecture": "target_architecture",
              "target parameters": "target_parameters", "max_new_tokens": "max_new_tokens", "dtype": "dtype",
              "chat template": "chat_template", "chat template use": _template_use, "top_p": "top_p", "top_k": "top_k"}
# What leaves tau's meaning alone (another path to the same model, random draws, placement): shown.
SHOWN = {"target": "target", "seed": "seed", "device": "device", "prompts per set": "n_per_set"}


def _fact(meta: dict, how):
    return how(meta) if callable(how) else meta.get(how)


def _target_name_refused(ma: dict, mb: dict) -> bool:
    """Without fingerprints, another model name is another target; the same name under another directory
    (a relative and an absolute path, a copy) is only shown."""
    if ma.get("target_fingerprint") and mb.get("target_fingerprint"):
        return False
    na, nb = (Path(str(m.get("target") or "")).name for m in (ma, mb))
    return bool(na and nb and na != nb)


def meta_differences(ma: dict, mb: dict) -> tuple[list[str], list[str]]:
    """(refused, shown) differences between the metas of A and B, each as 'what A vs B'."""
    refused, shown = [], []
    for what, how in {**MUST_MATCH, **SHOWN}.items():
        va, vb = _fact(ma, how), _fact(mb, how)
        if va is None and vb is None or va == vb:
            continue
        if va is None or vb is None:
            shown.append(f"{what} recorded only by {'B' if va is None else 'A'} ({va if vb is None else vb}): "
                         "not checked")
            continue
        line = f"{what} {va} vs {vb} (A vs B{'' if what in MUST_MATCH else '; tau means the same'})"
        (refused if what in MUST_MATCH or (what == "target" and _target_name_refused(ma, mb)) else shown).append(line)
    return refused, shown


def set_differences(ma: dict, mb: dict, rows: list[dict]) -> tuple[list[str], list[str]]:
    """A compared prompt set with another source or size: shown when prompts were paired by id (only the ones
    both decoded count), refused when paired by position (the prompts may not be the same)."""
    sets = [{ps.get("name"): ps for ps in m.get("prompt_sets") or [] if isinstance(ps, dict)} for m in (ma, mb)]
    refused, shown = [], []
    for row in rows:
        a, b = (s.get(row["prompt_set"]) for s in sets)
        if not a or not b:
            continue
        diff = [f"{k} {a.get(k)} vs {b.get(k)}" for k in ("source", "n_prompts") if a.get(k) != b.get(k)]
        if diff:
            line = f"prompt set {row['prompt_set']}: {', '.join(diff)} (A vs B; prompts paired by {row['matched_by']})"
            (refused if row["matched_by"] == "position" else shown).append(line)
    return list(dict.fromkeys(refused)), list(dict.fromkeys(shown))


def comparable(a: dict, b: dict, rows: list[dict], names: tuple[str, str] = ("A", "B")) -> list[str]:
    """Refuse reports made under settings tau depends on (one line listing each difference); return the
    harmless differences to show above the table."""
    ma, mb = a.get("meta") or {}, b.get("meta") or {}
    refused, shown = meta_differences(ma, mb)
    set_refused, set_shown = set_differences(ma, mb, rows)
    if refused or set_refused:
        raise ReportError(f"{names[0]} and {names[1]} are not comparable: {'; '.join(refused + set_refused)}; tau "
                          "depends on each: evaluate both with the same target and settings")
    return shown + set_shown


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
    if not sum(pa["passes"][i] for i, _ in pairs) or not sum(pb["passes"][j] for _, j in pairs):
        return None  # nothing decoded in one of them: no tau to compare
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
    shown = comparable(a, b, rows, (args.a, args.b))
    da, db = pick(a["records"], args.drafter_a, "a")[0]["drafter"], pick(b["records"], args.drafter_b, "b")[0]["drafter"]
    print(f"A: {args.a} (drafter {da})\nB: {args.b} (drafter {db})\n")
    for line in shown:
        print(f"note: {line}")
    if shown:
        print()
    print(table(rows))
    print("\n* = the paired interval excludes 0 (prompts matched by id, resampled jointly; "
          f"{stats.N_BOOT} bootstrap replicates)")
    print(verdict(rows))
    return 0
