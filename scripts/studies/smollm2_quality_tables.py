"""The SmolLM2 drafter-quality study's stored tables (eval/reference/smollm2_quality.json), from its eval reports
and training logs (scripts/smollm2_quality_study.sh writes them under --work):

    python -m scripts.studies.smollm2_quality_tables --work runs/study16 [--out eval/reference/smollm2_quality.json]

Tables: tau [95% CI] per head, prompt set and temperature; paired differences (spectrain compare's intervals:
prompts matched by id, resampled jointly) of every head against each reference, with the mean over sets of the
tau ratio; and the training cost of every run. scripts/gen_tables.py renders them into the docs.

Sessions do not keep each other's run directories, so what one decodes must stay usable by the next: every
record read is also stored, compactly (per-prompt counts and prompt ids, enough for the paired intervals), in
eval/reference/smollm2_quality_records.json, and a later session pairs its new heads with those without
retraining them. Table rows of heads that are neither in the reports nor in the stored records (decoded before
records were stored) are kept from the previous tables as they were.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scripts.studies.onpolicy_study import summarize
from spectrain.eval.compare import compare

ROOT = Path(__file__).resolve().parents[2]

SETS = ["heldout", "mt_bench", "humaneval"]
# (table name, reference head, compared heads)
# spectrain at speculators' optimizer (lr 1e-3, betas 0.999), 300 steps: unpacked fkl / rollouts, and packed
LR = ["e3_lr1e-3_packed", "e3_lr1e-3_fkl", "e3_lr1e-3_rollout0.5"]
PAIRED = [("sq_vs_speculators_default", "speculators_default",
           ["spectrain_default", *LR, "speculators_default_lr2e-3"]),
          ("sq_vs_speculators_lr", "speculators_default_lr2e-3", ["spectrain_default"]),
          ("sq_vs_spectrain_default", "spectrain_default", LR),
          ("sq_rollout_vs_fkl", "e3_lr1e-3_fkl", ["e3_lr1e-3_rollout0.5"]),
          ("sq_eagle3_vs_fkl", "e3_fkl", ["e3_lk", "e3_rollout0.5"]),
          ("sq_lk_vs_rerun", "e3_default_rerun", ["e3_lk_packed"]),
          ("sq_medusa_lk_vs_fkl", "medusa_fkl", ["medusa_lk"]),
          ("sq_draft_vs_fixed", "draft_fixed", ["draft_on_policy0.5"]),
          ("sq_draft_loss_vs_fixed", "draft_fixed_rerun", ["draft_tvd", "draft_rkl", "draft_jsd"]),
          # issue 31, at scale: the shipped recipe against speculators' default on the first 2,000 engine-written rows
          ("sq_scale_vs_speculators", "speculators_2000rows",
           ["spectrain_2000rows", "spectrain_lr1e-3_2000rows", "spectrain_fp32feat_2000rows",
            "spectrain_normout_2000rows"]),
          # one change each against the recipe as it is: speculators' optimizer; fp32 features of an fp32 target
          # (speculators' hidden states) instead of the shared bf16 cache; norm_output (speculators' layer layout)
          ("sq_scale_lr_vs_default", "spectrain_2000rows", ["spectrain_lr1e-3_2000rows"]),
          ("sq_scale_fp32_vs_default", "spectrain_2000rows", ["spectrain_fp32feat_2000rows"]),
          ("sq_scale_normout_vs_default", "spectrain_2000rows", ["spectrain_normout_2000rows"])]
# the at-scale run dirs under --work (scripts/smollm2_quality_study.sh e3rows*, specrows): prefix -> (trainer, head)
SCALE_RUNS = {"e3_rows": ("spectrain", "spectrain_"), "e3lr_rows": ("spectrain", "spectrain_lr1e-3_"),
              "e3fp32_rows": ("spectrain", "spectrain_fp32feat_"), "e3norm_rows": ("spectrain", "spectrain_normout_"),
              "spec_rows": ("speculators", "speculators_")}


RECORDS = ROOT / "eval/reference/smollm2_quality_records.json"
RECORD_KEYS = ("head", "drafter", "config", "prompt_set", "split", "tau", "tau_ci", "per_prompt")


def records(work: Path, stored: Path | None = None) -> list[dict]:
    """The work dir's eval records, then the stored ones of every (head, config, prompt set) it lacks."""
    key = lambda r: (r["head"], r["config"], r["prompt_set"])  # noqa: E731
    old = json.loads(stored.read_text())["records"] if stored and stored.is_file() else []
    out = {key(r): r for r in old}
    for rep in sorted(work.glob("eval300*/report.json")):  # a head decoded again replaces its stored record
        out.update((key(r), r) for r in ({k: r.get(k) for k in RECORD_KEYS[1:]} | {"head": Path(r["drafter"]).name}
                                         for r in json.loads(rep.read_text())["records"]))
    return list(out.values())


