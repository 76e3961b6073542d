"""EAGLE-3 head quality study: train single-change variants of the tiny recipe at equal budget, decode
them all (and the speculators reference head) in ONE `spectrain eval` run, and tabulate tau with 95%
bootstrap intervals.

    python -m scripts.studies.quality_study --steps 200 --work /tmp/qs                       # every variant
    python -m scripts.studies.quality_study --steps 800 --work /tmp/qs --variants main,best   # a subset
    python -m scripts.studies.quality_study --steps 200 --work /tmp/qs --speculators          # + the reference head
    python -m scripts.studies.quality_study --steps 200 --work /tmp/qs --speculators --spec-default  # + its default layout
    python -m scripts.studies.quality_study --steps 200 --work /tmp/qs --stage eval --extra spec=/tmp/qs/spec200/head
    python -m scripts.studies.quality_study ... --device cuda                                 # on a GPU

Stages (``--stage``): ``train`` (variants one after another; a variant whose ``best/`` exists is
skipped, so an interrupted study resumes), ``speculators`` (the public speculators 0.9.0 trainer on
exactly the rows spectrain consumes in its first N steps, through ../shared/anchors/speculators_cpu,
converted into a spectrain head), ``eval`` (one decoding run over every head), ``table``; ``all``
runs them in that order. Every variant is the tiny recipe with main's settings pinned (VARIANTS
lists the overrides), so changing the recipe's defaults does not change what "main" means here.
Each subprocess runs with ``--threads`` torch threads (default 1: the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny/eagle3.yaml"
SETS = ["heldout", "spec_bench/mt_bench", "spec_bench/summarization", "spec_bench/math_reasoning",
        "spec_bench/rag", "humaneval"]
# spectrain as on main before the study (the recipe's defaults may change; this stays fixed)
MAIN = ["drafter.eagle3.lm_head_init=random", "drafter.eagle3.freeze_lm_head=false", "drafter.eagle3.fc_norm=false",
        *(f"drafter.eagle3.{f}=false" for f in ("norm_before_fc", "norm_before_residual", "norm_output")),
        "training.adam_betas=0.9,0.95", "drafter.eagle3.loss_positions=predicted",
        "drafter.eagle3.out_of_vocab=mask", "training.packing=false", "training.lr=1e-3"]
FROZEN = ["drafter.eagle3.lm_head_init=target", "drafter.eagle3.freeze_lm_head=true"]
VARIANTS: dict[str, list[str]] = {
    "main": [],
    "lmhead_frozen": FROZEN,  # speculators' lm_head handling
    "lmhead_trained": ["drafter.eagle3.lm_head_init=target"],
    "frozen_norm": ["drafter.eagle3.lm_head_init=target_with_norm", "drafter.eagle3.freeze_lm_head=true"],
    "frozen_betas999": FROZEN + ["training.adam_betas=0.9,0.999"],
    "frozen_lr2e-3": FROZEN + ["training.lr=2e-3"],
    "frozen_input_rule": FROZEN + ["drafter.eagle3.loss_positions=input"],
    "frozen_keep_oov": FROZEN + ["drafter.eagle3.out_of_vocab=keep"],
    "frozen_packing": FROZEN + ["training.packing=true", "training.micro_batch_size=8"],
    "best": ["drafter.eagle3.lm_head_init=target_with_norm", "drafter.eagle3.freeze_lm_head=true",
             "training.adam_betas=0.9,0.999"],
}
NORMS = ["drafter.eagle3.norm_before_fc=true", "drafter.eagle3.norm_before_residual=true",
         "drafter.eagle3.norm_output=true"]  # speculators' default layer layout
VARIANTS["best_norms"] = VARIANTS["best"] + NORMS
VARIANTS["best_nbr"] = VARIANTS["best"] + NORMS[1:2]  # norm_before_residual only (what every vLLM computes)
VARIANTS["best_norms_lr2e-3"] = VARIANTS["best_norms"] + ["training.lr=2e-3"]
VARIANTS["best_norms_lr3e-3"] = VARIANTS["best_norms"] + ["training.lr=3e-3"]
VARIANTS["best_norms_decay1"] = VARIANTS["best_norms"] + ["drafter.eagle3.ttt_decay=1.0"]
VARIANTS["best_norms_rules"] = VARIANTS["best_norms"] + ["drafter.eagle3.loss_positions=input",
                                                        "drafter.eagle3.out_of_vocab=keep"]  # speculators' rules


def sh(cmd: list[str], log: Path, threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), SPECTRAIN_NUM_THREADS=str(threads),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", SPECULATORS_CPU_THREADS=str(threads))
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}; see {log}")


def train_variants(a) -> None:
    for name in a.variants:
        out = a.work / f"steps{a.steps}" / name
        if (out / "best").is_dir() and (out / "last").is_dir():
            print(f"{name}: done already ({out})")
            continue
        ov = [*MAIN, *VARIANTS[name], f"output_dir={out}", f"training.max_steps={a.steps}",
              f"training.eval_every={a.steps // 2}", f"training.checkpoint_every={a.steps}",
              f"data.cache_dir={a.work / 'cache'}", "tracking.report_to=jsonl",
              *(["training.resume_from=auto"] if (out / "last").is_dir() else [])]
        sh([sys.executable, "-m", "spectrain", "train", RECIPE, *ov], a.work / "logs" / f"train{a.steps}_{name}.log",
           a.threads)


def speculators(a) -> None:
    """The reference head: rows -> hidden states (speculators venv) -> speculators train -> spectrain head."""
    py, anc, w = str(Path(a.spec_venv) / "bin" / "python"), Path(a.anchor), a.work
    rows, data, run, head = w / f"rows{a.steps}", w / f"spec-data{a.steps}", w / f"spec{a.steps}", w / f"spec{a.steps}" / "head"
    log = w / "logs" / f"speculators{a.steps}.log"
    if not (rows / "rows.jsonl").is_file():
        sh([sys.executable, str(anc / "export_spectrain_rows.py"), "--recipe", RECIPE, "--cache-dir",
            str(w / "cache"), "--out", str(rows), "--first-steps", str(a.steps)], log, a.threads)
    if not (data / "harness_meta.json").is_file():
        sh([py, str(anc / "make_offline_from_rows.py"), "--rows", str(rows / "rows.jsonl"), "--token-freq",
            str(rows / "token_freq_train.pt"), "--target", "assets/reference-target", "--out", str(data),
            "--seq-len", "256"], log, a.threads)
    meta = json.loads((rows / "rows_meta.json").read_text())
    ratio = (meta["train"]["rows"] + 0.5) / (meta["train"]["rows"] + meta["heldout"]["rows"])
    common = [py, str(anc / "run_speculators.py"), "--target", "assets/reference-target", "--data", str(data),
              "--steps", str(a.steps), "--ttt-steps", "5", "--lr", "1e-3", "--draft-vocab-size", "2048",
              "--total-seq-len", "1090", "--scheduler", "cosine", "--warmup-steps", "30", "--hs-dtype", "float32",
              "--train-ratio", f"{ratio:.8f}", "--", "--ttt-step-loss-decay", "0.8", "--weight-decay", "0.0"]
    if a.speculators and not (run / "ckpt" / "0" / "config.json").is_file():  # norm flags off: main's layer
        sh([*common[:6], "--run-dir", str(run), *common[6:], "--no-norm-before-residual", "--no-norm-before-fc",
            "--no-norm-output"], log, a.threads)
    default = w / f"spec{a.steps}_norms"  # speculators' default layout (norm flags on), imported by spectrain
    if a.spec_default and not (default / "ckpt" / "0" / "config.json").is_file():
        sh([*common[:6], "--run-dir", str(default), *common[6:]], log, a.threads)
    for lr in a.spec_default_lrs:  # the fairness check: speculators' default layout at spectrain's lr
        run_lr = w / f"spec{a.steps}_norms_lr{lr}"
        if not (run_lr / "ckpt" / "0" / "config.json").is_file():
            at = common.index("--lr") + 1
            sh([*common[:6], "--run-dir", str(run_lr), *common[6:at], lr, *common[at + 1:]], log, a.threads)
    if a.speculators and not (head / "drafter_config.json").is_file():
        sh([py, str(anc / "to_spectrain.py"), "--src", str(run / "ckpt" / "0"), "--out", str(head),
            "--target", "assets/reference-target", "--ttt-decay", "0.8"], log, a.threads)


def heads(a) -> dict[str, Path]:
    """name -> head dir, via symlinks named after the variant (the report names drafters by path)."""
    link_dir = a.work / f"heads{a.steps}"
    link_dir.mkdir(parents=True, exist_ok=True)
    found = {n: a.work / f"steps{a.steps}" / n / "best" for n in a.variants}
    found.update({n: Path(p) for n, p in (e.split("=", 1) for e in a.extra)})
    if a.speculators and (a.work / f"spec{a.steps}" / "head").is_dir():
        found["speculators"] = a.work / f"spec{a.steps}" / "head"
    if a.spec_default and (a.work / f"spec{a.steps}_norms" / "ckpt" / "0").is_dir():
        found["speculators_default"] = a.work / f"spec{a.steps}_norms" / "ckpt" / "0"  # spectrain's import reads it
    for lr in a.spec_default_lrs:
        if (a.work / f"spec{a.steps}_norms_lr{lr}" / "ckpt" / "0").is_dir():
            found[f"speculators_default_lr{lr}"] = a.work / f"spec{a.steps}_norms_lr{lr}" / "ckpt" / "0"
    out = {}
    for name, path in found.items():
        if not path.is_dir():
            print(f"note: {name}: {path} missing, left out of the eval", file=sys.stderr)
            continue
        link = link_dir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(path.resolve())
        out[name] = link
    return out


def evaluate(a) -> None:
    hs = heads(a)
    cmd = [sys.executable, "-m", "spectrain", "eval", "--recipe", RECIPE, *[x for p in hs.values() for x in
           ("--drafter", str(p))], *[x for s in a.sets for x in ("--prompts", s)], "--n", str(a.n),
           "--max-new-tokens", "64", "--k", "5", "--temperature", "0", "--temperature", "1", "--seed", "0",
           "--out", str(a.work / f"eval{a.steps}{a.tag}"), "--force"]
    if a.device:
        cmd += ["--device", a.device]
    sh(cmd, a.work / "logs" / f"eval{a.steps}{a.tag}.log", a.threads)


def table(a) -> str:
    """tau [95% CI] per head and prompt set, T=0 and T=1, from the eval's report.json."""
    # decoding is deterministic per (head, prompt, seed + i), so evals split over several runs (tags) on
    # the same prompts merge into one table; a (head, set, T) cell in several runs is taken from the first
    recs, seen = [], set()
    for rep in sorted(a.work.glob(f"eval{a.steps}*/report.json")):
        for r in json.loads(rep.read_text())["records"]:
            key = (Path(r["drafter"]).name, r["prompt_set"], r["temperature"])
            if key not in seen:
                seen.add(key)
                recs.append(r)
    sets = list(dict.fromkeys(r["prompt_set"] for r in recs))
    lines = []
    for temp in sorted({r["temperature"] for r in recs}):
        lines += [f"\n{a.steps} steps, T={temp:g}: tau [95% CI over prompts]", "",
                  "| head | " + " | ".join(s.replace("spec_bench/", "sb/") for s in sets) + " | mean |",
                  "|---" * (len(sets) + 2) + "|"]
        for d in dict.fromkeys(r["drafter"] for r in recs):
            row = {r["prompt_set"]: r for r in recs if r["drafter"] == d and r["temperature"] == temp}
            cells = []
            for s in sets:
                r = row.get(s)
                ci = (r or {}).get("tau_ci")
                cells.append("-" if r is None else f"{r['tau']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
            taus = [row[s]["tau"] for s in sets if s in row]
            lines.append(f"| {Path(d).name} | " + " | ".join(cells) + f" | {sum(taus) / max(len(taus), 1):.3f} |")
    for ref in a.refs:  # default: speculators with the norm flags off (equal layer) / with its own defaults
        lines += paired_vs(recs, sets, ref)
    text = "\n".join(lines)
    (a.work / f"table{a.steps}.md").write_text(text + "\n")
    return text


def paired_vs(recs: list[dict], sets: list[str], ref: str) -> list[str]:
    """tau(head) - tau(ref) per set with a paired 95% bootstrap interval (same prompts, resampled jointly),
    and the mean over sets of tau(head) / tau(ref)."""
    from spectrain.eval.stats import paired_diff_ci

    by = {(Path(r["drafter"]).name, r["temperature"], r["prompt_set"]): r for r in recs}
    heads = [h for h in dict.fromkeys(Path(r["drafter"]).name for r in recs) if h != ref]
    if not any(k[0] == ref for k in by):
        return []
    out = []
    for temp in sorted({r["temperature"] for r in recs}):
        out += [f"\nT={temp:g}: tau(head) - tau({ref}) [paired 95% CI]; last column: mean over sets of "
                f"tau(head) / tau({ref})", "", "| head | " + " | ".join(s.replace("spec_bench/", "sb/") for s in sets)
                + " | mean ratio |", "|---" * (len(sets) + 2) + "|"]
        for h in heads:
            cells, ratios = [], []
            for s in sets:
                x, y = by.get((h, temp, s)), by.get((ref, temp, s))
                if not x or not y or "per_prompt" not in x or "per_prompt" not in y:
                    cells.append("-")
                    continue
                d, (lo, hi) = paired_diff_ci(x["per_prompt"]["tokens"], x["per_prompt"]["passes"],
                                             y["per_prompt"]["tokens"], y["per_prompt"]["passes"])
                cells.append(f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]")
                ratios.append(x["tau"] / y["tau"])
            mean = f"{sum(ratios) / len(ratios):.3f}" if ratios else "-"
            out.append(f"| {h} | " + " | ".join(cells) + f" | {mean} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--work", type=Path, required=True, help="study directory (runs, heads, eval, logs)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--stage", choices=["all", "train", "speculators", "eval", "table"], default="all")
    ap.add_argument("--speculators", action="store_true", help="include the speculators reference head")
    ap.add_argument("--spec-default", action="store_true",
                    help="also train (stage speculators) and decode speculators with its default norm layout")
    ap.add_argument("--spec-default-lrs", default="", help="comma list of further learning rates for speculators "
                    "with its default layout (e.g. 2e-3: the reference at spectrain's lr); heads speculators_default_lrX")
    ap.add_argument("--extra", action="append", default=[], help="NAME=HEAD_DIR, another head for the eval")
    ap.add_argument("--spec-venv", default=os.environ.get("SPEC_VENV", "/work/spec_venv"))
    ap.add_argument("--anchor", default=os.environ.get("SPECULATORS_ANCHOR", str(ROOT.parent / "shared" / "anchors"
                                                                                    / "speculators_cpu")))
    ap.add_argument("--sets", default=",".join(SETS), help="prompt sets for the eval")
    ap.add_argument("--n", type=int, default=16, help="prompts per set")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per subprocess")
    ap.add_argument("--tag", default="", help="suffix of the eval directory (eval<steps><tag>), to split decoding "
                    "over several runs; the table merges every eval<steps>* directory")
    ap.add_argument("--refs", default="speculators,speculators_default",
                    help="heads the paired tables compare every other head with (comma list of head names)")
    ap.add_argument("--device", default="", help="eval device (cpu, cuda); training follows accelerate")
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    a.sets = [s for s in a.sets.split(",") if s]
    a.refs = [r for r in a.refs.split(",") if r]
    a.spec_default_lrs = [x for x in a.spec_default_lrs.split(",") if x]
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    a.work = a.work.resolve()
    if a.stage in ("all", "train"):
        train_variants(a)
    if a.stage == "speculators" or (a.stage == "all" and (a.speculators or a.spec_default or a.spec_default_lrs)):
        speculators(a)
    if a.stage in ("all", "eval"):
        evaluate(a)
    if a.stage in ("all", "table", "eval"):
        print(table(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
