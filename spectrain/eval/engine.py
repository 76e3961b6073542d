"""`spectrain eval --engine llama.cpp --target T.gguf --drafter D ...`: the eval grid, served by llama.cpp.

The same prompt sets, chat template and report format as `spectrain eval`, but every token comes from the
engine: a plain `llama-server` and one speculative server per (drafter, k), all on 127.0.0.1 with one slot
and the threads stated, take turns prompt by prompt (plain, spec k=1, spec k=2, ..., plain, ...), so load
drift hits both sides of each speedup alike. D is a run or checkpoint dir (exported to GGUF first, through
spectrain/export/llama_cpp.py), an exported GGUF (or its export directory), ``ngram`` (the engine's own
``ngram-simple`` mode; ``ngram-map-k`` etc. by name) or ``none``.

Per record, from the engine's own counters (spectrain/engines/server.py): alpha_i, tau, acceptance rate,
tok/s of the generation phase (the engine's ``predicted_ms``) against the plain server in the same run, and
at T = 0 the greedy check against the plain engine per prompt (spectrain/eval/divergence.py). The scale a
divergence is judged against is the engine's own arithmetic noise, measured at that very position: the plain
engine's top-2 margin computed token by token during generation and again in one batched pass over the prefix
(as verification computes it). The engine's cost curve (one pass over t = 1..16 tokens at the prompts' depth,
llama-bench) and the draft's measured cost give the record's one predicted speedup, beside the measured one.

What plain eval checks, this path checks: a checkpoint is verified (SHA256SUMS, as `spectrain eval` and `spectrain
export` verify it) before it is exported, an export's SHA256SUMS before its GGUF is served, and the report names a
drafter by what the user gave. Prompts longer than the engine's context (less the answer and a draft) are skipped
and said, so llama-bench never measures beyond it. --top-p / --top-k are sent to the server and --repeats times each
prompt N times (median), as in spectrain's loop; the options the engine cannot honour (UNSUPPORTED: --tree,
--batch-size, --cost-curve, --dtype ...) are refused, not ignored. --conform-to must be spectrain's eval of this
same target, sharing a prompt set with the run.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from spectrain import registry
from spectrain.decoding.loop import plain_generate
from spectrain.decoding.stats import DecodeStats
from spectrain.engines import llama_cpp
from spectrain.engines.process import run_stopped_with_us
from spectrain.engines.server import Completion, LlamaServer
from spectrain.eval import conformance, divergence, report
from spectrain.eval.harness import DecodeConfig, _encode_all, prompt_id, validate_args
from spectrain.eval.prompts import DEFAULT_OOD_SETS, load_prompt_set
from spectrain.export.common import resolve_source
from spectrain.export.llama_cpp import GGUF_NAME, read_gguf_meta
from spectrain.io.integrity import MANIFEST, sha256, verify
from spectrain.io.outputs import MARKER, staged_dir
from spectrain.recipe.load import load_recipe
from spectrain.targets.gguf import gguf_info, resolve_target_path
from spectrain.targets.model import load_target

# --drafter names served by the engine's own n-gram modes ("ngram": its simplest, beside spectrain's n-gram)
ENGINE_MODES = {"ngram": "ngram-simple", **{m: m for m in ("ngram-simple", "ngram-map-k", "ngram-map-k4v",
                                                           "ngram-mod", "ngram-cache")}}
SPEC_TYPE_BY_ARCH = {"eagle3": "draft-eagle3"}  # a GGUF's general.architecture -> --spec-type (else a draft LM)
SCALE_FLOOR = 1e-3  # nats: below this the two paths' margins agree to print precision
PREDICTION = ("tau * cost(1) / (cost(k + 1) + D): the engine's measured cost curve (llama-bench: one target pass over "
              "t new tokens) and D, the drafter's measured time per step, against one plain pass per token")
ENGINE_CTX = 4096  # tokens per slot, unless the model was trained on fewer
COST_TS = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # the cost curve's pass widths
# `spectrain eval` options the engine path cannot honour, refused rather than silently ignored:
# (args attribute, its default, the flag, why). --top-p / --top-k are sent to the server; --repeats is honoured.
UNSUPPORTED = (
    ("tree", [], "--tree", "llama-server drafts chains only"),
    ("batch_size", None, "--batch-size", "each server has one slot, so no batch-size sweep is measured"),
    ("cost_curve", False, "--cost-curve", "the engine's own cost curve (llama-bench) is measured in every run"),
    ("dtype", "auto", "--dtype", "the engine computes in the GGUF's own weight types"),
    ("cost_ratio", None, "--cost-ratio", "the prediction uses the engine's measured cost curve and draft time"),
    ("device", None, "--device", "llama.cpp runs on the CPU threads given by --threads"),
    ("device_map", None, "--device-map", "llama.cpp runs on the CPU threads given by --threads"),
    ("gguf_file", "", "--gguf-file", "give --target as the .gguf file itself"),
    ("report_to", None, "--report-to", "the engine report is written to --out only"),
    ("gpu", None, "--gpu", "no batch-size sweep is predicted"),
    ("gpu_bandwidth", None, "--gpu-bandwidth", "no batch-size sweep is predicted"),
    ("gpu_flops", None, "--gpu-flops", "no batch-size sweep is predicted"),
    ("sweep_repeats", 1, "--sweep-repeats", "no batch-size sweep is measured"),
)


def refuse_unsupported(args) -> None:
    """One line per run for an option the engine would silently ignore (before anything is loaded)."""
    for attr, default, flag, why in UNSUPPORTED:
        if getattr(args, attr, default) not in (default, None, [], ""):  # given (None / [] / "": not given)
            raise ValueError(f"{flag} is not supported with --engine llama.cpp ({why}): drop it, or evaluate with "
                             "spectrain's own loop (`spectrain eval` without --engine)")


@dataclass
class EngineDrafter:
    name: str
    model: Path | None  # the draft GGUF; None for the engine's n-gram modes
    spec_type: str
    weight_type: str | None = None  # the GGUF's largest tensor's storage type (f32, q8_0, ...)


def resolve_drafter(spec: str, target: str, work: Path) -> EngineDrafter:
    """A --drafter value -> what llama-server is started with (a run dir is exported to GGUF under work/); the
    drafter keeps the name the user gave, not the temporary export's."""
    if spec in ENGINE_MODES:
        return EngineDrafter(spec, None, ENGINE_MODES[spec])
    p = Path(spec)
    gguf = p if p.suffix == ".gguf" else p / GGUF_NAME
    if gguf.is_file():
        _check_export(gguf.parent)
        meta, _, weights = read_gguf_meta(gguf)
        return EngineDrafter(spec, gguf, SPEC_TYPE_BY_ARCH.get(meta.get("general.architecture"), "draft-simple"),
                             weights)
    src = resolve_source(p)
    # the checks plain `spectrain eval` makes before it loads a checkpoint (spectrain/drafters/__init__.py)
    verify(src, "drafter", fix="use another checkpoint (e.g. the run's last/ or a step-N/) or re-export it",
           warn_missing=False, required=(src / "drafter_config.json").is_file())
    kind = json.loads((src / "drafter_config.json").read_text()).get("kind")
    fmt = next((f for f in registry.family(kind).serve.exports if f.startswith("llama.cpp-")), None)
    if fmt is None:
        raise ValueError(f"{spec}: llama.cpp serves no {registry.family(kind).title} (it has EAGLE-3 heads, draft "
                         "models and n-gram modes only): evaluate it with `spectrain eval` instead")
    out = work / f"export-{len(list(work.glob('export-*')))}"
    registry.resolve(registry.family(kind).serve.exports[fmt][0])(src, out, target)
    served = resolve_drafter(str(out / GGUF_NAME), target, work)
    return EngineDrafter(spec, served.model, served.spec_type, served.weight_type)


