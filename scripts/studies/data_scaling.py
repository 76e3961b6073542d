"""Data-scaling curve: one recipe trained on the first N rows of its data (the same feature cache, data
written in a seeded shuffled order, so every prefix is a uniform sample), the training budget in
epochs (steps proportional to rows), all sizes decoded in ONE `spectrain eval` run on the same held-out
and out-of-domain prompts, tabulated as alpha_1..k and tau with 95% intervals, and plotted.

    python -m scripts.studies.data_scaling --work /tmp/ds --sizes 600,1500,3000,5000         # train, eval, table
    python -m scripts.studies.data_scaling --work /tmp/ds --sizes 600,1500 --stage train      # one stream of runs
    python -m scripts.studies.data_scaling --work /tmp/ds --sizes 600,1500,3000,5000 --stage eval

    python -m scripts.studies.data_scaling --work /tmp/ds --sizes 600,1500,3000,5000 --stage table --store smollm2_data_scaling

Stages (``--stage``): ``train`` (sizes one after another; a finished size is skipped, an interrupted one
resumes from its last checkpoint), ``eval``, ``table`` (scaling.md, scaling.json + scaling.png in --work); ``all`` runs
them in order. Held-out prompts are the full data's held-out split (``data.max_rows`` is not passed to
the eval), which no size trains on: the split is by a hash of the row id, the same for every prefix.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.gen_tables import stored
from scripts.studies.quality_study import sh

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/smollm2-135m/eagle3.yaml"
SETS = ["heldout", "spec_bench/mt_bench", "humaneval"]


def run_dir(a, n: int) -> Path:
    return a.work / f"rows{n}"


def train(a) -> None:
    for n in a.sizes:
        out = run_dir(a, n)
        if (out / "best").is_dir() and (out / "last").is_dir() and _ended(out):
            print(f"rows {n}: done already ({out})")
            continue
        ov = [f"data.max_rows={n}", "training.max_steps=0", f"training.epochs={a.epochs}", f"output_dir={out}",
              "tracking.report_to=jsonl", f"training.eval_every={a.eval_every}",
              *a.set, *(["training.resume_from=auto"] if (out / "last").is_dir() else [])]
        sh([sys.executable, "-m", "spectrain", "train", a.recipe, *ov], a.work / "logs" / f"train_rows{n}.log",
           a.threads)


def _ended(out: Path) -> bool:
    m = out / "metrics.jsonl"
    return m.is_file() and any(json.loads(x).get("event") == "end" for x in m.read_text().splitlines() if x.strip())


def evaluate(a) -> None:
    heads = a.work / "heads"
    heads.mkdir(parents=True, exist_ok=True)
    drafters = []
    for n in a.sizes:
        link = heads / f"rows{n}"
        if link.is_symlink():
            link.unlink()
        link.symlink_to((run_dir(a, n) / "best").resolve())
        drafters += ["--drafter", str(link)]
    cmd = [sys.executable, "-m", "spectrain", "eval", "--recipe", a.recipe, *drafters, "--drafter", "ngram",
           *[x for s in a.sets for x in ("--prompts", s)], "--n", str(a.n), "--max-new-tokens", str(a.max_new_tokens),
           "--k", str(a.k), "--temperature", "0", "--temperature", "1", "--seed", "0", "--out", str(a.work / "eval"),
           "--force"]
    sh(cmd, a.work / "logs" / "eval.log", a.threads)


def train_info(out: Path) -> dict:
    """rows trained on, steps, wall time and the last held-out acc_0 of one run (its metrics.jsonl)."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    end = [r for r in recs if r.get("event") == "end"]
    held = [r for r in recs if r.get("split") == "heldout"]
    steps = max((r["step"] for r in recs if "step" in r and "loss" in r), default=0)
    return {"steps": steps, "wall_s": sum(r["wall_s"] for r in end),
            "heldout_acc_0": held[-1]["eval/acc_0"] if held else None}


def _cell(value: float | None, ci) -> object:
    """A stored-table cell: [value, lo, hi] where the report has an interval, else the bare value (None where a
    position was never reached: no alpha, no interval)."""
    if value is None:
        return None
    return [value, *ci] if ci and None not in ci else {"v": value, "fmt": "num:2"}


def tables(a, recs: list[dict], name: dict) -> dict:
    """The study's tables in gen_tables' stored form ({columns, formats, rows}): the training runs, then
    alpha_1..k and tau with 95% intervals per temperature, one row per (prompt set, drafter)."""
    runs = []
    for n in a.sizes:
        i = train_info(run_dir(a, n))
        runs.append([str(n), i["steps"], i["wall_s"], i["heldout_acc_0"]])
    out = {"train": {"columns": ["rows N", "steps", "train wall s", "held-out acc_0 (training eval, own split)"],
                     "formats": ["text", "text", "num:0", "num:3"], "rows": runs}}
    for temp in sorted({r["temperature"] for r in recs}):
        rows = []
        for s in a.sets:
            for r in recs:
                if r["temperature"] != temp or r["prompt_set"] != s or r.get("k") != a.k:
                    continue
                cis = r.get("alpha_ci") or [None] * len(r["alpha"])
                alphas = [_cell(x, c) for x, c in zip(r["alpha"], cis)] + [None] * (a.k - len(r["alpha"]))
                rows.append([s, name.get(r["drafter"], Path(r["drafter"]).name), *alphas,
                             _cell(r["tau"], r.get("tau_ci"))])
        out[f"T{temp:g}"] = {"columns": ["set", "drafter (rows N)", *[f"alpha_{i + 1}" for i in range(a.k)], "tau"],
                             "formats": ["text", "text", *["ci:2"] * (a.k + 1)], "rows": rows}
    return out


