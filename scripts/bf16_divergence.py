"""How often greedy speculative output parts from plain greedy in a bf16 target, with and without fp32 logits.

    python scripts/bf16_divergence.py                                   # reference target, ngram k=5, 24 prompts
    python scripts/bf16_divergence.py --drafter runs/tiny-eagle3/best --k 3 --max-new-tokens 64
    python scripts/bf16_divergence.py --target ~/.cache/spectrain/gguf/SmolLM2-135M-Instruct.Q4_1-<sha> --n 4 \
        --max-new-tokens 48 --settings "bf16, fp32 logits" "bf16, bf16 logits"      # SmolLM2 (its dequantized cache)

For each setting (bf16 target with fp32 norm + lm_head, bf16 target with its own bf16 logits, fp32 target) it
decodes the same prompts plainly, speculatively one row at a time, and speculatively in batches of --batch-size
rows, then judges every speculative output against plain greedy per prompt (spectrain/eval/divergence.py:
identical, near-tie = parted where the target's top-2 margin is within rounding noise, FAIL). Prints a markdown
table (the numbers in docs/decoding.md). Acceptance does not depend on machine load; no timings are printed.
"""

from __future__ import annotations

import argparse

import torch

from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.drafters import load_drafter
from spectrain.eval import divergence
from spectrain.eval.greedy_check import top2_margin
from spectrain.eval.prompts import encode_prompts, load_prompt_set
from spectrain.targets.model import load_target

SETTINGS = {"bf16, fp32 logits": ("bfloat16", True), "bf16, bf16 logits": ("bfloat16", False),
            "fp32": ("float32", True)}


def judge(target, prompts, plain, spec) -> dict:
    ulps = divergence.NEAR_TIE_ULPS[target.dtype]
    recs = []
    for ids, p, s in zip(prompts, plain, spec):
        pos = divergence.first_divergence(p, s)
        margin, scale = (top2_margin(target, ids, p, pos) or (None, None)) if pos is not None else (None, None)
        recs.append(divergence.judge_divergence(p, s, margin, scale, ulps=ulps))
    return {**divergence.summarize(recs), "margins": [round(r["margin"], 4) for r in recs if r["margin"] is not None]}


def run(args, dtype: str, fp32_logits: bool, prompts: list[list[int]]) -> dict:
    target = load_target(args.target, dtype=dtype, device="cpu", fp32_logits=fp32_logits)
    drafter = load_drafter(args.drafter, target)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0)
    plain = [plain_generate(target, ids, **kw).tokens for ids in prompts]
    single = [speculative_generate(target, drafter, ids, k=args.k, **kw) for ids in prompts]
    batched = speculative_generate(target, drafter, prompts, k=args.k, batch_size=args.batch_size, **kw)
    tau = sum(len(o.tokens) for o in single) / sum(o.stats.target_passes for o in single)
    return {"single": judge(target, prompts, plain, [o.tokens for o in single]),
            "batched": judge(target, prompts, plain, [o.tokens for o in batched]), "tau": tau}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="assets/reference-target")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--sets", nargs="+", default=["mt_bench", "humaneval", "gsm8k"])
    ap.add_argument("--n", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                    help="which target settings to run (default: all three)")
    args = ap.parse_args()
    tok = load_target(args.target, dtype="float32").tokenizer
    prompts = [ids for s in args.sets for ids in encode_prompts(load_prompt_set(s), tok, args.n, 1024)]
    torch.manual_seed(0)
    print(f"{len(prompts)} prompts ({', '.join(args.sets)}), {args.max_new_tokens} tokens, T = 0, drafter "
          f"{args.drafter} k = {args.k}, batched B = {args.batch_size}\n")
    print("| target | loop | identical | near-tie | FAIL | near-tie margins | tau |\n|---|---|---|---|---|---|---|")
    for name in args.settings:
        res = run(args, *SETTINGS[name], prompts)
        for loop_name in ("single", "batched"):
            r = res[loop_name]
            print(f"| {name} | {loop_name} | {r['identical']}/{r['n']} | {r['near_tie']} | {r['fail']} "
                  f"| {r['margins'] or '-'} | {res['tau']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