def _check_export(d: Path) -> None:
    """An export directory's SHA256SUMS is checked before its GGUF is served; one spectrain wrote (its marker) must
    carry one. A GGUF of your own, in a directory without either, is served as it is."""
    if (d / MANIFEST).is_file() or (d / MARKER).is_file():
        verify(d, "drafter export", fix="export it again (spectrain export RUN --format llama.cpp)", required=True)


def cost_curve(engine, target: Path, depth: int, threads: int, ts=COST_TS) -> dict[int, float]:
    """Seconds of one target pass over t new tokens with `depth` tokens in the cache (llama-bench, median of 5)."""
    cmd = [str(engine.binary("llama-bench")), "-m", str(target), "-p", ",".join(map(str, ts)), "-n", "0",
           "-d", str(depth), "-t", str(threads), "-r", "5", "-o", "json"]
    done = run_stopped_with_us(cmd, timeout=600)  # a SIGTERM or Ctrl-C here stops llama-bench too
    if done.returncode:
        raise RuntimeError(f"llama-bench failed: {done.stderr.strip()[-300:]}")
    return {int(r["n_prompt"]): float(r["avg_ns"]) / 1e9 for r in json.loads(done.stdout)}


def _stats(c: Completion, k: int) -> DecodeStats:
    """The engine's counters in spectrain's terms. Every step drafts k tokens (p_min 0), so position i is
    verified on the steps that accepted position i-1: attempts_1 = drafts, attempts_i = accepts_(i-1)."""
    acc = (c.accepted_per_pos + [0] * k)[:k]
    att = [c.drafts] + acc[:-1]
    # the prefill pass emits the first token (spectrain counts it as a pass too), then one pass per step
    passes = 1 + c.drafts + max(0, c.predicted_n - 1 - c.drafts - c.draft_n_accepted)
    return DecodeStats(k=k, attempts=att, accepts=acc, drafted=c.draft_n, target_passes=passes,
                       emitted=c.predicted_n, sequences=1, wall_time_s=c.predicted_ms / 1e3,
                       draft_time_s=c.draft_ms / 1e3, target_time_s=max(0.0, c.predicted_ms - c.draft_ms) / 1e3)


