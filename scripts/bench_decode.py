"""Decode-speed benchmark: spectrain's speculative loop against Hugging Face generate, in one run.

    python scripts/bench_decode.py                                  # assets/reference-target, CPU
    python scripts/bench_decode.py --target PATH --n-prompts 12 --max-new-tokens 96 --k 4
    python scripts/bench_decode.py --target PATH --device cuda      # a GPU run (bf16)
    python scripts/bench_decode.py --batch-size 1 --batch-size 4 --batch-size 16   # + the batched table

Rows (greedy, the same prompts, one prompt at a time):
  (a) HF generate, plain                (f) spectrain plain loop (its own baseline, tau = 1)
  (b) spectrain + ngram drafter         (e) HF prompt lookup (prompt_lookup_num_tokens=k)
  (c) spectrain + HF draft model        (d) HF assisted generation with the same draft model
The draft model is a layer subset of the target (its first --draft-layers decoder layers plus the
target's embeddings, final norm and lm_head: the DistillSpec "layer subset" init, untrained), saved
to a temporary directory; there is no small sibling model of the reference target. For a fair
comparison HF assisted generation drafts a constant k tokens (schedule "constant", confidence
threshold 0). HF tau = new tokens / target forward calls (counted with a hook); spectrain tau
excludes its prefill pass, which emits no token. "vs HF" compares (c) with (d) and (b) with (e):
> 1.0 means spectrain is faster. "match" says whether the tokens equal (a) for every prompt.
Prints a markdown table; --json writes the numbers too.

With ``--batch-size B`` (repeatable) a second table decodes the same prompts (cycled to the largest
B) B rows at a time: HF ``generate`` on left-padded batches, spectrain's plain batched loop, and
spectrain + n-gram / + the draft model with ``batch_size=B``; throughput over the batch, the
speedup against spectrain plain at the same B, and whether every row equals row-by-row HF greedy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from spectrain import load_target
from spectrain.decoding.loop import plain_generate, speculative_generate
from spectrain.decoding.stats import DecodeStats
from spectrain.drafters.draft_lm import DraftLMDrafter
from spectrain.drafters.ngram import NgramDrafter


def load_prompts(path: str, n: int, tokenizer) -> list[list[int]]:
    """First turns of a Spec-Bench-style jsonl, round-robin over categories, chat-templated if possible."""
    by_cat: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        text = rec["turns"][0] if "turns" in rec else rec.get("prompt") or rec["question"]
        by_cat.setdefault(rec.get("category", "all"), []).append(text)
    texts, i = [], 0
    while len(texts) < n and any(i < len(v) for v in by_cat.values()):
        texts += [v[i] for v in by_cat.values() if i < len(v)]
        i += 1
    out = []
    for text in texts[:n]:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids))
    return out


def make_layer_subset_draft(target, n_layers: int, out_dir: str) -> str:
    """Save a copy of the target keeping its first n_layers decoder layers (+ embeddings, norm, lm_head)."""
    from transformers import AutoModelForCausalLM

    cfg = target.config.to_dict()
    cfg["num_hidden_layers"] = n_layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:n_layers]
    config = type(target.config).from_dict(cfg)
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    missing, unexpected = draft.load_state_dict(target.model.state_dict(), strict=False)
    # every draft weight must come from the target; the target's deeper layers are the only extras
    assert not [m for m in missing if "rotary" not in m], missing
    draft.save_pretrained(out_dir)
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(out_dir)
    return out_dir


class CallCounter:
    """Counts forward calls of a model (target passes of HF generate)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.n += 1


def run_hf(target, prompts, max_new, eos, **gen_kw) -> dict:
    model, toks, calls, t0 = target.model, [], CallCounter(target.model), time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=target.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0] if eos else 0, **gen_kw)
        toks.append(out[0, len(p):].tolist())
    wall = time.perf_counter() - t0
    calls.handle.remove()
    n = sum(map(len, toks))
    return dict(tokens=toks, emitted=n, wall=wall, tau=n / calls.n)


