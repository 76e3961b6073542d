"""Where a decode step's time goes: spectrain's plain loop against HF generate on the same model, in one run.

    python -m scripts.studies.decode_profile --target models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out eval/reference/decode_profile_cpu.json
    python -m scripts.studies.decode_profile --target assets/reference-target --dtype float32   # the tiny CPU one

Three tables (docs/decoding.md renders them; run it on an idle machine, nothing else running):
- decode_head_cost: the final norm + vocabulary projection over t rows, per logits mode (spectrain/targets/logits.py):
  the full fp32 head, the model's own 16-bit head, and the screened head (fp32 where it decides a token);
- decode_step_split: per generated token, the decoder body (a hook on the model's decoder) and everything else
  (head, sampling, cache edits, Python), for spectrain's plain loop in each logits mode and for HF generate plain,
  interleaved prompt by prompt;
- decode_eagle3_pass: a target pass that captures EAGLE-3's three aux layers and the final state against a bare pass
  of the same width (200 cached tokens).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from spectrain import load_target
from spectrain.decoding import kv_cache
from spectrain.decoding.loop import plain_generate
from spectrain.eval.hf_baselines import HFBaseline
from spectrain.eval.prompts import PROMPTS_DIR, encode_prompts, load_prompt_set
from spectrain.targets.logits import MODES, TargetHead


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def head_cost(target, reps: int) -> dict:
    head = TargetHead(target.norm, target.lm_head)
    rows = []
    for t in (1, 4, 16):
        h = torch.randn(1, t, target.hidden_size).to(target.dtype)
        times = {m: [] for m in MODES}
        for _ in range(reps):  # the modes interleaved, rep by rep: drift on a shared machine hits all alike
            for m in MODES:
                times[m].append(median_ms(lambda m=m, h=h: head.logits(h, m), 1))
        ms = {m: statistics.median(v) for m, v in times.items()}
        rows.append([t, ms["fp32"], ms["native"], ms["screened"], ms["fp32"] / ms["screened"]])
    return {"columns": ["rows t", "fp32 head ms", "16-bit head ms", "screened ms", "fp32 / screened"],
            "formats": ["num:0", "num:2", "num:2", "num:2", "x:2"], "rows": rows}


class DecoderClock:
    """Sums the time spent inside the model's decoder body (every layer, no head) while enabled."""

    def __init__(self, model):
        self.total, self._t0 = 0.0, 0.0
        dec = model.get_decoder()
        dec.register_forward_pre_hook(lambda *a: setattr(self, "_t0", time.perf_counter()))
        dec.register_forward_hook(lambda *a: setattr(self, "total", self.total + time.perf_counter() - self._t0))


def step_split(target, prompts: list[list[int]], max_new: int) -> dict:
    clock = DecoderClock(target.model)
    hf = HFBaseline("hf:plain", "plain")
    runs = {f"spectrain plain, {m} logits": (lambda x, m=m: _plain(target, x, max_new, m)) for m in ("fp32", "screened")}
    runs["HF generate plain"] = lambda x: hf.generate(target, x, max_new)
    for fn in runs.values():  # warm-up
        fn(torch.tensor(prompts[0]))
    acc = {name: [0.0, 0.0, 0] for name in runs}
    for ids in prompts:  # interleaved prompt by prompt: load drift hits every row alike
        for name, fn in runs.items():
            clock.total = 0.0
            t0 = time.perf_counter()
            out = fn(torch.tensor(ids))
            acc[name][0] += time.perf_counter() - t0
            acc[name][1] += clock.total
            acc[name][2] += len(out.tokens)
    fastest = min(s / n for s, _, n in acc.values())
    rows = [[name, 1000 * s / n, 1000 * body / n, 1000 * (s - body) / n, (s / n) / fastest, n / s]
            for name, (s, body, n) in acc.items()]
    return {"columns": ["decoder", "ms / token", "decoder body ms", "everything else ms", "vs fastest", "tok/s"],
            "formats": ["text", "num:1", "num:1", "num:1", "x:2", "num:1"], "rows": rows}


def _plain(target, x, max_new: int, mode: str):
    old = target.logits_mode
    target.logits_mode = mode
    try:
        return plain_generate(target, x, max_new_tokens=max_new)
    finally:
        target.logits_mode = old


def eagle3_pass(target, reps: int) -> dict:
    from transformers import DynamicCache

    cache = DynamicCache()
    ctx = 200
    target.forward(torch.randint(0, target.vocab_size, (1, ctx)), cache=cache, use_cache=True, want_logits=False)
    aux = target.default_aux_layers()
    rows = []
    for t in (1, 4):
        x, pos = torch.randint(0, target.vocab_size, (1, t)), torch.arange(ctx, ctx + t)[None]

        def run(x=x, pos=pos, **kw):
            target.forward(x, position_ids=pos, cache=cache, use_cache=True, **kw)
            kv_cache.crop(cache, ctx)

        bare, eagle = [], []
        for _ in range(reps):  # interleaved
            bare.append(median_ms(run, 1))
            eagle.append(median_ms(lambda: run(aux_layers=aux, want_final_hidden=True), 1))
        b, e = statistics.median(bare), statistics.median(eagle)
        rows.append([t, b, e, e / b])
    return {"columns": ["tokens t", "bare pass ms", "EAGLE-3 capture pass ms", "ratio"],
            "formats": ["num:0", "num:2", "num:2", "x:3"], "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", default="mt_bench")
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None, help="JSON file for the tables (eval/reference/decode_profile_cpu.json)")
    args = p.parse_args()
    target = load_target(args.target, dtype=args.dtype, device="cpu")
    ps = load_prompt_set(args.prompts, Path(PROMPTS_DIR), None, ())
    prompts = encode_prompts(ps, target.tokenizer, args.n, 2000, None, True)
    tables = {"decode_head_cost": head_cost(target, args.reps),
              "decode_step_split": step_split(target, prompts, args.max_new_tokens),
              "decode_eagle3_pass": eagle3_pass(target, args.reps)}
    provenance = {"command": "python -m scripts.studies.decode_profile " + " ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                  "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                              "torch": torch.__version__},
                  "target": args.target, "dtype": str(target.dtype).replace("torch.", ""), "prompt_set": args.prompts,
                  "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    body = {"provenance": provenance, "tables": tables}
    for name, t in tables.items():
        print(f"\n{name}\n" + " | ".join(t["columns"]))
        for r in t["rows"]:
            print(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r))
    if args.out:
        Path(args.out).write_text(json.dumps(body, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