def _cell() -> dict:
    return {"tokens": 0, "seconds": 0.0, "outputs": [], "stats": [], "top2": []}


def _add(cell: dict, c: Completion, k: int, rep: int = 0) -> None:
    """One answer into its cell: its time into repeat `rep`'s total (the cell's seconds: the median repeat, as
    `spectrain eval --repeats` reports), its tokens and counters from the first repeat."""
    reps = cell.setdefault("rep_seconds", [])
    reps.extend([0.0] * (rep + 1 - len(reps)))
    reps[rep] += c.predicted_ms / 1e3
    cell["seconds"] = float(statistics.median(reps))
    if rep:
        return
    cell["tokens"] += len(c.tokens)
    cell["outputs"].append(c.tokens)
    cell["stats"].append(_stats(c, k))
    cell["top2"].append(c.top2_logprobs)


def _margin(lps: list[tuple[int, float]]) -> float | None:
    return lps[0][1] - lps[1][1] if len(lps) >= 2 else None


def judge(plain: LlamaServer, prompt: list[int], base: list[int], base_top2: list, spec: list[int]) -> dict:
    """The greedy check of one prompt against the plain engine (module docstring: the scale)."""
    pos = divergence.first_divergence(base, spec)
    if pos is None or pos >= len(base_top2):
        return divergence.judge_divergence(base, spec, None if pos is not None else 0.0, 0.0 if pos is None else None)
    single = _margin(base_top2[pos])
    batched = _margin(plain.complete(prompt + base[:pos], 1, 0.0, 0, top2=True).top2_logprobs[0])
    scale = max(abs(single - batched), SCALE_FLOOR) if single is not None and batched is not None else None
    return {**divergence.judge_divergence(base, spec, single, scale), "batched_margin": batched}


def run(args, target: Path, encoded: dict, sets, drafters: list[EngineDrafter], engine, log_dir: Path,
        ctx: int = ENGINE_CTX) -> dict:
    cells: dict = {}
    servers = {("plain", 0): LlamaServer(engine, target, threads=args.threads, ctx=ctx, log=log_dir / "plain.log")}
    for d in drafters:
        for k in args.k:
            servers[(d.name, k)] = LlamaServer(engine, target, draft=d.model, spec_type=d.spec_type, k=k, ctx=ctx,
                                               threads=args.threads, log=log_dir / f"spec-{len(servers)}.log")
    started = []
    try:
        for s in servers.values():
            started.append(s.__enter__())
        for ps in sets:
            for temp in args.temperature:
                for i, ids in enumerate(encoded[ps.name]):
                    for rep in range(getattr(args, "repeats", 1)):  # plain, k=1, k=2, ..., plain, ... per prompt
                        _prompt(args, servers, cells, ps.name, temp, ids, args.seed + i, rep)
                print(f"  {ps.name} T={temp:g}: {len(encoded[ps.name])} prompts", file=sys.stderr)
    finally:
        for s in started:
            s.stop()
    return cells


