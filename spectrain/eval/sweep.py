"""`spectrain eval --batch-size 1 --batch-size 4 ...`: throughput against batch size, and the crossover.

For every decode setting (drafter x k/tree x temperature) and every batch size B, the same rows are
decoded with ``speculative_generate(..., batch_size=B)`` and, right before, with the plain target in
the same batched loop (``plain_generate(..., batch_size=B)``), so each speedup is against the best
plain decoding at that batch size. Rows = the run's prompts (all sets, in order), cycled or cut to
the largest batch size, so every B does the same work. Measured per cell: tokens/s over the batch,
mean per-row latency, tau. The crossover is the largest B whose speculative throughput still beats
plain. Beside it, spectrain/eval/roofline.py PREDICTS the speedup (a) on this CPU from its peaks measured
in the same run, to check the model, and (b) for a deployment (``--gpu``) of this target in bf16.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm.auto import tqdm

from spectrain import registry
from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.decoding.stats import DecodeStats
from spectrain.eval import roofline


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", action="append", type=int, default=None,
                   help="decode B rows per target pass; repeatable: measures plain and speculative throughput "
                        "at each B and the crossover batch size (e.g. --batch-size 1 --batch-size 8)")
    p.add_argument("--gpu", default=None,
                   help=f"deployment for the PREDICTED speedup vs batch size: {', '.join(roofline.GPUS)} "
                        "(default H100 when --batch-size is given)")
    p.add_argument("--gpu-bandwidth", type=float, default=None, help="memory bandwidth in GB/s (overrides --gpu)")
    p.add_argument("--gpu-flops", type=float, default=None, help="dense bf16 TFLOP/s (overrides --gpu)")
    p.add_argument("--sweep-repeats", type=int, default=1,
                   help="measure every batch-size cell N times, interleaved, and keep the median (noisy machines)")


def validate_sweep_args(args) -> None:
    bs = args.batch_size
    if getattr(args, "sweep_repeats", 1) < 1:
        raise ValueError(f"--sweep-repeats must be >= 1, got {args.sweep_repeats}")
    if bs is not None and any(b < 1 for b in bs):
        raise ValueError(f"--batch-size must be >= 1, got {bs}")
    roofline.check_peaks(args.gpu_bandwidth, args.gpu_flops)
    if bs:
        args.batch_size = sorted(set(bs))
        args.deployment = roofline.deployment(args.gpu, args.gpu_bandwidth, args.gpu_flops)


def batch_sweep(target, drafters: dict, plan: dict, encoded: dict, args) -> dict:
    """The measured sweep with the roofline prediction beside it (what `spectrain eval` reports)."""
    n = len(args.batch_size) * sum(len(c) for c in plan.values()) * args.sweep_repeats
    with tqdm(total=n, desc="batch-size sweep", unit="cell") as bar:
        result = run_sweep(target, drafters, plan, encoded, args, bar)
    local = roofline.measure_cpu_peaks() if target.device.type == "cpu" else args.deployment
    predict(result, target, drafters, args.deployment, local)
    return result


def _rows(encoded: dict[str, list[list[int]]], n: int) -> list[list[int]]:
    pool = [ids for rows in encoded.values() for ids in rows]
    return [pool[i % len(pool)] for i in range(n)]


def timed(fn, **kw):
    """(fn(**kw), seconds), with CUDA work finished on both ends."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = fn(**kw)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return outs, time.perf_counter() - t0


def _cell(outs, seconds: float) -> dict:
    s = DecodeStats.merge([o.stats for o in outs])
    tokens = sum(len(o.tokens) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "latency_s": sum(o.stats.wall_time_s for o in outs) / len(outs), "tau": s.tau if s.target_passes else None,
            "alpha": [a if a == a else None for a in s.alpha], "outputs": [list(o.tokens) for o in outs]}


def run_sweep(target, drafters: dict, plan: dict, encoded: dict, args, bar=None) -> dict:
    """Measure every (setting, B) cell; plain at each (temperature, B) right before its drafters."""
    sizes = args.batch_size
    rows = _rows(encoded, max(sizes))
    common = dict(target=target, input_ids=rows, max_new_tokens=args.max_new_tokens, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed)
    runs: dict = {}  # (temperature, B, drafter or None, config label) -> cells of the repeats
    for _ in range(args.sweep_repeats):  # interleaved, so load drift on a shared machine hits every cell alike
        for temp in args.temperature:
            for B in sizes:
                runs.setdefault((temp, B, None, None), []).append(
                    _cell(*timed(plain_generate, temperature=temp, batch_size=B, **common)))
                for d, cfgs in plan.items():
                    for cfg in (c for c in cfgs if c.temperature == temp):
                        runs.setdefault((temp, B, d, cfg.label), []).append(_cell(*timed(
                            speculative_generate, drafter=drafters[d], k=cfg.k, tree=cfg.tree, temperature=temp,
                            batch_size=B, **common)))
                        if bar is not None:
                            bar.update(1)
    cells = [_record(d, cfg, B, _median(runs[(temp, B, d, cfg.label)]), _median(runs[(temp, B, None, None)]))
             for temp in args.temperature for B in sizes for d, cfgs in plan.items() for cfg in cfgs
             if cfg.temperature == temp]
    return {"batch_sizes": sizes, "rows": len(rows), "distinct_prompts": len({tuple(r) for r in rows}),
            "repeats": args.sweep_repeats,
            "max_new_tokens": args.max_new_tokens, "cells": cells,
            "context": sum(map(len, rows)) / len(rows) + args.max_new_tokens / 2}