def run_spectrain(target, drafter, prompts, max_new, eos, k) -> dict:
    t0 = time.perf_counter()
    if drafter is None:
        outs = [plain_generate(target, p, max_new, eos_token_id=eos) for p in prompts]
    else:
        outs = [speculative_generate(target, drafter, p, max_new, k=k, eos_token_id=eos) for p in prompts]
    wall = time.perf_counter() - t0
    st = DecodeStats.merge([o.stats for o in outs])
    return dict(tokens=[o.tokens for o in outs], emitted=st.emitted, wall=wall, tau=st.tau, stats=st.to_dict())


def run_hf_batched(target, prompts, max_new, eos, B) -> dict:
    model, toks, t0 = target.model, [], time.perf_counter()
    pad = eos[0] if eos else 0
    for i in range(0, len(prompts), B):
        chunk = prompts[i: i + B]
        L = max(map(len, chunk))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk], device=target.device)
        am = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk], device=target.device)
        out = model.generate(ids, attention_mask=am, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad)
        for row in out[:, L:].tolist():  # HF pads finished rows: cut at the first eos
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            toks.append(row[:cut])
    wall = time.perf_counter() - t0
    return dict(tokens=toks, emitted=sum(map(len, toks)), wall=wall, tau=1.0)


def batched_table(target, drafter, prompts, args, eos) -> dict:
    """Per batch size: HF batched generate, spectrain plain / n-gram / draft model with batch_size=B."""
    rows = [prompts[i % len(prompts)] for i in range(max(args.batch_size))]
    ref = run_hf(target, rows, args.max_new_tokens, eos)["tokens"]  # row by row: the greedy truth
    mx, k, table = args.max_new_tokens, args.k, {}
    for B in sorted(set(args.batch_size)):
        def spec(d, B=B):
            t0 = time.perf_counter()
            outs = speculative_generate(target, d, rows, mx, k=k, eos_token_id=eos, batch_size=B)
            wall = time.perf_counter() - t0
            st = DecodeStats.merge([o.stats for o in outs])
            return dict(tokens=[o.tokens for o in outs], emitted=st.emitted, wall=wall, tau=st.tau)
        cells = {"HF generate, padded batch": run_hf_batched(target, rows, mx, eos, B),
                 "spectrain plain": spec(None), "spectrain + ngram": spec(NgramDrafter(max_n=args.ngram_max)),
                 "spectrain + draft model": spec(drafter)}
        base = cells["spectrain plain"]
        for name, r in cells.items():
            r["tok_s"] = r["emitted"] / r["wall"]
            r["speedup"] = r["tok_s"] / (base["emitted"] / base["wall"])
            r["match"] = r["tokens"] == ref
            print(f"| {B} | {name} | {r['emitted']} | {r['tok_s']:.1f} | {r['tau']:.2f} | {r['speedup']:.2f} "
                  f"| {'yes' if r['match'] else 'no'} |", flush=True)
        table[B] = {n: {k2: v for k2, v in r.items() if k2 != "tokens"} for n, r in cells.items()}
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="assets/reference-target")
    ap.add_argument("--prompts", default="eval/prompts/spec_bench_question.jsonl")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-model", default="", help="a trained draft model dir (spectrain train's best/ of a "
                    "drafter.kind=draft run) instead of the untrained layer subset")
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median wall time is kept")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--batch-size", action="append", type=int, default=None,
                    help="also decode B rows at a time (repeatable): the batched table")
    ap.add_argument("--skip-single", action="store_true", help="only the batched table")
    args = ap.parse_args(argv)
    if args.batch_size and min(args.batch_size) < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    gc = target.model.generation_config
    eos = gc.eos_token_id if gc.eos_token_id is not None else target.config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    prompts = load_prompts(args.prompts, args.n_prompts, target.tokenizer)
    limit = target.max_positions or 10**9
    prompts = [p[-(limit - args.max_new_tokens):] for p in prompts]
    draft_dir = args.draft_model or make_layer_subset_draft(target, args.draft_layers,
                                                            tempfile.mkdtemp(prefix="spectrain-draft-"))
    drafter = DraftLMDrafter.from_pretrained(draft_dir, target)
    assistant = drafter.model  # the very same weights for HF assisted generation
    assistant.generation_config.num_assistant_tokens = args.k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0

    k, mx = args.k, args.max_new_tokens
    run_spectrain(target, NgramDrafter(), prompts[:1], 8, eos, k)  # warm-up (allocator, kernels)
    run_hf(target, prompts[:1], 8, eos)
    batched = {}
    if args.batch_size:
        print(f"\nbatched, greedy, {max(args.batch_size)} rows (prompts cycled), max_new_tokens={mx}, k={k}; "
              "speedup vs spectrain plain at the same B; match = every row equals row-by-row HF greedy\n")
        print("| B | method | tokens | tok/s | tau | speedup | match |\n|---|---|---|---|---|---|---|")
        batched = batched_table(target, drafter, prompts, args, eos)
    if args.skip_single:
        if args.json:
            Path(args.json).write_text(json.dumps({"batched": batched}, indent=1))
        return 0
    methods = {
        "(a) HF generate, plain": lambda: run_hf(target, prompts, mx, eos),
        "(f) spectrain plain loop": lambda: run_spectrain(target, None, prompts, mx, eos, k),
        "(b) spectrain + ngram": lambda: run_spectrain(target, NgramDrafter(max_n=args.ngram_max), prompts, mx, eos, k),
        "(e) HF prompt lookup": lambda: run_hf(target, prompts, mx, eos, prompt_lookup_num_tokens=k,
                                               max_matching_ngram_size=args.ngram_max),
        "(c) spectrain + draft model": lambda: run_spectrain(target, drafter, prompts, mx, eos, k),
        "(d) HF assisted, same draft": lambda: run_hf(target, prompts, mx, eos, assistant_model=assistant),
    }
    # Interleave the repeats so that a load change on a shared machine hits every method alike;
    # keep the median wall time.
    runs: dict[str, list[dict]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            r = fn()
            runs[name].append(r)
            print(f"  {name}: {r['emitted']} tokens in {r['wall']:.2f}s, tau {r['tau']:.2f}", file=sys.stderr, flush=True)
    rows = {}
    for name, rs in runs.items():
        rs.sort(key=lambda r: r["wall"])
        rows[name] = rs[len(rs) // 2]
    base = rows["(a) HF generate, plain"]
    pairs = {"(b) spectrain + ngram": "(e) HF prompt lookup", "(c) spectrain + draft model": "(d) HF assisted, same draft"}
    print(f"\ntarget {args.target} ({target.num_layers} layers, {target.device}, {target.dtype}); {len(prompts)} prompts, "
          f"max_new_tokens={mx}, k={k}, greedy; draft = "
          f"{args.draft_model or f'first {args.draft_layers} target layers (untrained)'}; "
          f"median of {args.repeats} interleaved runs\n")
    print("| method | tokens | tok/s | tau | speedup vs (a) | vs HF counterpart | match (a) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        r["tok_s"] = r["emitted"] / r["wall"]
        vs = f"{r['tok_s'] / rows[pairs[name]]['emitted'] * rows[pairs[name]]['wall']:.2f}" if name in pairs else ""
        match = "yes" if r["tokens"] == base["tokens"] else "no"
        print(f"| {name} | {r['emitted']} | {r['tok_s']:.1f} | {r['tau']:.2f} | {r['tok_s'] / (base['emitted'] / base['wall']):.2f} "
              f"| {vs} | {match} |")
    if args.json:
        Path(args.json).write_text(json.dumps({**{n: {k2: v for k2, v in r.items() if k2 != "tokens"}
                                                  for n, r in rows.items()}, "batched": batched}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