def _prompt(args, servers: dict, cells: dict, set_name: str, temp: float, ids: list[int], seed: int, rep: int) -> None:
    """One prompt through the plain server and every speculative one (repeat `rep`); the greedy check on the first."""
    sampling = {"top_k": args.top_k, "top_p": args.top_p}  # sent to the server: the same warp as spectrain's loop
    plain = servers[("plain", 0)]
    base = cells.setdefault(("plain", f"T={temp:g}", set_name), _cell())
    _add(base, plain.complete(ids, args.max_new_tokens, temp, seed, top2=temp == 0 and not rep, **sampling), 1, rep)
    for (name, k), s in servers.items():
        if name == "plain":
            continue
        cell = cells.setdefault((name, f"k={k} T={temp:g}", set_name), _cell())
        _add(cell, s.complete(ids, args.max_new_tokens, temp, seed, **sampling), k, rep)
        if temp == 0 and not rep:
            cell.setdefault("greedy_check", []).append(
                judge(plain, ids, base["outputs"][-1], base["top2"][-1], cell["outputs"][-1]))


def engine_context(target: Path) -> int:
    """Tokens per server slot: ENGINE_CTX, or fewer when the GGUF says the model was trained on fewer."""
    meta, _, _ = read_gguf_meta(target)
    trained = meta.get(f"{meta.get('general.architecture')}.context_length")
    return min(ENGINE_CTX, int(trained)) if isinstance(trained, int) and trained > 0 else ENGINE_CTX


def prompt_room(args, ctx: int) -> int:
    """The longest prompt the engine can answer in full: its context less the answer and the last step's draft."""
    room = ctx - args.max_new_tokens - max(args.k) - 1
    if room < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} (with --k up to {max(args.k)}) leaves no room for a "
                         f"prompt in the engine's context of {ctx} tokens: use --max-new-tokens < {ctx - max(args.k) - 1}")
    return room


def _note_skipped(sets, room: int, ctx: int) -> None:
    for ps in sets:
        n = sum(ps.skipped.values())
        if n:
            print(f"note: {ps.name}: {n} prompts longer than the {room} tokens that fit the engine's context of {ctx} "
                  "(with --max-new-tokens and the draft) skipped; --max-prompt-tokens cuts them instead",
                  file=sys.stderr)


def bench_depth(encoded: dict, args, ctx: int) -> int:
    """The cost curve's cache depth: the prompts' mean length plus half an answer, inside the context."""
    depth = int(sum(len(v[0]) for v in encoded.values()) / len(encoded)) + args.max_new_tokens // 2
    return max(1, min(depth, ctx - max(COST_TS)))


def main(args) -> int:
    refuse_unsupported(args)
    validate_args(args)
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if not args.target or not str(args.target).endswith(".gguf") or not Path(args.target).is_file():
        raise ValueError(f"--engine llama.cpp needs --target T.gguf (a local GGUF file), got {args.target!r}")
    recipe = load_recipe(args.recipe) if args.recipe else None
    target = Path(args.target)
    names = list(dict.fromkeys(args.prompts or ((["heldout"] if recipe else []) + DEFAULT_OOD_SETS)))
    if args.conform_to:  # read before the grid runs, not after it
        check_conform_to(args.conform_to, target, names)
    engine = llama_cpp.require()
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(str(target)))
    sets = [load_prompt_set(n, Path(args.prompts_dir), recipe, tuple(args.in_domain)) for n in names]
    ctx = engine_context(target)
    room = prompt_room(args, ctx)
    encoded = _encode_all(sets, tokenizer, room, args)
    _note_skipped(sets, room, ctx)
    with staged_dir(args.out, "eval") as tmp:
        specs = [d for d in args.drafter if d.lower() != "none"]
        drafters = [resolve_drafter(d, str(target), tmp) for d in specs]
        depth = bench_depth(encoded, args, ctx)
        curve = cost_curve(engine, target, depth, args.threads)
        t0 = time.monotonic()
        cells = run(args, target, encoded, sets, drafters, engine, tmp / "logs", ctx)
        records = _records(args, cells, sets, encoded, drafters, curve)
        meta = _meta(args, engine, target, sets, cells, curve, depth, time.monotonic() - t0)
        meta["engine_context"] = ctx
        paths = report.write_all(tmp, meta, records)
        with open(tmp / "report.md", "a") as f:
            f.write(engine_markdown(meta, records))
        if args.conform_to:
            text = _conformance(args, meta, records, cells, sets, encoded, target)
            (tmp / "conformance.md").write_text(text)
            (tmp / "report.json").write_text(json.dumps({"meta": meta, "records": records}, indent=2) + "\n")
            paths.append(tmp / "conformance.md")
            print(text)
    print(report.summary_table(records, meta))
    print(f"wrote {', '.join(str(args.out / p.relative_to(tmp)) for p in paths)}")
    failed = report.greedy_failures(records)
    for line in failed:
        print(f"FAILURE: {line}", file=sys.stderr)
    return 1 if failed else 0


