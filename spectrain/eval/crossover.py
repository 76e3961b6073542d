"""`spectrain crossover`: PREDICTED speedup against batch size, and the crossover, for a deployment (roofline.py).

    spectrain crossover --report runs/eval-batch-sweep/report.json --target llama-3.1-8b --gpu H100
    spectrain crossover --tau 2.1 --k 5 --drafter eagle3 --target path/to/config.json --gpu H200
    spectrain crossover --tau 3.0 --k 5 --tree-size 32 --topk 4 --gpu-bandwidth 2000 --gpu-flops 400

tau comes from ``--tau`` or from every batch-sweep setting of a ``spectrain eval --batch-size ...``
report (measured at its smallest batch size). The target is an HF ``config.json`` (file or model
directory) or the preset ``llama-3.1-8b``; the drafter's cost is an EAGLE-3 head sized for that
target (``--drafter eagle3``, draft vocab ``--draft-vocab``: any family whose record declares a
``decode.deploy_cost``) or nothing (``--drafter ngram``, and every training-free drafter of a report).
Everything printed is a model prediction, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from spectrain import registry
from spectrain.eval import roofline

PRESETS = {"llama-3.1-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                num_hidden_layers=32, intermediate_size=14336, vocab_size=128256)}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def deploy_costs() -> dict[str, registry.Ref]:
    """kind -> its ``decode.deploy_cost`` hook: the deployed drafter's cost per forward for a target config, of the
    families that declare one; training-free drafters (registry.TRAINING_FREE) cost nothing."""
    return {k: f.decode.deploy_cost for k, f in registry.FAMILIES.items() if f.decode.deploy_cost}


def add_crossover_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--report", help="a spectrain eval report.json with a batch_sweep (its tau per setting)")
    p.add_argument("--tau", type=float, default=2.0, help="tokens per verification pass (without --report)")
    p.add_argument("--k", type=int, default=5, help="chain length / tree depth")
    p.add_argument("--tree-size", type=int, default=0, help="tree nodes verified per pass (0 = chain)")
    p.add_argument("--topk", type=int, default=4, help="tree: nodes expanded per depth")
    p.add_argument("--drafter", choices=[*deploy_costs(), *registry.TRAINING_FREE], default="eagle3",
                   help="whose drafting cost to charge (a report's training-free drafters cost nothing)")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--target", default="llama-3.1-8b", help=f"preset ({', '.join(PRESETS)}), config.json or model dir")
    p.add_argument("--gpu", default=None, help=", ".join(roofline.GPUS) + " (default H100)")
    p.add_argument("--gpu-bandwidth", type=float, default=None, help="GB/s")
    p.add_argument("--gpu-flops", type=float, default=None, help="dense bf16 TFLOP/s")
    p.add_argument("--context", type=int, default=1024, help="KV tokens per row (prompt + generated so far)")
    return p


def target_config(spec: str) -> dict:
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--target {spec!r}: not a preset ({', '.join(PRESETS)}) nor a config.json / "
                                "model directory")
    return json.loads(path.read_text())


def check_tau(tau, k, where: str, fix: str) -> None:
    """tau counts the bonus token and a pass emits at most k drafted tokens + 1: 1 <= tau <= k + 1 (k = the depth
    for a tree); anything else (NaN, inf, 0.5, 9 at k = 5) is a typo or a damaged report, not a prediction."""
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ValueError(f"{where}: k {k!r} must be an integer >= 1 (the chain length / tree depth); {fix}")
    number = isinstance(tau, (int, float)) and not isinstance(tau, bool)
    if not (number and math.isfinite(tau) and 1 <= tau <= k + 1):
        raise ValueError(f"{where}: tau {tau!r} is impossible for k = {k} (tau counts the bonus token: "
                         f"1 <= tau <= k + 1 = {k + 1}); {fix}")


def check_args(args: argparse.Namespace) -> None:
    """Sizes and peaks, before anything is computed: a zero or negative size has no meaning in the model."""
    for opt, v, least in (("--draft-vocab", args.draft_vocab, 1), ("--context", args.context, 1),
                          ("--topk", args.topk, 1), ("--tree-size", args.tree_size, 0)):
        if v < least:
            raise ValueError(f"{opt} {v}: must be >= {least}" + (" (0 = a chain)" if opt == "--tree-size" else ""))
    roofline.check_peaks(args.gpu_bandwidth, args.gpu_flops)
    if args.report is None:
        check_tau(args.tau, args.k, f"--tau {args.tau} --k {args.k}", "give the measured tokens per verification "
                  "pass, bonus included")
        if 0 < args.tree_size < args.k:
            raise ValueError(f"--tree-size {args.tree_size} --k {args.k}: a tree of depth k has at least k nodes; "
                             "give --tree-size >= --k, or 0 for a chain")


def settings(args: argparse.Namespace) -> list[dict]:
    """(label, tau, k, tree, drafter kind) per setting to predict."""
    if args.report is None:
        tree = {"total_tokens": args.tree_size, "topk": args.topk} if args.tree_size else None
        return [dict(label="given", tau=args.tau, k=args.k, tree=tree, drafter=args.drafter)]
    path = Path(args.report)
    if not path.is_file():
        raise FileNotFoundError(f"--report {path}: no such file (a spectrain eval report.json)")
    try:
        sweep = json.loads(path.read_text()).get("batch_sweep")
    except (ValueError, AttributeError):
        raise ValueError(f"--report {path}: not a spectrain eval report.json (not a JSON object)") from None
    if not sweep:
        raise ValueError(f"--report {path} has no batch_sweep: run spectrain eval with --batch-size")
    out = {}
    for i, c in enumerate(sweep["cells"]):  # the smallest batch size comes first
        check_tau(c.get("tau"), c.get("k"), f"--report {path}: batch_sweep.cells[{i}] ({c.get('drafter')} "
                  f"{c.get('config')})", "the report is damaged or was edited: re-run spectrain eval --batch-size")
        kind = next((k for k in registry.TRAINING_FREE if c["drafter"].startswith(k)), args.drafter)
        out.setdefault((c["drafter"], c["config"]), dict(label=f"{c['drafter']} {c['config']}", tau=c["tau"],
                                                        k=c["k"], tree=c["tree"], drafter=kind))
    return list(out.values())


def main(args: argparse.Namespace) -> int:
    check_args(args)
    acc = roofline.deployment(args.gpu, args.gpu_bandwidth, args.gpu_flops)
    cfg = target_config(args.target)
    tc = roofline.target_cost(cfg)
    rows = settings(args)
    print(f"PREDICTED (roofline), {args.target} bf16 on {acc.name}: {acc.bandwidth / 1e9:.0f} GB/s, "
          f"{acc.flops / 1e12:.0f} TFLOP/s, context {args.context}\n")
    print("| setting | tau | " + " | ".join(f"B={b}" for b in BATCHES) + " | crossover |")
    print("|---|---|" + "---|" * len(BATCHES) + "---|")
    costs = deploy_costs()
    for s in rows:
        cost = costs.get(s["drafter"])  # the head as --draft-vocab sizes it, in bf16 (the target's dtype here)
        draft = registry.resolve(cost)(cfg, {"draft_vocab_size": args.draft_vocab}, 2) if cost else None
        tree = s["tree"]
        spec = roofline.Speculation(s["tau"], 1 + (tree["total_tokens"] if tree else s["k"]), draft,
                                    s["k"] if draft else 0, tree["topk"] if tree else 1)
        c = roofline.curve(tc, spec, acc, BATCHES, args.context)
        cross = "none in range" if c["crossover"] is None else f"B = {c['crossover']}"
        print(f"| {s['label']} | {s['tau']:.2f} | " + " | ".join(f"{x:.2f}" for x in c["predicted_speedup"])
              + f" | {cross} |")
    return 0
