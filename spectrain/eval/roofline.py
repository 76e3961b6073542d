"""PREDICTED speedup of speculative decoding against batch size: a roofline model.

One forward of a model over B rows x t tokens each, with L tokens of KV cache per row, takes

    time(B, t) = max( (W + B * L * kv) / BW ,  B * t * (2 * N + 4 * n_layers * d_attn * L) / F )

W = weight bytes read per forward (every weight except the input embedding table, of which only B*t
rows are read), N = the same weights' parameter count (2 FLOPs per weight per token), kv = KV-cache
bytes per token (2 * layers * kv_heads * head_dim * dtype bytes), d_attn = heads * head_dim, BW =
memory bandwidth, F = peak dense FLOP/s. A speculative step verifies t = 1 + k tokens per row for a
chain (1 + tree size for a tree) and drafts with ``forwards`` drafter passes of ``tokens`` tokens per
row (k passes of 1 token for EAGLE-3 / draft-model chains, 1 pass for Medusa, none for n-gram). With
tau = tokens emitted per verification pass (measured, or E[tau] = 1 + sum_i prod_{j<=i} alpha_j):

    speedup(B) = tau * time_target(B, 1) / (time_target(B, t) + forwards * time_draft(B, tokens))

At B = 1 both target passes are memory-bound and equal, so speedup = tau / (1 + k * c) with
c = time_draft / time_target (docs/evaluation.md, Metric conventions); as B grows the verification pass turns
compute-bound, costs ~t times a plain pass, and the speedup falls towards tau / t < 1. The
crossover is the largest batch size whose speedup is still > 1. Everything here is a model:
no kernel launch, scheduling or Python overhead, peak bandwidth and FLOPs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from spectrain.drafters.costs import ModelCost, config_dims, layer_params  # shared with the families' hooks


@dataclass(frozen=True)
class Accelerator:
    name: str
    bandwidth: float  # bytes / s
    flops: float  # dense FLOP / s at the deployment dtype


# Datasheet peaks: memory bandwidth and dense (no sparsity) BF16 tensor-core FLOP/s, SXM parts.
GPUS = {
    "A100": Accelerator("A100-SXM4-80GB", 2.039e12, 312e12),
    "H100": Accelerator("H100-SXM5-80GB", 3.35e12, 989e12),
    "H200": Accelerator("H200-SXM-141GB", 4.8e12, 989e12),
}


def accelerator(name: str | None = None, bandwidth: float | None = None, flops: float | None = None) -> Accelerator:
    """A named GPU from ``GPUS``, with optional overrides; or a custom one from both numbers."""
    if any(v is not None and not (math.isfinite(v) and v > 0) for v in (bandwidth, flops)):
        raise ValueError(f"an accelerator's peaks must be finite and > 0, got bandwidth {bandwidth} B/s, "
                         f"flops {flops} FLOP/s")
    if name is None:
        if bandwidth is None or flops is None:
            raise ValueError("give --gpu NAME (one of " + ", ".join(GPUS) + ") or both --gpu-bandwidth (GB/s) "
                             "and --gpu-flops (TFLOP/s)")
        return Accelerator("custom", bandwidth, flops)
    key = name.upper()
    if key not in GPUS:
        raise ValueError(f"unknown --gpu {name!r}: known {', '.join(GPUS)}; for another accelerator pass "
                         "--gpu-bandwidth (GB/s) and --gpu-flops (dense TFLOP/s)")
    g = GPUS[key]
    return Accelerator(g.name if bandwidth is None and flops is None else f"{g.name} (overridden)",
                       g.bandwidth if bandwidth is None else bandwidth, g.flops if flops is None else flops)


def check_peaks(bandwidth_gbps: float | None, tflops: float | None) -> None:
    """--gpu-bandwidth / --gpu-flops, when given, are finite and > 0: a 0 must not quietly mean "the --gpu's own"
    (leaving the option out says that), and a negative or NaN peak makes every prediction meaningless."""
    for opt, v, unit in (("--gpu-bandwidth", bandwidth_gbps, "GB/s"), ("--gpu-flops", tflops, "dense TFLOP/s")):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{opt} must be > 0 and finite, got {v}: give the accelerator's peak in {unit}, or leave "
                             "the option out to use the --gpu's datasheet value")


def deployment(gpu: str | None, bandwidth_gbps: float | None = None, tflops: float | None = None) -> Accelerator:
    """The accelerator of the CLI's --gpu / --gpu-bandwidth (GB/s) / --gpu-flops (TFLOP/s): a named GPU (default
    H100) with the peaks given overriding its own, or a custom one when both peaks are given without --gpu."""
    check_peaks(bandwidth_gbps, tflops)
    custom = gpu is None and bandwidth_gbps is not None and tflops is not None
    return accelerator(None if custom else (gpu or "H100"), None if bandwidth_gbps is None else bandwidth_gbps * 1e9,
                       None if tflops is None else tflops * 1e12)


def target_cost(cfg, dtype_bytes: int = 2) -> ModelCost:
    """Llama-style decoder (Llama, Qwen, Mistral ...) from its HF config (object or dict)."""
    d = config_dims(cfg)
    params = d["n"] * layer_params(d["h"], d["nh"], d["nkv"], d["hd"], d["inter"]) + d["vocab"] * d["h"]  # + lm_head
    return ModelCost(weight_bytes=params * dtype_bytes, params=params,
                     kv_bytes_per_token=2 * d["n"] * d["nkv"] * d["hd"] * dtype_bytes,
                     layers=d["n"], attn_dim=d["nh"] * d["hd"])


def module_cost(module: torch.nn.Module, dtype_bytes: int, like: ModelCost | None = None) -> ModelCost:
    """A drafter measured by its parameter count (its KV traffic taken as one layer of `like`)."""
    params = sum(p.numel() for p in module.parameters())
    kv = like.kv_bytes_per_token / max(like.layers, 1) if like else 0.0
    return ModelCost(weight_bytes=params * dtype_bytes, params=params, kv_bytes_per_token=kv, layers=1,
                     attn_dim=like.attn_dim if like else 0)


@dataclass(frozen=True)
class Speculation:
    tau: float  # tokens emitted per verification pass, bonus included
    verify_tokens: int  # per row: 1 + k (chain) or 1 + tree size
    draft: ModelCost | None = None  # None = free drafter (n-gram)
    draft_forwards: int = 0  # drafter passes per step
    draft_tokens: int = 1  # tokens per row per drafter pass (trees: the expanded nodes)


def expected_tau(alpha: list[float | None]) -> float:
    """Chain E[tau] = 1 + sum_i prod_{j<=i} alpha_j (a never-verified position counts as 0)."""
    tau, run = 1.0, 1.0
    for a in alpha:
        run *= a or 0.0
        tau += run
    return tau


def predicted_speedup(target: ModelCost, spec: Speculation, acc: Accelerator, batch: int, context: int) -> float:
    plain = target.time(acc, batch, 1, context)
    step = target.time(acc, batch, spec.verify_tokens, context)
    if spec.draft is not None and spec.draft_forwards:
        step += spec.draft_forwards * spec.draft.time(acc, batch, spec.draft_tokens, context)
    return spec.tau * plain / step


def crossover(batch_sizes: list[int], speedups: list[float | None]) -> int | None:
    """The largest batch size whose speedup is still > 1 (None: speculation never pays in range)."""
    wins = [b for b, s in zip(batch_sizes, speedups) if s is not None and s > 1.0]
    return max(wins) if wins else None


def curve(target: ModelCost, spec: Speculation, acc: Accelerator, batch_sizes: list[int],
          context: int) -> dict:
    ups = [predicted_speedup(target, spec, acc, b, context) for b in batch_sizes]
    return {"accelerator": acc.name, "bandwidth_GBps": acc.bandwidth / 1e9, "peak_TFLOPs": acc.flops / 1e12,
            "context": context, "tau": spec.tau, "verify_tokens": spec.verify_tokens,
            "batch_sizes": list(batch_sizes), "predicted_speedup": ups, "crossover": crossover(batch_sizes, ups)}


def measure_cpu_peaks(mb: int = 256, n: int = 1024, repeats: int = 3) -> Accelerator:
    """This machine's memory bandwidth (tensor copy: read + write) and fp32 matmul FLOP/s, best of
    `repeats`, at torch's current thread count: the CPU 'accelerator' for checking the model."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    a, b = torch.randn(n, n), torch.randn(n, n)
    bw = fl = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        bw = max(bw, 2 * src.numel() * 4 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        torch.mm(a, b)
        fl = max(fl, 2 * n**3 / (time.perf_counter() - t0))
    return Accelerator(f"this CPU ({torch.get_num_threads()} threads, measured)", bw, fl)
