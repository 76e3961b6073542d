"""Does spectrain's evaluator agree with the serving engine? Per-position acceptance side by side.

    spectrain eval --target T.gguf --drafter RUN --prompts ... --out runs/own          # spectrain's own loop
    spectrain eval --engine llama.cpp --target T.gguf --drafter RUN --prompts ... --conform-to runs/own/report.json

For every (prompt set, k, T) both reports hold for a trained drafter, each alpha_i of the engine is checked
against spectrain's 95% Wilson interval; tau and the acceptance rate stand beside each other. The two targets
differ in arithmetic (the engine computes with the GGUF's quantized weights in integer kernels, spectrain with
the dequantized weights in fp32 or bf16), so their greedy tokens are compared too: how many prompts the two
plain targets answer identically, and where they first part.
"""

from __future__ import annotations

import json
from pathlib import Path

TRAINING_FREE = ("ngram", "none")


def _trained(records: list[dict]) -> dict[tuple, dict]:
    """(prompt set, k, T) -> the record of the one trained drafter (n-gram and HF rows are not compared)."""
    out = {}
    for r in records:
        name = str(r["drafter"])
        if name in TRAINING_FREE or name.startswith(("hf:", "ngram-")):
            continue
        out.setdefault((r["prompt_set"], r["k"], r["temperature"]), r)
    return out


def alpha_rows(own: list[dict], engine: list[dict]) -> list[dict]:
    """One row per (set, k, T, position): spectrain's alpha_i with its interval, the engine's, inside or not."""
    mine, theirs = _trained(own), _trained(engine)
    rows = []
    for key in sorted(set(mine) & set(theirs)):
        a, b = mine[key], theirs[key]
        for i, (alpha, ci) in enumerate(zip(a["alpha"], a.get("alpha_ci") or [])):
            e = b["alpha"][i] if i < len(b["alpha"]) else None
            inside = None if e is None or alpha is None or ci is None else bool(ci[0] <= e <= ci[1])
            rows.append({"prompt_set": key[0], "k": key[1], "temperature": key[2], "position": i + 1,
                         "spectrain": alpha, "spectrain_ci": ci, "spectrain_attempts": a["attempts"][i],
                         "engine": e, "engine_attempts": b["attempts"][i] if i < len(b["attempts"]) else 0,
                         "inside": inside, "tau_spectrain": a["tau"], "tau_engine": b["tau"]})
    return rows


def greedy_agreement(own_outputs: list[list[int]], engine_outputs: list[list[int]]) -> dict:
    """How the two plain targets' greedy answers compare: identical prompts, mean shared prefix length."""
    prefix = []
    for a, b in zip(own_outputs, engine_outputs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n)
    same = sum(a == b for a, b in zip(own_outputs, engine_outputs))
    return {"prompts": len(prefix), "identical": same,
            "mean_shared_prefix": sum(prefix) / len(prefix) if prefix else None, "shared_prefix": prefix}


def _fmt(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(rows: list[dict], agreement: dict | None) -> str:
    lines = ["## Conformance: spectrain's evaluator against the engine", "",
             "| set | k | T | i | spectrain alpha_i [95% CI] (n) | engine alpha_i (n) | inside | tau spectrain / engine |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = "-" if r["spectrain_ci"] is None else f"[{r['spectrain_ci'][0]:.2f}, {r['spectrain_ci'][1]:.2f}]"
        lines.append(f"| {r['prompt_set']} | {r['k']} | {r['temperature']:g} | {r['position']} | "
                     f"{_fmt(r['spectrain'])} {ci} ({r['spectrain_attempts']}) | {_fmt(r['engine'])} "
                     f"({r['engine_attempts']}) | {'-' if r['inside'] is None else 'yes' if r['inside'] else 'NO'} | "
                     f"{_fmt(r['tau_spectrain'])} / {_fmt(r['tau_engine'])} |")
    if agreement:
        lines += ["", f"Plain greedy answers, spectrain's target vs the engine's: {agreement['identical']}/"
                      f"{agreement['prompts']} identical, mean shared prefix {_fmt(agreement['mean_shared_prefix'], 1)} "
                      "tokens."]
    return "\n".join(lines) + "\n"


def load_report(path) -> dict:
    """A spectrain eval report ({"meta", "records"}); ValueError naming the path when it is not one."""
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        rep = json.loads(p.read_text())
        if not isinstance(rep.get("records"), list):
            raise KeyError("records")
        return rep
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"--conform-to {path}: not a spectrain eval report ({type(e).__name__}: {e})") from e


def load_records(path) -> list[dict]:
    return load_report(path)["records"]
