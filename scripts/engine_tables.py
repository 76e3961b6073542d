"""Store the engine study's measured tables (docs/engine.md) from its two reports.

    python scripts/engine_tables.py runs/engine-study    # -> eval/reference/engine_smollm2.json
    python scripts/engine_tables.py runs/engine-study-s14 engine_scale   # -> eval/reference/engine_scale.json
    python scripts/engine_tables.py runs/engine-draft engine_draft       # -> eval/reference/engine_draft.json
    python scripts/engine_tables.py runs/engine-pool engine_pool         # -> eval/reference/engine_pool.json
    python scripts/gen_tables.py                         # renders the tables into docs/engine.md

Reads OUT/engine/report.json (spectrain eval --engine llama.cpp, with --conform-to OUT/own/report.json) and keeps
three tables: the engine's speed and acceptance per (drafter, k, T, set) beside the speedup its cost curve
predicts, the conformance of alpha_i with spectrain's own 95% intervals, and the engine's cost curve.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from spectrain.eval import conformance

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "eval" / "reference" / "engine_smollm2.json"


LABELS = {"draft-eagle3": "EAGLE-3 head", "draft-simple": "draft model"}  # --spec-type -> the table's name


def label(rec: dict) -> str:
    kind, weights = rec["engine_spec_type"], rec.get("engine_gguf_type")
    if kind.startswith("ngram"):
        return "n-gram (engine)"
    return LABELS[kind] + (f" ({weights})" if weights and weights != "f32" else "")


def prediction(rec: dict) -> float | None:
    """The cost curve's prediction: under its own key in reports written while it stood beside tau / (1 + k c)."""
    return rec["predicted_speedup_cost_curve"] if "predicted_speedup_cost_curve" in rec else rec.get("predicted_speedup")


def speed_table(records: list[dict]) -> dict:
    rows = []
    for r in records:
        pred, meas = prediction(r), r.get("measured_speedup")
        g = r.get("greedy_check")
        rows.append([label(r), r["k"], f"{r['temperature']:g}", r["prompt_set"], r["alpha"],
                     [r["tau"], *r["tau_ci"]] if r.get("tau_ci") else r["tau"], r["acceptance_rate"], r["c"],
                     pred, meas, None if not pred or meas is None else meas / pred,
                     f"{g['identical']}+{g['near_tie']} nt/{g['n']}" if g else "-"])
    return {"columns": ["drafter", "k", "T", "set", "alpha_1..k", "tau [95% CI]", "acc. rate", "c", "predicted",
                        "measured", "measured / predicted", "greedy = plain (near-tie)"],
            "formats": ["text", "text", "text", "text", "alphas:2", "ci:2", "num:2", "num:3", "x:2", "x:2", "num:2",
                        "text"], "rows": rows}


def conformance_table(meta: dict) -> dict:
    rows = [[r["prompt_set"], r["k"], f"{r['temperature']:g}", r["position"],
             None if r["spectrain"] is None else [r["spectrain"], *r["spectrain_ci"]], r["spectrain_attempts"],
             r["engine"], r["engine_attempts"], "-" if r["inside"] is None else "yes" if r["inside"] else "NO"]
            for r in meta["conformance"]["rows"]]
    return {"columns": ["set", "k", "T", "i", "spectrain alpha_i [95% CI]", "n", "engine alpha_i", "n", "inside"],
            "formats": ["text", "text", "text", "text", "ci:2", "text", "num:2", "text", "text"], "rows": rows}


def curve_table(meta: dict) -> dict:
    curve = {int(t): s for t, s in meta["cost_curve"]["seconds"].items()}
    return {"columns": ["t", *map(str, curve)], "formats": ["text", *["num:2"] * len(curve)],
            "rows": [["cost(t) / cost(1)", *[curve[t] / curve[1] for t in curve]],
                     ["ms", *[1e3 * curve[t] for t in curve]]]}


def main(study: str, name: str = "engine") -> int:
    rep = json.loads((Path(study) / "engine" / "report.json").read_text())
    meta, records = rep["meta"], rep["records"]
    if "conformance" not in meta:  # the engine eval ran without --conform-to: pair with OUT/own afterwards
        own = conformance.load_records(Path(study) / "own" / "report.json")
        meta["conformance"] = {"rows": conformance.alpha_rows(own, records), "greedy_agreement": None}
    agree = meta["conformance"]["greedy_agreement"]
    data = {"provenance": {"what": "SmolLM2-135M-Instruct Q4_1 in llama.cpp with a spectrain drafter (EAGLE-3 head or "
                                   "draft model) and the engine's n-gram mode, beside spectrain's own evaluator "
                                   "(scripts/engine_study.sh)",
                           "command": meta["command"], "engine": meta["engine"], "date_utc": meta["date_utc"],
                           "grid_seconds": meta["grid_seconds"], "threads": meta["threads"],
                           "cost_curve_depth": meta["cost_curve"]["depth"], "greedy_agreement": agree},
            "tables": {f"{name}_speed": speed_table(records), f"{name}_conformance": conformance_table(meta),
                       f"{name}_cost_curve": curve_table(meta)}}
    out = OUT if name == "engine" else OUT.with_name(f"{name}.json")  # another study: its own file and table names
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}; plain greedy agreement engine vs spectrain: {agree}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(sys.argv[1:3] or ["runs/engine-study"])))