def table(a) -> str:
    """scaling.md, scaling.json (the stored tables; --store copies them under eval/reference/) and scaling.png."""
    recs = json.loads((a.work / "eval" / "report.json").read_text())["records"]
    name = {str(a.work / "heads" / f"rows{n}"): f"{n}" for n in a.sizes}
    found = tables(a, recs, name)
    text = (f"EAGLE-3 ({a.recipe}), {a.epochs} epoch(s) over the first N rows; k = {a.k}, {a.n} prompts per set, "
            f"{a.max_new_tokens} new tokens; [95% intervals: alpha_i Wilson, tau bootstrap over prompts]\n")
    for key, t in found.items():
        text += f"\n**{'training runs' if key == 'train' else key.replace('T', 'T = ')}**\n\n" + stored(t)
    (a.work / "scaling.md").write_text(text)
    doc = {"provenance": f"python -m scripts.studies.data_scaling --work {a.work.name} --sizes "
                         f"{','.join(map(str, a.sizes))} --epochs {a.epochs} --n {a.n} --k {a.k} "
                         f"--max-new-tokens {a.max_new_tokens} --sets {','.join(a.sets)} ({a.recipe})",
           "tables": found}
    (a.work / "scaling.json").write_text(json.dumps(doc, indent=1))
    if a.store:
        dest = ROOT / "eval" / "reference" / f"{a.store}.json"
        dest.write_text(json.dumps({**doc, "tables": {f"{a.store}_{k}": t for k, t in found.items()}}, indent=1) + "\n")
        print(f"stored {dest.relative_to(ROOT)}: tables " + ", ".join(f"{a.store}_{k}" for k in found))
    plot(a, recs, name)
    return text


def plot(a, recs: list[dict], name: dict) -> None:
    """tau and alpha_1 against rows (log x), one line per (prompt set, T), the n-gram drafter dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (metric, ax) in zip(("tau", "alpha_1"), axes):
        for temp in sorted({r["temperature"] for r in recs}):
            for s in a.sets:
                pts = sorted((int(name[r["drafter"]]), r) for r in recs if r["drafter"] in name
                             and r["temperature"] == temp and r["prompt_set"] == s and r.get("k") == a.k)
                if not pts:
                    continue
                xs = [n for n, _ in pts]
                ys = [r["tau"] if metric == "tau" else r["alpha"][0] for _, r in pts]
                cis = [r.get("tau_ci") if metric == "tau" else (r.get("alpha_ci") or [None])[0] for _, r in pts]
                err = [[y - c[0] for y, c in zip(ys, cis)], [c[1] - y for y, c in zip(ys, cis)]] if all(cis) else None
                line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{s.split('/')[-1]} T={temp:g}")
                ng = [r for r in recs if r["drafter"] == "ngram" and r["temperature"] == temp and r["prompt_set"] == s
                      and r.get("k") == a.k]
                if ng:
                    y = ng[0]["tau"] if metric == "tau" else ng[0]["alpha"][0]
                    ax.axhline(y, ls="--", lw=0.8, color=line[0].get_color())
        ax.set_xscale("log")
        ax.set_xlabel("training rows N (first N of the shuffled data)")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} vs data (dashed: n-gram)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.work / "scaling.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="study directory (runs, eval, logs, table)")
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="recipe overrides for every size's training (e.g. the settings a stored curve was measured at)")
    ap.add_argument("--sizes", default="600,1500,3000,5000", help="comma list of N (first N rows of the data)")
    ap.add_argument("--epochs", type=int, default=1, help="epochs per size (steps = epochs x train rows // batch)")
    ap.add_argument("--eval-every", type=int, default=100, help="training held-out eval cadence (steps)")
    ap.add_argument("--stage", choices=["all", "train", "eval", "table"], default="all")
    ap.add_argument("--sets", default=",".join(SETS), help="prompt sets for the eval")
    ap.add_argument("--n", type=int, default=16, help="prompts per set")
    ap.add_argument("--k", type=int, default=4, help="draft length (alpha_1..k)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per subprocess")
    ap.add_argument("--store", default="", help="also write the tables to eval/reference/STORE.json as STORE_train, "
                    "STORE_T0, ... (rendered into the docs by scripts/gen_tables.py)")
    a = ap.parse_args(argv)
    try:
        a.sizes = [int(x) for x in a.sizes.split(",") if x]
    except ValueError:
        raise SystemExit(f"--sizes {a.sizes!r}: a comma list of row counts, e.g. 600,1500,3000") from None
    if not a.sizes or min(a.sizes) <= 0:
        raise SystemExit("--sizes: give at least one positive row count")
    a.sets = [s for s in a.sets.split(",") if s]
    a.work = a.work.resolve()
    if a.stage in ("all", "train"):
        train(a)
    if a.stage in ("all", "eval"):
        evaluate(a)
    if a.stage in ("all", "eval", "table"):
        print(table(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