def _median(cells: list[dict]) -> dict:
    return sorted(cells, key=lambda c: c["tokens_per_s"] or 0.0)[len(cells) // 2]


def _record(drafter: str, cfg, B: int, spec: dict, plain: dict) -> dict:
    rec = {"drafter": drafter, "config": cfg.label, "k": cfg.k, "tree": cfg.tree, "temperature": cfg.temperature,
           "batch_size": B, "tokens": spec["tokens"], "tokens_per_s": spec["tokens_per_s"],
           "latency_s": spec["latency_s"], "plain_tokens_per_s": plain["tokens_per_s"],
           "plain_latency_s": plain["latency_s"], "tau": spec["tau"], "alpha": spec["alpha"],
           "speedup": (spec["tokens_per_s"] / plain["tokens_per_s"]
                       if spec["tokens_per_s"] and plain["tokens_per_s"] else None)}
    if cfg.temperature == 0:
        same = sum(a == b for a, b in zip(spec["outputs"], plain["outputs"]))
        rec["greedy_identical_to_plain"] = f"{same}/{len(spec['outputs'])}"
    return rec


# ---- prediction ----------------------------------------------------------------------------------------


def _drafter_cost(drafter, target, dtype_bytes: int, deploy: bool) -> roofline.ModelCost | None:
    model = getattr(drafter, "model", None)
    if not isinstance(model, torch.nn.Module):
        return None  # n-gram: drafting is a lookup
    like = roofline.target_cost(target.config, dtype_bytes)
    deploy_cost = registry.hook(getattr(model, "kind", None), "decode.deploy_cost")
    if deploy and deploy_cost is not None:  # the head spectrain would build for this target (the family's hook)
        return deploy_cost(target.config, model.config, dtype_bytes)
    return roofline.module_cost(model, dtype_bytes, like)


def _speculation(cell: dict, drafter, cost) -> roofline.Speculation:
    k, tree = cell["k"], cell["tree"]
    verify = 1 + (tree["total_tokens"] if tree else k)
    if cost is None:
        return roofline.Speculation(cell["tau"], verify)
    one_pass = registry.supports(getattr(getattr(drafter, "model", None), "kind", None), "one_pass")
    return roofline.Speculation(cell["tau"], verify, cost, 1 if one_pass else k, tree["topk"] if tree else 1)


def predict(sweep: dict, target, drafters: dict, deployment: roofline.Accelerator, cpu: roofline.Accelerator) -> None:
    """Adds predicted speedups (this CPU, the deployment) and the crossovers to `sweep`, in place."""
    sizes, ctx = sweep["batch_sizes"], int(sweep["context"])
    cpu_bytes = torch.finfo(target.dtype).bits // 8
    tc_cpu, tc_dep = roofline.target_cost(target.config, cpu_bytes), roofline.target_cost(target.config, 2)
    first = {}
    for c in sweep["cells"]:  # tau is a property of the drafter, not of B: take it at the smallest B
        first.setdefault((c["drafter"], c["config"]), c)
    for c in sweep["cells"]:
        base, d = first[(c["drafter"], c["config"])], drafters[c["drafter"]]
        if base["tau"] is None:
            continue
        spec_cpu = _speculation(base, d, _drafter_cost(d, target, cpu_bytes, False))
        spec_dep = _speculation(base, d, _drafter_cost(d, target, 2, True))
        c["predicted_cpu"] = roofline.predicted_speedup(tc_cpu, spec_cpu, cpu, c["batch_size"], ctx)
        c["predicted_deployment"] = roofline.predicted_speedup(tc_dep, spec_dep, deployment, c["batch_size"], ctx)
    wide = sorted(set(sizes) | {1, 2, 4, 8, 16, 32, 64, 128, 256, 512})
    sweep["crossover"] = []
    for (drafter, config), base in first.items():
        cs = [c for c in sweep["cells"] if (c["drafter"], c["config"]) == (drafter, config)]
        row = {"drafter": drafter, "config": config,
               "measured": roofline.crossover([c["batch_size"] for c in cs], [c["speedup"] for c in cs]),
               "predicted_cpu": roofline.crossover([c["batch_size"] for c in cs], [c.get("predicted_cpu") for c in cs])}
        if base["tau"] is not None:
            d = drafters[drafter]
            row["deployment_curve"] = roofline.curve(tc_dep, _speculation(base, d, _drafter_cost(d, target, 2, True)),
                                                     deployment, wide, ctx)
            row["predicted_deployment"] = row["deployment_curve"]["crossover"]
        sweep["crossover"].append(row)
    sweep["cpu_peaks"] = {"name": cpu.name, "bandwidth_GBps": cpu.bandwidth / 1e9, "TFLOPs": cpu.flops / 1e12}
    sweep["deployment"] = {"name": deployment.name, "bandwidth_GBps": deployment.bandwidth / 1e9,
                           "TFLOPs": deployment.flops / 1e12, "dtype": "bf16", "target_params": tc_dep.params,
                           "kv_bytes_per_token": tc_dep.kv_bytes_per_token}
