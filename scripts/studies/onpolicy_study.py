"""Short training runs of the on-policy / acceptance-loss options against each family's default, tabulated from
metrics.jsonl (training-time PROXIES: held-out teacher-forced sim_tau at T=0 and T=1, no decoding).

    python -m scripts.studies.onpolicy_study --family eagle3 --steps 100 --work /tmp/ops      # fkl, accept, lk, rollout
    python -m scripts.studies.onpolicy_study --family medusa --steps 100 --work /tmp/ops      # fkl, accept, lk
    python -m scripts.studies.onpolicy_study --family draft --steps 100 --work /tmp/ops       # fixed, on-policy 0.5 / 1.0
    python -m scripts.studies.onpolicy_study --family draft --recipe recipes/smollm2-135m/draft.yaml ...  # another target

Every variant runs in this process, one after another; one whose run finished is not retrained. Every run
uses ``--threads`` torch threads (default 1: the machine is shared), evaluates on the held-out split at its
end and reports CPU seconds per optimizer step (process time: independent of other load on the machine).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# EAGLE-3 runs unpacked: the rollout option does not support packing yet, and the baseline must match it
VARIANTS: dict[str, dict[str, list[str]]] = {
    "eagle3": {"packed": [],  # the recipe as it is (packing is the EAGLE-3 recipes' default)
               "fkl": ["training.packing=false"],
               "accept": ["training.packing=false", "drafter.loss=accept"],
               "lk": ["training.packing=false", "drafter.loss=lk"],
               "lk_packed": ["drafter.loss=lk"],  # the recipe as it is but for the loss
               "rollout0.5": ["training.packing=false", "drafter.eagle3.rollout.fraction=0.5"],
               "rollout1.0": ["training.packing=false", "drafter.eagle3.rollout.fraction=1.0"]},
    "medusa": {"fkl": [], "accept": ["drafter.loss=accept"], "lk": ["drafter.loss=lk"]},
    "draft": {"fixed": [], "on_policy0.5": ["training.on_policy.fraction=0.5"],
              "on_policy1.0": ["training.on_policy.fraction=1.0"],
              "on_policy0.5_tvd": ["training.on_policy.fraction=0.5", "drafter.loss=tvd"],
              # fixed data, other divergences (tvd: its value is 1 - acceptance at T=1)
              "tvd": ["drafter.loss=tvd"], "rkl": ["drafter.loss=rkl"], "jsd": ["drafter.loss=jsd"]},
}
EVAL_KEYS = ["eval/sim_tau_proxy", "eval/sim_tau_t1", "eval/acc_0", "eval/acc_t1_0", "eval/expected_acc"]


def train(recipe: str, name: str, overrides: list[str], steps: int, work: Path, extra: list[str]) -> Path:
    """One variant, in this process; records the process CPU seconds of every optimizer step (on a shared
    machine CPU time, unlike wall time, does not depend on what else runs)."""
    from spectrain.recipe.load import load_recipe
    from spectrain.train import loop as T

    out = work / name
    if (out / "cpu_times.json").is_file():
        return out
    r = load_recipe(recipe, [*overrides, f"training.max_steps={steps}", f"training.eval_every={steps}",
                             f"training.checkpoint_every={steps}", f"output_dir={out}", *extra])
    cpu, last = [], [time.process_time()]

    def on_step(run, rec):
        now = time.process_time()
        cpu.append(now - last[0])
        last[0] = now

    T.train(r, on_step=on_step)
    (out / "cpu_times.json").write_text(json.dumps(cpu))
    return out


def summarize(out: Path) -> dict | None:
    """One run's cost and held-out proxies; None while it has not ended. CPU seconds per step come from
    cpu_times.json (written by train() above; None for runs trained otherwise)."""
    from spectrain.train.run_dir import read_run

    run = read_run(out)
    if run is None:
        return None
    steps, cpu_file = run["steps"], out / "cpu_times.json"
    cpu = json.loads(cpu_file.read_text())[1:] if cpu_file.is_file() else []  # step 1 pays one-off warm-up
    on = [r for r in steps if r.get("on_policy") == 1.0]
    row = {"steps": len(steps), "train_wall_s": run["end"]["wall_s"],
           "tokens_per_step": sum(r["tokens"] for r in steps) / max(len(steps), 1),
           "cpu_s_per_step": sum(cpu) / len(cpu) if cpu else None,
           "gen_frac": (sum(r["gen_frac"] for r in on) / len(on)) if on and "gen_frac" in on[0] else None}
    row.update({k: run["heldout"].get(k) for k in EVAL_KEYS})
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--recipe", default="", help="default: recipes/tiny/<family>.yaml")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU seconds per step count all of them)")
    ap.add_argument("--set", nargs="*", default=[], help="extra overrides for every variant (a.b=value)")
    ap.add_argument("--variants", default="", help="comma-separated subset of the family's variants")
    a = ap.parse_args()
    recipe = a.recipe or f"recipes/tiny/{a.family}.yaml"
    torch.set_num_threads(a.threads)
    names = a.variants.split(",") if a.variants else list(VARIANTS[a.family])
    rows = {}
    for name in names:
        out = train(recipe, f"{a.family}-{name}-{a.steps}", VARIANTS[a.family][name], a.steps, a.work,
                    [f"training.num_threads={a.threads}", *a.set])
        rows[name] = summarize(out)
        print(json.dumps({"variant": name, **rows[name]}), flush=True)
    cols = ["steps", "train_wall_s", "cpu_s_per_step", "gen_frac", *EVAL_KEYS]
    print("| variant | " + " | ".join(c.removeprefix("eval/") for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in rows.items():
        cells = ["" if row[c] is None else f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