def same_target(recorded: str, target: Path) -> bool:
    """Whether a report's target is this GGUF: the file itself (or a copy with its sha256), its dequantized
    checkpoint, or (a report made elsewhere, its path not here) a file of the same name."""
    p = Path(str(recorded)).expanduser()
    if p.is_file():
        return p.resolve() == target.resolve() or sha256(p) == sha256(target)
    if p.is_dir():
        info = gguf_info(p)  # the dequantized cache entry records the GGUF's sha256
        return bool(info) and info.get("gguf_sha256") == sha256(target)
    return p.name == target.name


def check_conform_to(path, target: Path, names: list[str]) -> None:
    """The report must be spectrain's own eval of this target and share a prompt set with this run."""
    rep = conformance.load_report(path)
    recorded = (rep.get("meta") or {}).get("target")
    if recorded is not None and not same_target(recorded, target):
        raise ValueError(f"--conform-to {path} evaluated the target {recorded}, not {target}: conformance compares "
                         f"the two evaluators on one target; give a report of `spectrain eval --target {target}`")
    have = sorted({r.get("prompt_set") for r in rep["records"]} - {None})
    if not set(have) & set(names):
        raise ValueError(f"--conform-to {path} holds no prompt set this run decodes (it has {', '.join(have) or 'none'}; "
                         f"this run: {', '.join(names)}): give the same --prompts as that report")


def _conformance(args, meta, records, cells, sets, encoded, target: Path) -> str:
    """Engine alpha_i against spectrain's intervals (eval/conformance.py), and how often spectrain's own plain
    greedy answers (the dequantized target, fp32) equal the engine's."""
    rows = conformance.alpha_rows(conformance.load_records(args.conform_to), records)
    agreement = None
    if 0 in args.temperature:
        hf = load_target(str(target), dtype="float32", device="cpu")
        own = [plain_generate(target=hf, input_ids=torch.tensor(ids), max_new_tokens=args.max_new_tokens).tokens
               for ps in sets for ids in encoded[ps.name]]
        theirs = [o for ps in sets for o in cells[("plain", "T=0", ps.name)]["outputs"]]
        agreement = conformance.greedy_agreement([list(map(int, o)) for o in own], theirs)
    meta["conformance"] = {"against": str(args.conform_to), "rows": rows, "greedy_agreement": agreement}
    return conformance.markdown(rows, agreement)


def _records(args, cells, sets, encoded, drafters, curve) -> list[dict]:
    records = []
    for d in drafters:
        for temp in args.temperature:
            for k in args.k:
                cfg = DecodeConfig(k, None, temp)
                for ps in sets:
                    cell, base = cells[(d.name, cfg.label, ps.name)], cells[("plain", f"T={temp:g}", ps.name)]
                    cell["prompt_stats"], cell["stats"] = cell["stats"], DecodeStats.merge(cell["stats"])
                    cell["prompt_ids"] = [prompt_id(ids) for ids in encoded[ps.name]]
                    rec = report.make_record(d.name, cfg, ps, cell, base, None, plain="engine")
                    rec["engine_spec_type"], rec["engine_gguf_type"] = d.spec_type, d.weight_type
                    one_prediction(rec, curve, k)
                    records.append(rec)
    return records