def merge_rows(old: dict | None, new: dict | None) -> dict | None:
    """``new``'s rows, and ``old``'s rows whose (first two cells) key ``new`` lacks, in ``old``'s order."""
    if old is None or new is None or old["columns"] != new["columns"]:
        return new or old
    fresh = {tuple(r[:2]): r for r in new["rows"]}
    rows = [fresh.pop(tuple(r[:2]), r) for r in old["rows"]]
    return dict(new, rows=rows + list(fresh.values()))


def temp_of(config: str) -> str:
    return config.rsplit("T=", 1)[1]


def tau_table(recs: list[dict]) -> dict:
    rows = []
    for head in dict.fromkeys(r["head"] for r in recs):
        for t in sorted({temp_of(r["config"]) for r in recs}):
            cell = {r["prompt_set"]: r for r in recs if r["head"] == head and temp_of(r["config"]) == t}
            taus = [cell[s]["tau"] for s in SETS if s in cell]
            rows.append([head, t, *([cell[s]["tau"], *cell[s]["tau_ci"]] if s in cell else None for s in SETS),
                         sum(taus) / len(taus) if taus else None])
    return {"columns": ["head", "T", *SETS, "mean"], "formats": ["text", "text", *["ci:2"] * len(SETS), "num:3"],
            "rows": rows}


def paired_table(recs: list[dict], ref: str, heads: list[str]) -> dict | None:
    report = lambda h: {"records": [r for r in recs if r["head"] == h]}  # noqa: E731
    if not report(ref)["records"]:
        return None
    rows = []
    for head in heads:
        if not report(head)["records"]:
            continue
        cells = compare(report(ref), report(head))  # B - A = head - ref, per (config, prompt set)
        for t in sorted({temp_of(c["config"]) for c in cells}):
            by = {c["prompt_set"]: c for c in cells if temp_of(c["config"]) == t}
            ratios = [by[s]["tau_b"] / by[s]["tau_a"] for s in SETS if s in by]
            rows.append([head, t, *([by[s]["diff"], *by[s]["ci"]] if s in by else None for s in SETS),
                         sum(ratios) / len(ratios), min(ratios)])
    return {"columns": ["head", "T", *SETS, f"mean tau ratio vs {ref}", "lowest set ratio"],
            "formats": ["text", "text", *["sci:2"] * len(SETS), "num:3", "num:3"], "rows": rows} if rows else None


def speculators_run(path: Path) -> dict | None:
    """run_speculators.py's summary.json in onpolicy_study.summarize's keys: per-step tokens from speculators' own
    profiler, the last validation; None while the run has not ended."""
    if not (path / "summary.json").is_file():
        return None
    s = json.loads((path / "summary.json").read_text())
    t, val = s["timing"], (s.get("val") or [{}])[-1]
    return {"steps": t["steps_logged"], "tokens_per_step": t["tokens_total"] / t["steps_logged"],
            "train_wall_s": t["wall_s"], "cpu_s_per_step": None, "eval/acc_0": val.get("full_acc_0_epoch"),
            "eval/sim_tau_t1": None}


