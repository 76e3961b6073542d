"""GPU checks behind scripts/gpu_check.sh: training throughput + MFU on a synthetic ~1B Llama target,
tokens/s of a finished tiny run, and greedy losslessness of speculative decoding on the device.

    python -m scripts.gpu_check synthetic --out DIR [--steps 30] [--seq 2048] [--micro 4]
    python -m scripts.gpu_check tiny-report --run runs/tiny-eagle3 --out DIR     # -> DIR/tiny_train_<kind>.json
    python -m scripts.gpu_check lossless --out DIR [--target assets/reference-target] [--drafter DIR ...]
    python -m scripts.gpu_check summary --out DIR
    # CPU dry run of the same code paths (seconds; numbers meaningless):
    python -m scripts.gpu_check synthetic --device cpu --size tiny --steps 3 --seq 64 --micro 2 --out /tmp/g

Each subcommand writes DIR/<name>.json and prints one summary line. Not a test: CI never runs it.

Model FLOPs (PaLM appendix-B convention, attention counted without causal halving; T = tokens in
the step, s = sequence length, L = layers, H = hidden size, K = TTT steps):
    target forward (features, no grad)   2 * P_t_layers * T + 4 * L_t * H_t * s * T
    teacher logits (frozen lm_head)      2 * H_t * V_t * T
    drafter fc (once per step)           6 * P_fc * T
    drafter forward + backward, per TTT  6 * P_d * T + 12 * L_d * H_d * s * T      (times K)
P_t_layers / P_fc / P_d = parameters of the Linear layers that run (P_d: decoder layer(s) + draft
lm_head; embedding lookups excluded).
MFU = model FLOPs per step / step time / peak; peak defaults to 989e12 (H100/H200 SXM bf16 dense).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

# Llama-3.2-1B's shape with random weights (1.24B parameters, tied embeddings): no download needed.
SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}


def _write(out: Path, name: str, rec: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rec, indent=2))
    print(f"{name}: " + json.dumps({k: v for k, v in rec.items() if not isinstance(v, (dict, list))}))


def linear_params(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def model_flops_per_step(target, drafter: nn.Module, tokens: int, seq: int, ttt: int) -> dict[str, float]:
    """The formula in the module docstring, from the modules that actually run."""
    cfg = target.config
    layers_t = linear_params(target.layers)
    h_t, l_t, v_t = target.hidden_size, target.num_layers, target.vocab_size
    fc = getattr(drafter, "fc", None)
    p_fc = linear_params(fc) if isinstance(fc, nn.Module) else 0
    p_d = linear_params(drafter) - p_fc
    l_d = sum(1 for m in drafter.modules() if type(m).__name__.endswith("DecoderLayer")) or 1
    cfg_d = getattr(drafter, "config", None)
    h_d = cfg_d.get("hidden_size", h_t) if isinstance(cfg_d, dict) else getattr(cfg_d, "hidden_size", h_t)
    parts = {
        "target_forward": 2 * layers_t * tokens + 4 * l_t * h_t * seq * tokens,
        "teacher_logits": 2 * h_t * v_t * tokens,
        "drafter_fc": 6 * p_fc * tokens,
        "drafter_fwd_bwd": ttt * (6 * p_d * tokens + 12 * l_d * h_d * seq * tokens),
    }
    parts["total"] = sum(parts.values())
    parts["params"] = {"target_layers": layers_t, "drafter_fc": p_fc, "drafter_per_ttt": p_d, "target_total":
                       sum(p.numel() for p in target.model.parameters()), "config": cfg.model_type}
    return parts


def synthetic_target(size: str, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from spectrain.targets.model import FrozenTarget

    cfg = LlamaConfig(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SIZES[size])
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return FrozenTarget(model, tokenizer=None, name_or_path=f"synthetic-llama-{size}")


def synthetic_rows(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """Full-length rows (no padding), loss on the second half like an assistant reply."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=g)
        mask = torch.zeros(seq, dtype=torch.long)
        mask[seq // 2:] = 1
        rows.append({"id": f"s{i}", "input_ids": ids, "loss_mask": mask})
    return rows


def cmd_synthetic(a) -> int:
    from spectrain.recipe.load import recipe_from_dict
    from spectrain.train import loop as T

    device = a.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("synthetic: no CUDA device (use --device cpu --size tiny for a dry run)")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = synthetic_target(a.size, device, dtype)
    steps, micro = a.steps, a.micro
    rows = synthetic_rows(micro * steps, a.seq, target.vocab_size)
    draft_vocab = min(32000, target.vocab_size)
    recipe = recipe_from_dict({
        "drafter": {"kind": "eagle3", "eagle3": {"draft_vocab_size": draft_vocab, "ttt_steps": a.ttt}},
        "training": {"global_batch_size": micro, "micro_batch_size": micro, "max_steps": steps, "warmup_steps": 1,
                     "lr": 1e-4, "precision": "bf16" if device == "cuda" else "fp32", "eval_every": 0,
                     "checkpoint_every": 0},
        "tracking": {"report_to": ["jsonl"]}, "output_dir": str(a.out / "synthetic-run")})
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    summary = T.train(recipe, target=target, train_rows=rows, heldout_rows=None)
    recs = [json.loads(x) for x in (a.out / "synthetic-run" / "metrics.jsonl").read_text().splitlines()]
    steps_recs = [r for r in recs if "tokens_per_s" in r]
    timed = steps_recs[min(3, len(steps_recs) - 1):]  # drop warm-up steps (allocator, autotuning)
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    tokens = micro * a.seq
    drafter = _trained_drafter(a.out / "synthetic-run", target)  # the module the loop trained, reloaded
    flops = model_flops_per_step(target, drafter, tokens, a.seq, a.ttt)
    step_s = tokens / tps
    rec = {"device": _device_name(device), "size": a.size, "steps": steps, "micro_batch": micro, "seq": a.seq,
           "ttt_steps": a.ttt, "draft_vocab": draft_vocab, "tokens_per_step": tokens,
           "median_tokens_per_s": tps, "median_step_s": step_s, "model_tflops_per_step": flops["total"] / 1e12,
           "achieved_tflops": flops["total"] / step_s / 1e12, "peak_tflops": a.peak / 1e12,
           "mfu": flops["total"] / step_s / a.peak, "flops": flops, "loop_summary_wall_s": summary["wall_s"],
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    _write(a.out, "synthetic", rec)
    return 0


def _trained_drafter(run_dir: Path, target):
    from spectrain.drafters import load_drafter

    proposer = load_drafter(str(run_dir / "last"), target)
    return getattr(proposer, "model", proposer)  # the nn.Module behind the decoding adapter


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else device


def cmd_tiny_report(a) -> int:
    path = Path(a.run) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"tiny-report: {path} not found (did the tiny training run finish?)")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    steps = [r for r in recs if "tokens_per_s" in r]
    evals = [r for r in recs if r.get("split") == "heldout"]
    timed = steps[min(5, len(steps) - 1):]
    import yaml

    recipe_file = Path(a.run) / "recipe.yaml"
    precision = yaml.safe_load(recipe_file.read_text())["training"]["precision"] if recipe_file.is_file() else None
    kind = yaml.safe_load(recipe_file.read_text())["drafter"]["kind"] if recipe_file.is_file() else "unknown"
    rec = {"device": _device_name(a.device), "run": str(a.run), "kind": kind, "precision": precision,
           "steps": len(steps),
           "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
           "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
           "last_heldout_sim_tau_proxy": evals[-1].get("eval/sim_tau_proxy") if evals else None}
    _write(a.out, f"tiny_train_{kind}", rec)
    return 0


def _prompts(target, n: int, seed: int = 0) -> list[list[int]]:
    if target.tokenizer is not None and getattr(target.tokenizer, "chat_template", None):
        qs = ["What is the capital of France?", "Write a Python function that reverses a string.",
              "Give me three tips for staying healthy.", "Explain what a hash table is.",
              "Translate 'good morning' into German.", "Summarize the plot of Hamlet in two sentences."]
        tok = target.tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                 for q in qs[:n]]
        return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]  # the template adds BOS
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, target.vocab_size, (12,), generator=g).tolist() for _ in range(n)]