def one_prediction(rec: dict, curve: dict[int, float], k: int) -> None:
    """The record's one prediction is the cost curve's: the harness's tau / (1 + k c) prices a verify pass over k + 1
    tokens like a plain pass, which this engine measures otherwise, so it is replaced rather than shown beside."""
    rec["predicted_speedup"] = _predict(rec, curve, k)
    rec["predicted_from"] = "the engine's measured cost curve"


def _predict(rec: dict, curve: dict[int, float], k: int) -> float | None:
    """tau * cost(1) / (cost(k+1) + D): tokens per step over the time of one step, a verify pass over k + 1 tokens
    (the engine's cost curve) plus D, the drafter's measured time per step, against one plain pass per token."""
    if rec["tau"] is None or (k + 1) not in curve or not rec["target_passes"]:
        return None
    per_step = rec["draft_time_s"] / rec["target_passes"]
    return rec["tau"] * curve[1] / (curve[k + 1] + per_step)


def _meta(args, engine, target: Path, sets, cells, curve, depth: int, seconds: float) -> dict:
    base = {(t, ps.name): cells[("plain", f"T={t:g}", ps.name)] for t in args.temperature for ps in sets}
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "engine": engine.version,
        "engine_build": engine.info, "target": str(target), "device": f"llama.cpp CPU x{args.threads} threads",
        "drafters": args.drafter, "k": args.k, "trees": [], "temperatures": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "max_new_tokens": args.max_new_tokens, "n_per_set": args.n,
        "repeats": getattr(args, "repeats", 1),
        "threads": args.threads, "dtype": "gguf", "git_sha": report._git_sha(),
        "prompt_sets": [{"name": ps.name, "split": ps.split, "source": ps.source, "n_prompts": ps.n_used,
                         "n_candidates": len(ps.prompts), "skipped": dict(ps.skipped), "n_truncated": ps.truncated}
                        for ps in sets],
        "dropped_sets": getattr(args, "dropped_sets", []),
        "baselines": [{"temperature": t, "prompt_set": name, "tokens": b["tokens"], "wall_time_s": b["seconds"],
                       "tokens_per_s": b["tokens"] / b["seconds"] if b["seconds"] else None}
                      for (t, name), b in base.items()],
        "cost_curve": {"depth": depth, "seconds": {str(t): v for t, v in curve.items()}},
        "grid_seconds": round(seconds, 1), "conventions": {**report.CONVENTIONS, "predicted_speedup": PREDICTION},
        "timing": "generation phase only (the engine's predicted_ms); one slot; servers take turns per prompt",
    }


def engine_markdown(meta: dict, records: list[dict]) -> str:
    """The engine's cost curve and, per record, the measured speedup beside the one the curve predicts."""
    curve = {int(t): s for t, s in meta["cost_curve"]["seconds"].items()}
    lines = ["", f"## llama.cpp: {meta['engine']}", "",
             f"Cost of one target pass over t new tokens at depth {meta['cost_curve']['depth']} (llama-bench), "
             "relative to t = 1:", "", "| t | " + " | ".join(map(str, curve)) + " |",
             "|---|" + "---|" * len(curve), "| cost | " + " | ".join(f"{curve[t] / curve[1]:.2f}" for t in curve) + " |",
             "", f"t = 1: {1e3 * curve[1]:.1f} ms ({1 / curve[1]:.0f} tok/s).", "",
             f"predicted (measured cost curve) = {PREDICTION}. It is also the predicted column of the results "
             "above for these records: tau / (1 + k c) is not used here.", "",
             "| drafter | config | set | alpha_1..k | tau | c | predicted (measured cost curve) | measured "
             "| measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        p, m = r.get("predicted_speedup"), r.get("measured_speedup")
        alphas = " / ".join("-" if a is None else f"{a:.2f}" for a in r["alpha"])
        lines.append(f"| {r['drafter']} | {r['config']} | {r['prompt_set']} | {alphas} | {r['tau']:.2f} | "
                     f"{'-' if r['c'] is None else f'{r[chr(99)]:.3f}'} | {'-' if p is None else f'{p:.2f}x'} | "
                     f"{'-' if m is None else f'{m:.2f}x'} | {'-' if not p or m is None else f'{m / p:.2f}'} |")
    return "\n".join(lines) + "\n"