def training_table(work: Path) -> dict:
    runs = {"spectrain_default": ("spectrain", ROOT / "runs/smollm2-eagle3"),
            "speculators_default": ("speculators", work / "spec_default"),
            "speculators_default_lr2e-3": ("speculators", work / "spec_lr2e-3"),
            **{f"e3_{v}": ("spectrain", p) for v in ("fkl", "lk", "rollout0.5")
               for p in sorted(work.glob(f"eagle3-{v}-*"))[:1]},
            **{f"e3_lr1e-3_{v}": ("spectrain", work / f"lr1e-3/eagle3-{v}-300") for v in ("packed", "fkl", "rollout0.5")},
            "e3_default_rerun": ("spectrain", work / "lk/eagle3-packed-300"),
            "e3_lk_packed": ("spectrain", work / "lk/eagle3-lk_packed-300"),
            **{f"medusa_{v}": ("spectrain", work / f"medusa/medusa-{v}-100") for v in ("fkl", "lk")},
            "draft_fixed": ("spectrain", ROOT / "runs/smollm2-draft"),
            "draft_on_policy0.5": ("spectrain", work / "draft-on_policy0.5-150"),
            "draft_fixed_rerun": ("spectrain", work / "draftdiv/draft-fixed-150"),
            **{f"draft_{v}": ("spectrain", work / f"draftdiv/draft-{v}-150") for v in ("tvd", "rkl", "jsd")},
            **{f"{head}{p.name[len(run):]}rows": (kind, p) for run, (kind, head) in SCALE_RUNS.items()
               for p in sorted(work.glob(f"{run}*")) if p.is_dir()}}
    rows = []
    for name, (kind, path) in runs.items():
        r = summarize(path) if kind == "spectrain" else speculators_run(path)
        if r is None:  # not run, or still running
            continue
        rows.append([name, kind, *(r[k] for k in ("steps", "tokens_per_step", "train_wall_s", "cpu_s_per_step",
                                                   "eval/acc_0", "eval/sim_tau_t1"))])
    return {"columns": ["run", "trainer", "steps", "tokens / step", "wall s", "CPU s / step",
                        "held-out acc_0 (each trainer's own)", "held-out T=1 proxy tau"],
            "formats": ["text", "text", "text", "num:0", "num:0", "num:2", "num:3", "num:2"], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "eval/reference/smollm2_quality.json")
    ap.add_argument("--records", type=Path, default=RECORDS, help="the stored per-prompt records (read and rewritten)")
    a = ap.parse_args(argv)
    if not any(a.work.glob("eval300*/report.json")):
        raise SystemExit(f"no eval300*/report.json under {a.work}: run scripts/smollm2_quality_study.sh first")
    recs = records(a.work, a.records)
    old = json.loads(a.out.read_text())["tables"] if a.out.is_file() else {}
    new = {"sq_tau": tau_table(recs), "sq_training": training_table(a.work),
           **{name: paired_table(recs, ref, heads) for name, ref, heads in PAIRED}}
    tables = {n: t for n in dict.fromkeys([*old, *new]) if (t := merge_rows(old.get(n), new.get(n)))}
    prov = {"what": "scripts/smollm2_quality_study.sh: spectrain's EAGLE-3 default against speculators 0.9.0 at equal "
                    "budget, EAGLE-3 loss / rollout variants, draft-model on-policy distillation, on "
                    "SmolLM2-135M-Instruct; decoded by spectrain's lossless decoder (chain k=3, 48 new tokens, seed 0)",
            "command": "bash scripts/smollm2_quality_study.sh && python -m scripts.studies.smollm2_quality_tables --work "
                       "runs/study16; at scale (the *_2000rows heads): ROWS=2000 SCALE_STEPS=238 THREADS=2 "
                       "W=runs/study31 STAGES='rows specdata specrows e3rows e3rowslr e3rowsfp32 e3rowsnorm evalrows evalrowslr evalrowsfp32 evalrowsnorm table' bash "
                       "scripts/smollm2_quality_study.sh",
            "settings": "tau with 95% bootstrap intervals over prompts; paired tables: head - reference with the "
                        "paired 95% interval (prompts matched by id), then the mean and the lowest of the per-set "
                        "tau ratios",
            "machine": "SmolLM2-135M-Instruct (fp32, dequantized GGUF), 2-core CPU, one torch thread per job, two "
                       "jobs at a time"}
    a.out.write_text(json.dumps({"provenance": prov, "tables": tables}, indent=1) + "\n")
    a.records.write_text(json.dumps({"what": "per-prompt records of every head decoded by "
                                             "scripts/smollm2_quality_study.sh (read by smollm2_quality_tables.py)",
                                     "records": recs}) + "\n")
    print(f"wrote {a.out}: {', '.join(tables)}; {a.records}: {len(recs)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
