"""PREDICTED speedup vs batch size, and the crossover, for a deployment (spectrain/eval/roofline.py).

    python scripts/predict_crossover.py --report runs/eval-batch-sweep/report.json --target llama-3.1-8b --gpu H100
    python scripts/predict_crossover.py --tau 2.1 --k 5 --drafter eagle3 --target path/to/config.json --gpu H200
    python scripts/predict_crossover.py --tau 3.0 --k 5 --tree-size 32 --topk 4 --gpu-bandwidth 2000 --gpu-flops 400

tau comes from ``--tau`` or from every batch-sweep setting of a ``spectrain eval --batch-size ...``
report (measured at its smallest batch size). The target is an HF ``config.json`` (file or model
directory) or the preset ``llama-3.1-8b``; the drafter's cost is an EAGLE-3 head sized for that
target (``--drafter eagle3``, draft vocab ``--draft-vocab``) or nothing (``--drafter ngram``).
Everything printed is a model prediction, not a measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spectrain.eval import roofline

PRESETS = {"llama-3.1-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                num_hidden_layers=32, intermediate_size=14336, vocab_size=128256)}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def target_config(spec: str) -> dict:
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    if not path.is_file():
        raise SystemExit(f"--target {spec!r}: not a preset ({', '.join(PRESETS)}) nor a config.json / model dir")
    return json.loads(path.read_text())


def settings(args) -> list[dict]:
    """(label, tau, k, tree, drafter kind) per setting to predict."""
    if args.report is None:
        tree = {"total_tokens": args.tree_size, "topk": args.topk} if args.tree_size else None
        return [dict(label="given", tau=args.tau, k=args.k, tree=tree, drafter=args.drafter)]
    sweep = json.loads(Path(args.report).read_text()).get("batch_sweep")
    if not sweep:
        raise SystemExit(f"{args.report} has no batch_sweep: run spectrain eval with --batch-size")
    out = {}
    for c in sweep["cells"]:  # the smallest batch size comes first
        kind = "ngram" if c["drafter"].startswith("ngram") else args.drafter
        out.setdefault((c["drafter"], c["config"]), dict(label=f"{c['drafter']} {c['config']}", tau=c["tau"],
                                                        k=c["k"], tree=c["tree"], drafter=kind))
    return list(out.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", help="a spectrain eval report.json with a batch_sweep")
    ap.add_argument("--tau", type=float, default=2.0)
    ap.add_argument("--k", type=int, default=5, help="chain length / tree depth")
    ap.add_argument("--tree-size", type=int, default=0, help="tree nodes verified per pass (0 = chain)")
    ap.add_argument("--topk", type=int, default=4, help="tree: nodes expanded per depth")
    ap.add_argument("--drafter", choices=["eagle3", "ngram"], default="eagle3")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--target", default="llama-3.1-8b", help="preset name, config.json or model dir")
    ap.add_argument("--gpu", default=None, help=", ".join(roofline.GPUS))
    ap.add_argument("--gpu-bandwidth", type=float, default=None, help="GB/s")
    ap.add_argument("--gpu-flops", type=float, default=None, help="dense bf16 TFLOP/s")
    ap.add_argument("--context", type=int, default=1024, help="KV tokens per row (prompt + generated so far)")
    args = ap.parse_args(argv)
    custom = args.gpu is None and args.gpu_bandwidth and args.gpu_flops
    acc = roofline.accelerator(None if custom else (args.gpu or "H100"), args.gpu_bandwidth and args.gpu_bandwidth * 1e9,
                               args.gpu_flops and args.gpu_flops * 1e12)
    cfg = target_config(args.target)
    tc = roofline.target_cost(cfg)
    print(f"PREDICTED (roofline), {args.target} bf16 on {acc.name}: {acc.bandwidth / 1e9:.0f} GB/s, "
          f"{acc.flops / 1e12:.0f} TFLOP/s, context {args.context}\n")
    print("| setting | tau | " + " | ".join(f"B={b}" for b in BATCHES) + " | crossover |")
    print("|---|---|" + "---|" * len(BATCHES) + "---|")
    for s in settings(args):
        draft = roofline.eagle3_cost(cfg, args.draft_vocab) if s["drafter"] == "eagle3" else None
        tree = s["tree"]
        spec = roofline.Speculation(s["tau"], 1 + (tree["total_tokens"] if tree else s["k"]), draft,
                                    s["k"] if draft else 0, tree["topk"] if tree else 1)
        c = roofline.curve(tc, spec, acc, BATCHES, args.context)
        cross = "none in range" if c["crossover"] is None else f"B = {c['crossover']}"
        print(f"| {s['label']} | {s['tau']:.2f} | " + " | ".join(f"{x:.2f}" for x in c["predicted_speedup"])
              + f" | {cross} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
