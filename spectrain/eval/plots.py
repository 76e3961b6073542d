"""The report's PNG plots: acceptance per position, tau per drafter, throughput against batch size."""

from __future__ import annotations

import re
from pathlib import Path

from spectrain.eval.stats import fmt_ci

SPLIT_STYLE = {"held-out": ("-", "o"), "in-domain": ("-.", "s"), "OOD": ("--", "^")}



def plot_slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text).strip("_")[:80]


def plot_labels(specs) -> dict[str, str]:
    """A short label per drafter spec that is unique among them: its last two path parts ("runA/best", not
    "best"), more where two still collide, the whole spec at most ("ngram" stays "ngram")."""
    specs = list(dict.fromkeys(specs))

    def tail(spec: str, n: int) -> str:
        parts = Path(spec).parts
        return "/".join(parts[-n:]) if parts else spec

    out = {}
    for spec in specs:
        n = 2
        while n < len(Path(spec).parts) and sum(tail(o, n) == tail(spec, n) for o in specs) > 1:
            n += 1
        out[spec] = tail(spec, n) if sum(tail(o, n) == tail(spec, n) for o in specs) == 1 else spec
    return out


def _groups(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        out.setdefault((r["drafter"], r["config"]), []).append(r)
    return out


def _yerr(ys: list[float], cis) -> list[list[float]] | None:
    """matplotlib yerr [[below...], [above...]] from [lo, hi] intervals (0 where there is none)."""
    if not cis or all(c is None or c[0] is None for c in cis):
        return None
    ok = [c is not None and c[0] is not None and y == y for y, c in zip(ys, cis)]
    return [[max(0.0, y - c[0]) if o else 0.0 for y, c, o in zip(ys, cis, ok)],
            [max(0.0, c[1] - y) if o else 0.0 for y, c, o in zip(ys, cis, ok)]]


def plot_acceptance(out_dir: Path, records: list[dict], target: str) -> list[Path]:
    """alpha_i vs draft position, one line per prompt set; held-out solid, OOD dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths, labels = [], plot_labels(r["drafter"] for r in records)
    for (drafter, config), recs in _groups(records).items():
        fig, ax = plt.subplots(figsize=(9.5, 4.2), dpi=120)
        colors = plt.get_cmap("tab10")
        kmax = max(len(r["alpha"]) for r in recs) or 1
        for i, r in enumerate(recs):
            ls, marker = SPLIT_STYLE.get(r["split"], ("--", "^"))
            ys = [float("nan") if a is None else a for a in r["alpha"]]
            err = _yerr(ys, r.get("alpha_ci"))
            if err is not None:  # the 95% interval of each alpha_i
                ax.errorbar(range(1, len(ys) + 1), ys, yerr=err, ls="none", color=colors(i % 10), capsize=2, lw=0.8)
            ax.plot(range(1, len(ys) + 1), ys, ls=ls, marker=marker, color=colors(i % 10), lw=2 if
                    r["split"] == "held-out" else 1.5, label=f"{r['prompt_set']} [{r['split']}] tau={fmt_ci(r['tau'], r.get('tau_ci'))}, "
                    f"n_i={'/'.join(map(str, r['attempts']))}")
        ax.set(xlabel="draft position i", ylabel="alpha_i (conditional acceptance)", ylim=(-0.02, 1.05),
               xticks=range(1, kmax + 1), title=f"{labels[drafter]} · {config}\ntarget {target}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), title="solid: held-out, dashed: OOD; n_i = times position i was verified;\n"
                  "error bars: 95% Wilson intervals of alpha_i (pooled counts)",
                  title_fontsize=7)
        fig.tight_layout()
        p = out_dir / f"acceptance_{plot_slug(drafter)}_{plot_slug(config)}.png"
        fig.savefig(p, bbox_inches="tight")
        plt.close(fig)
        paths.append(p)
    return paths


def plot_tau(out_dir: Path, records: list[dict], target: str) -> Path:
    """tau per prompt set, one bar per (drafter, config); OOD bars hatched; tau = 1 marks plain decoding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    groups = _groups(records)
    sets = list(dict.fromkeys(r["prompt_set"] for r in records))
    width = 0.8 / max(len(groups), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(sets) * max(1, len(groups) / 2) + 2), 4.2), dpi=120)
    colors = plt.get_cmap("tab10")
    for g, recs in enumerate(groups.values()):
        by_set = {r["prompt_set"]: r for r in recs}
        for x, name in enumerate(sets):
            r = by_set.get(name)
            if r is None or r["tau"] is None:
                continue
            xpos = x - 0.4 + width * (g + 0.5)
            ax.bar(xpos, r["tau"], width, color=colors(g % 10), edgecolor="black", lw=0.5,
                   hatch="//" if r["split"] == "OOD" else (".." if r["split"] == "in-domain" else None),
                   yerr=_yerr([r["tau"]], [r.get("tau_ci")]), capsize=2, error_kw={"lw": 0.8})
            ax.text(xpos, r["tau"], f"{r['tau']:.2f}", ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.set_xticks(range(len(sets)), sets, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="tau (tokens per target pass, incl. bonus)", title=f"tau per prompt set · target {target}")
    labels = plot_labels(d for d, _ in groups)
    handles = [Patch(color=colors(g % 10), label=f"{labels[d]} · {c}") for g, (d, c) in enumerate(groups)]
    handles += [Patch(facecolor="white", edgecolor="black", label="held-out (solid fill)"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="OOD (hatched)"),
                Line2D([], [], color="gray", ls=":", label="plain decoding (tau = 1)")]
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = out_dir / "tau.png"
    fig.savefig(p, bbox_inches="tight")
    plt.close(fig)
    return p


def plot_batch_sweep(out_dir: Path, sw: dict, target: str) -> Path:
    """Throughput and speedup vs batch size; one colour per drafter setting, chains solid, trees dashed;
    predictions dotted (this machine) and dash-dotted (deployment, right panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4), dpi=120)
    colors = plt.get_cmap("tab10")
    keys = list(dict.fromkeys((c["drafter"], c["config"]) for c in sw["cells"]))
    labels = plot_labels(k[0] for k in keys)
    plain_done = set()
    for i, key in enumerate(keys):
        cs = [c for c in sw["cells"] if (c["drafter"], c["config"]) == key]
        bs, ls = [c["batch_size"] for c in cs], "--" if cs[0]["tree"] else "-"
        name = f"{labels[key[0]]} · {key[1]}"
        axes[0].plot(bs, [c["tokens_per_s"] for c in cs], ls=ls, marker="o", color=colors(i % 10), label=name)
        if cs[0]["temperature"] not in plain_done:
            plain_done.add(cs[0]["temperature"])
            axes[0].plot(bs, [c["plain_tokens_per_s"] for c in cs], color="black", marker="s", lw=2,
                         ls=":" if cs[0]["temperature"] else "-", label=f"plain T={cs[0]['temperature']:g}")
        axes[1].plot(bs, [c["speedup"] for c in cs], ls=ls, marker="o", color=colors(i % 10), label=f"{name} measured")
        axes[1].plot(bs, [c.get("predicted_cpu") for c in cs], ls=":", color=colors(i % 10), label="predicted (this machine)")
        curve = next((x.get("deployment_curve") for x in sw.get("crossover", []) if (x["drafter"], x["config"]) == key),
                     None)
        if curve:
            axes[2].plot(curve["batch_sizes"], curve["predicted_speedup"], ls="-." if cs[0]["tree"] else "-",
                         color=colors(i % 10), marker=".", label=name)
    titles = ("throughput (tokens/s over the batch)", "speedup vs plain: measured (markers), predicted (dotted)",
              f"PREDICTED speedup: {sw.get('deployment', {}).get('name', '-')}, bf16")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="batch size B", title=title)
        ax.grid(alpha=0.3)
    for ax in axes[1:]:
        ax.axhline(1.0, color="gray", lw=1)
    axes[0].legend(fontsize=6)
    axes[2].legend(fontsize=6, title="chain solid, tree dash-dot", title_fontsize=6)
    fig.suptitle(f"batched speculative decoding · target {target}", fontsize=9)
    fig.tight_layout()
    p = out_dir / "batch_sweep.png"
    fig.savefig(p, bbox_inches="tight")
    plt.close(fig)
    return p