def _eos(target) -> list[int]:
    """One explicit eos set for both decoders, so a stop-token difference cannot pass for a mismatch."""
    eos = getattr(target.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = target.config.eos_token_id
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _hf_greedy(target, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                eos_token_id=eos or None, pad_token_id=target.config.pad_token_id or 0)
    return out[0, len(prompt):].tolist()


def lossless_one(target, drafter_spec: str, prompts, max_new: int, k: int) -> dict:
    """Greedy speculative decoding vs HF generate(do_sample=False), token for token."""
    from spectrain import load_drafter, speculative_generate

    drafter = load_drafter(drafter_spec, target)
    eos = _eos(target)
    mismatches, total, t_spec, t_hf, accepted_len = [], 0, 0.0, 0.0, []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        ref = _hf_greedy(target, p, max_new, eos)
        t1 = time.perf_counter()
        out = speculative_generate(target, drafter, p, max_new_tokens=max_new, k=k, temperature=0.0,
                                   eos_token_id=eos)
        t2 = time.perf_counter()
        t_hf, t_spec = t_hf + t1 - t0, t_spec + t2 - t1
        n = min(len(ref), len(out.tokens))
        total += n
        if out.tokens[:n] != ref[:n] or len(ref) != len(out.tokens):
            first = next((j for j in range(n) if out.tokens[j] != ref[j]), n)
            mismatches.append({"prompt": i, "first_divergence": first, "hf_len": len(ref), "spec_len": len(out.tokens)})
        tau = getattr(out.stats, "tau", None)
        if tau is not None:
            accepted_len.append(float(tau() if callable(tau) else tau))
    return {"drafter": drafter_spec, "prompts": len(prompts), "tokens_compared": total, "mismatches": mismatches,
            "identical": not mismatches, "mean_tau": statistics.mean(accepted_len) if accepted_len else None,
            "hf_generate_s": t_hf, "speculative_s": t_spec}


def cmd_lossless(a) -> int:
    from spectrain.targets.model import load_target

    device = a.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("lossless: no CUDA device")
    results, ok = [], True
    for dtype in ("float32", "bfloat16"):
        if a.target and Path(a.target).is_dir():
            target = load_target(a.target, dtype=dtype, device=device)
        else:
            target = synthetic_target("tiny", device, getattr(torch, dtype))
        prompts = _prompts(target, a.prompts)
        for spec in ["ngram", *a.drafter]:
            r = {"dtype": dtype, "target": target.name_or_path, **lossless_one(target, spec, prompts, a.max_new, a.k)}
            # fp32 must be exact; in bf16 a batched verification pass may round differently from one-token
            # decoding and flip a near-tie argmax, so bf16 divergences are reported, not failed.
            r["required"] = dtype == "float32"
            ok = ok and (r["identical"] or not r["required"])
            results.append(r)
    _write(a.out, "lossless", {"device": _device_name(device), "all_required_identical": ok, "runs": results})
    return 0 if ok else 1


def cmd_summary(a) -> int:
    """DIR/summary.md from whatever JSON the other subcommands left in DIR."""
    def load(name):
        f = a.out / f"{name}.json"
        return json.loads(f.read_text()) if f.is_file() else None

    lines = ["# spectrain GPU check", ""]
    tinies = [json.loads(f.read_text()) for f in sorted(a.out.glob("tiny_train_*.json"))]
    syn, lo = load("synthetic"), load("lossless")
    for tiny in tinies:
        tau = tiny.get("last_heldout_sim_tau_proxy")
        lines.append(f"- tiny {tiny['kind']} recipe, 1 process, {tiny['precision']}, {tiny['device']}: "
                     f"{tiny['median_tokens_per_s']:.0f} "
                     f"tokens/s (median over {tiny['steps']} steps, warm-up excluded); loss {tiny['first_loss']:.3f} "
                     f"-> {tiny['last_loss']:.3f}" + (f"; held-out sim_tau (proxy) {tau:.2f}" if tau else ""))
    if syn:
        lines.append(f"- synthetic {syn['size']} Llama target ({syn['flops']['params']['target_total'] / 1e9:.2f}B "
                     f"params), EAGLE-3 step, micro {syn['micro_batch']} x seq {syn['seq']}, TTT {syn['ttt_steps']}: "
                     f"{syn['median_tokens_per_s']:.0f} tokens/s, {syn['achieved_tflops']:.1f} TFLOP/s, "
                     f"MFU {100 * syn['mfu']:.1f}% of {syn['peak_tflops']:.0f} TFLOP/s; peak memory "
                     f"{syn['peak_mem_gib'] or 0:.1f} GiB")
    if lo:
        for r in lo["runs"]:
            verdict = "identical" if r["identical"] else f"{len(r['mismatches'])} prompt(s) diverge"
            lines.append(f"- greedy losslessness, {r['dtype']}, drafter {r['drafter']}: {verdict} over "
                         f"{r['tokens_compared']} tokens ({'required' if r['required'] else 'informational'})")
    missing = [n for n, v in (("tiny_train", tinies), ("synthetic", syn), ("lossless", lo)) if not v]
    if missing:
        lines.append(f"- not produced (see the .log files): {', '.join(missing)}")
    (a.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--size", choices=sorted(SIZES), default="1b")
    s.add_argument("--steps", type=int, default=30)
    s.add_argument("--seq", type=int, default=2048)
    s.add_argument("--micro", type=int, default=4)
    s.add_argument("--ttt", type=int, default=7)
    s.add_argument("--peak", type=float, default=989e12, help="peak FLOP/s for MFU (bf16 dense)")
    t = sub.add_parser("tiny-report")
    t.add_argument("--run", required=True)
    lo = sub.add_parser("lossless")
    lo.add_argument("--target", default="assets/reference-target")
    lo.add_argument("--drafter", action="append", default=[], help="trained drafter dir (repeatable)")
    lo.add_argument("--prompts", type=int, default=6)
    lo.add_argument("--max-new", dest="max_new", type=int, default=64)
    lo.add_argument("--k", type=int, default=5)
    su = sub.add_parser("summary")
    for p in (s, t, lo, su):
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    cmds = {"synthetic": cmd_synthetic, "tiny-report": cmd_tiny_report, "lossless": cmd_lossless, "summary": cmd_summary}
    return cmds[a.cmd](a)


if __name__ == "__main__":
    raise SystemExit(main())
