"""A step's metrics pooled over micro-batches and ranks (token-weighted, one all-reduce), with sim_tau
recomputed from the pooled per-position acceptance; the rank collectives the loop branches on."""

from __future__ import annotations

import torch

from spectrain.drafters.losses import sim_tau


def aggregate(parts: list[tuple[dict, float]]) -> dict:
    """Token-weighted mean of per-batch metrics; sim_tau recomputed from the pooled per-step acc."""
    total = sum(w for _, w in parts)
    keys = sorted({k for m, _ in parts for k in m} - {"tokens"})
    out = {k: sum(m.get(k, 0.0) * w for m, w in parts) / max(total, 1e-9) for k in keys}
    _add_sim_tau(out)
    out["loss_tokens"] = total
    return out


def _all_ranks(acc, flag: bool) -> bool:
    """True if `flag` holds on any rank (so every rank takes the same branch around collectives)."""
    x = torch.tensor([1.0 if flag else 0.0], device=acc.device)
    if acc.num_processes > 1:
        x = acc.reduce(x, "sum")
    return float(x) > 0


def _sum_ranks(acc, x: float) -> float:
    return float(acc.reduce(torch.tensor([float(x)], device=acc.device), "sum")) if acc.num_processes > 1 else float(x)


def _pool(acc, losses: list[float], parts: list[tuple[dict, float]]) -> dict:
    """Step metrics pooled over micro-batches and ranks: loss = mean micro loss (what is optimised),
    the rest token-weighted. Every rank has the same metric keys, so one all-reduce suffices."""
    keys = sorted(k for k in parts[0][0] if k != "tokens")
    vec = [sum(losses), float(len(losses)), sum(w for _, w in parts)]
    vec += [sum(float(m[k]) * w for m, w in parts) for k in keys]
    x = torch.tensor(vec, dtype=torch.float64, device=acc.device)
    if acc.num_processes > 1:
        x = acc.reduce(x, "sum")
    x = x.tolist()
    out = {k: v / max(x[2], 1e-9) for k, v in zip(keys, x[3:])}
    _add_sim_tau(out)
    out["loss"], out["loss_tokens"] = x[0] / x[1], x[2]
    return out


def _add_sim_tau(out: dict) -> None:
    """sim_tau from the pooled acc_0, acc_1, ... (never an average of per-batch sim_tau values)."""
    accs = [out[f"acc_{i}"] for i in range(len(out)) if f"acc_{i}" in out]
    if accs:
        out["sim_tau"] = sim_tau(accs)
