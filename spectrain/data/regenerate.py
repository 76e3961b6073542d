"""`spectrain regenerate`: self-distillation data, i.e. the recipe's prompts answered by the frozen target.

    spectrain regenerate recipes/tiny/eagle3.yaml --out data/regen/chat_mix.jsonl --max-new-tokens 256
    spectrain train recipes/tiny/eagle3.yaml data.train_files=[data/regen/chat_mix.jsonl]

Rows are read exactly as training reads them (``data.load_conversations``: formats, bad-row handling,
``data.max_rows``). System/user turns are kept; each assistant turn is replaced by the target's answer
to the conversation so far (earlier turns already regenerated), rendered by the chat template with
``add_generation_prompt=True``. Ids are kept, so the held-out split (an id hash) is unchanged.

- Greedy or sampled; a row's random stream is seeded by (seed, id, turn), so it does not depend on the
  batch or on where a run resumed. Batches are fixed chunks of the input order (left-padded, KV-cached):
  the same on every run, so a resumed run computes the same numbers.
- Stop ids: the decoder's eos (``decoding._resolve_eos``) plus the template's end-of-turn token. Answers
  that hit --max-new-tokens are kept and counted. A prompt over (max positions - max_new_tokens) or an
  empty answer skips the row at its first turn and ends the conversation early at a later one.
- Resumable, atomic: rows are appended to FILE.tmp (settings and the input rows' sha256 in FILE.tmp.meta.json:
  a resume from changed data is refused), a restart skips the rows already there, FILE appears when all are
  done. One writer per output: FILE.lock (flock) refuses a second run on the same --out at once. Under torchrun rank r answers rows i % world == r
  into FILE.rank{r}.tmp and rank 0 merges them in input order once every rank's ``.done`` marker exists.
- ``--server URL[,URL...]``: an OpenAI-compatible server (vLLM, SGLang) answers instead, ``--concurrency`` rows
  at a time, with retries; rows it could not answer are counted as failed and retried by a rerun
  (spectrain/data/regen_server.py). ``data.chat_template_kwargs`` / ``--chat-template-kwargs`` (e.g.
  ``{"enable_thinking": false}`` for Qwen3) and ``--reasoning keep|strip`` apply to both paths.
- ``--engine llama.cpp``: spectrain starts llama-server on the GGUF target and answers through it, naming every
  sampler in each request (top-k 0, top-p 1, min-p 0 ...: the server's defaults would truncate the distribution),
  so a T = 1 row samples the target's distribution as the in-process path does; the same temperatures are refused
  (``RegenConfig.validate``: spectrain's sampling check). Every row records its sampler (``"sampler"``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from spectrain.data.chat import load_conversations
from spectrain.data.generate import _RANK_COUNTS, RegenConfig, RegenStats, regenerate_batch, stop_token_ids
from spectrain.data.regen_server import (
    ChatClient,
    ServerConfig,
    ServerConfigError,
    _read_done,
    _row_seed,
    write_part_server,
)
from spectrain.engines import llama_cpp
from spectrain.engines.server import NEUTRAL_SAMPLERS, LlamaServer
from spectrain.io.outputs import check_file_placement, exclusive_lock, open_nofollow, write_text_safe
from spectrain.io.progress import Progress
from spectrain.recipe.load import load_recipe
from spectrain.targets.gguf import resolve_target_path
from spectrain.targets.model import load_target

# ---- files: resume, atomic rename, per-rank parts --------------------------------------------------------
# A part file holds one line per finished input row, in input order: the regenerated row, or
# {"id", "_skipped": reason} so that a resumed run does not redo rows it already had to skip.


def _rows_digest(rows: list[dict]) -> str:
    """sha256 of the input rows as read: a resumed run must answer the same data, not only the same file names."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def _check_meta(part: Path, meta: dict) -> None:
    """Refuse to mix rows generated with different settings, or from different input rows, into one file."""
    meta_path = part.with_name(part.name + ".meta.json")
    if part.exists() and meta_path.exists():
        old = json.loads(meta_path.read_text())
        # A setting newer than the part file counts at its default: resuming across an upgrade changes nothing.
        known = asdict(RegenConfig())
        diff = sorted(k for k in set(old) | set(meta) if old.get(k, known.get(k)) != meta.get(k, known.get(k)))
        if "input_sha256" in diff:
            raise ValueError(f"{part} was started from other input rows (the data in {', '.join(meta['train_files'])} "
                             "changed since: its sha256 differs); its rows answer the old data: restore that data "
                             f"to resume, or delete {part} and {meta_path.name} to start over")
        if diff:
            changes = ", ".join(f"{k}: {old.get(k)!r} -> {meta.get(k)!r}" for k in diff)
            raise ValueError(f"{part} was started with other settings ({changes}); "
                             "rerun with the same settings to resume, or delete that .tmp file to start over")
    write_text_safe(meta_path, json.dumps(meta, indent=1))


def _write_part(target, rows: list[dict], tmp: Path, cfg: RegenConfig, stats: RegenStats) -> None:
    """Answer `rows` into `tmp`, skipping finished ones. Batches are fixed chunks of `rows` on every run,
    so a batch cut by an interruption is recomputed whole (same neighbours, same numbers)."""
    done = _read_done(tmp)
    stats.resumed = sum(done.values())
    if stats.resumed:
        print(f"regenerate: resuming {tmp}: {stats.resumed} rows already done", flush=True)

    stop = stop_token_ids(target)
    bar = Progress(len(rows), "row", "regenerate", enabled=int(os.environ.get("RANK", "0")) == 0,
                   initial=stats.resumed)  # rank 0's rows; the others go at the same pace
    with bar.bar, open_nofollow(tmp, "a") as f:
        for start in range(0, len(rows), cfg.batch_size):
            batch = rows[start:start + cfg.batch_size]
            have = []
            for r in batch:  # consume the multiset in input order so that repeated ids resume correctly
                have.append(done[r["id"]] > 0)
                done[r["id"]] -= have[-1]
            if all(have):
                continue
            for out, had in zip(regenerate_batch(target, batch, cfg, stop, stats), have):
                if not had:
                    f.write(json.dumps(out, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.advance(have.count(False))
            bar.note(f"{stats.tokens} tokens generated")


def _merge(parts: list[Path], rows: list[dict], out: Path, stats: RegenStats) -> None:
    """Write the finished rows of all parts to `out` in input order (atomically), dropping skip markers."""
    queues: dict[str, deque] = {}
    for p in parts:
        with open(p, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                queues.setdefault(rec["id"], deque()).append(rec)
    tmp = _merging(out)
    with open_nofollow(tmp, "w") as f:
        for r in rows:
            rec = queues[r["id"]].popleft()
            if "_skipped" in rec:
                stats.skipped[rec["_skipped"]] += 1
            else:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                stats.written += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def _merging(out: Path) -> Path:
    return out.with_name(out.name + ".merging")


def _lock_path(part: Path) -> Path:
    """One writer per output (per rank part under a launcher): OUT.lock, or OUT.rankR.lock."""
    return part.with_suffix(".lock")


# ---- entry point -----------------------------------------------------------------------------------------


def _check_out(out: Path, recipe=None, part: Path | None = None) -> None:
    """Placement (spectrain/io/outputs.py): a new .jsonl file, not in the target's directory, no symlink at it or
    at its temp files; a temp part is resumed only when it carries the .meta.json regenerate wrote beside it."""
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a file path ending in .jsonl")
    if out.suffix != ".jsonl":
        raise ValueError(f"--out {out}: use a .jsonl name so that data.train_files can read it back")
    if out.exists():
        raise ValueError(f"--out {out} already exists; delete it or choose another path")
    temps = [] if part is None else [part, part.with_suffix(".done"), part.with_name(part.name + ".meta.json"),
                                     _lock_path(part), _merging(out)]
    check_file_placement(out, [("target", recipe.target.name_or_path)] if recipe else [], temps)
    if part is not None and part.exists() and not temps[2].is_file():
        raise FileExistsError(f"--out {out}: {part} exists but regenerate did not write it (no {temps[2].name} "
                              "beside it); move it away or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)


def _load_rows(recipe, cfg: RegenConfig):
    """The recipe's conversations, read as training reads them, then ordered (--shuffle) and cut (--skip, --n)."""
    n = None if cfg.shuffle or cfg.skip else cfg.n  # a cut after reordering needs every row first
    limit = min(x for x in (n, recipe.data.max_rows) if x) if n or recipe.data.max_rows else 0
    rows, report = load_conversations(recipe.data.train_files, recipe.data.format, limit)
    if cfg.shuffle:  # by a hash, not a permutation of positions: a row keeps its place when others are added
        rows = sorted(rows, key=lambda r: _row_seed(cfg.seed, f"order:{r['id']}", 0))
    if cfg.shuffle or cfg.skip:
        rows = rows[cfg.skip:cfg.skip + cfg.n if cfg.n else None]
        if not rows:
            raise ValueError(f"--skip {cfg.skip}: the data has only {report.kept} usable rows; nothing is left")
    if cfg.samples > 1:  # after the cut: --n / --skip count conversations, each answered `samples` times
        rows = [{**r, "id": f"{r['id']}#s{j}" if j else r["id"]} for r in rows for j in range(cfg.samples)]
    return rows, report


def _load_target(recipe, world: int):
    """The frozen target, after checking (from the tokenizer alone) that it can build prompts."""
    t = recipe.target
    src = resolve_target_path(t.name_or_path, t.gguf_file)
    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=t.trust_remote_code)
    if not getattr(tok, "chat_template", None):  # checked before loading the weights
        raise ValueError(f"target {t.name_or_path!r} has no chat template, so prompts cannot be built: use an "
                         "instruct/chat model or add chat_template to its tokenizer_config.json")
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() and world > 1 else None
    return load_target(t.name_or_path, gguf_file=t.gguf_file, dtype=t.dtype, device=device,
                       device_map=t.device_map or None, trust_remote_code=t.trust_remote_code)


def regenerate(recipe_path: str, overrides: list[str], out: str | Path, cfg: RegenConfig,
               server=None) -> RegenStats:
    """Write the regenerated conversations of a recipe's data to `out` (see the module doc). `server`: a
    regen_server.ServerConfig to ask an OpenAI-compatible server instead of decoding in this process."""
    t_start = time.perf_counter()
    cfg.validate()
    out = Path(out)
    _check_out(out)
    recipe = load_recipe(recipe_path, overrides)
    cfg.chat_template_kwargs = {**recipe.data.chat_template_kwargs, **cfg.chat_template_kwargs}  # the flag wins
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if server is not None and world > 1:
        raise ValueError("--server: run one client process (it sends --concurrency requests at once), not "
                         f"{world} ranks under a launcher")
    rows, report = _load_rows(recipe, cfg)
    meta = {"target": recipe.target.name_or_path, "dtype": recipe.target.dtype, "format": recipe.data.format,
            "train_files": list(recipe.data.train_files), "max_rows": recipe.data.max_rows,
            "input_sha256": _rows_digest(rows), "world_size": world, **asdict(cfg)}
    if server is not None:  # the URLs and the concurrency may change between runs; who answers may not
        meta.update(dtype="server", server_model=server.model, **({"samplers": server.samplers} if server.samplers
                                                                    else {}))
    part = out.with_name(f"{out.name}.rank{rank}.tmp" if world > 1 else f"{out.name}.tmp")
    _check_out(out, recipe, part)
    with exclusive_lock(_lock_path(part), f"--out {out}"):
        _check_out(out, recipe, part)  # again under the lock: a run that held it may have finished `out`
        stats = _answer_and_merge(recipe, rows, out, part, meta, cfg, server, (rank, world))
    if stats.failed or rank != 0:
        return stats
    stats.skipped.update({f"malformed input: {k}": v for k, v in report.skipped.items()})
    stats.wall_s = time.perf_counter() - t_start
    print("\n".join(stats.lines()) + f"\nregenerate: wrote {out}", flush=True)
    return stats


def _answer_server(server, rows: list[dict], part: Path, cfg: RegenConfig, stats: RegenStats) -> None:
    """The server path; a setup error (bad key, unknown model, redirect) removes the part it left empty, so that
    the corrected rerun (e.g. another --server-model) is not refused as a change of settings."""
    client = ChatClient(server)
    try:
        write_part_server(client, rows, part, cfg, stats)
    except ServerConfigError:
        if part.is_file() and part.stat().st_size == 0:
            for q in (part, part.with_name(part.name + ".meta.json")):
                q.unlink(missing_ok=True)
        raise
    if client.models:
        print("regenerate: answered by " + ", ".join(f"{m} ({n})" for m, n in client.models.most_common()),
              flush=True)


def _answer_and_merge(recipe, rows, out: Path, part: Path, meta: dict, cfg: RegenConfig, server,
                      rank_world: tuple[int, int]) -> RegenStats:
    """This process's part (under the output's lock), then rank 0's merge of every part into `out`."""
    rank, world = rank_world
    stats, t_start = RegenStats(), time.perf_counter()
    marker = part.with_suffix(".done")
    marker.unlink(missing_ok=True)
    _check_meta(part, meta)
    if server is not None:
        _answer_server(server, rows, part, cfg, stats)
        if stats.failed:
            stats.wall_s = time.perf_counter() - t_start
            print("\n".join(stats.lines()) + f"\nregenerate: {stats.failed} rows got no answer; {out} not written. "
                  f"Rerun the same command to retry them ({part} keeps the finished rows)", flush=True)
            return stats
    else:
        _write_part(_load_target(recipe, world), rows[rank::world], part, cfg, stats)
    counts = {k: getattr(stats, k) for k in _RANK_COUNTS}
    write_text_safe(marker, json.dumps({"meta": meta, "counts": counts}))  # written last: this part is complete
    if rank != 0:
        print(f"regenerate: rank {rank} done ({len(rows[rank::world])} rows); rank 0 merges", flush=True)
        return stats
    parts = [out.with_name(f"{out.name}.rank{r}.tmp") for r in range(world)] if world > 1 else [part]
    for p in parts[1:]:  # other ranks finish at their own pace; a file marker needs no process-group timeout
        m = p.with_suffix(".done")
        while not (m.exists() and json.loads(m.read_text() or "{}").get("meta") == meta):
            time.sleep(5)
        for k, v in json.loads(m.read_text())["counts"].items():  # ranks run in parallel: time is the max
            setattr(stats, k, max(v, stats.gen_time_s) if k == "gen_time_s" else getattr(stats, k) + v)
    _merge(parts, rows, out, stats)
    for p in parts:
        for q in (p, p.with_suffix(".done"), p.with_name(p.name + ".meta.json")):
            q.unlink(missing_ok=True)
    return stats


def add_regenerate_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", required=True, help="output .jsonl (rows {id, messages}; usable as data.train_files)")
    p.add_argument("--n", type=int, default=None, help="only the first N conversations (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="cap per answer (default 512); kept if hit")
    p.add_argument("--temperature", type=_temperatures, default=0.0, metavar="T[,T...]",
                   help="0 = greedy (default); > 0 samples; a list (0,1) mixes: each row draws one by its id "
                        "and the row records it")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (a row's stream: seed, id, turn)")
    p.add_argument("--shuffle", action="store_true",
                   help="answer rows in a seeded order (hash of seed, id): every prefix is a uniform sample")
    p.add_argument("--skip", type=int, default=0, metavar="K",
                   help="leave out the first K rows (after --shuffle): continue an earlier --n K run in a new file")
    p.add_argument("--samples", type=int, default=1, metavar="N",
                   help="answers per conversation (default 1): the 2nd..Nth are rows ID#s1.. sampled at the "
                        "mix's temperatures above 0; every answer to a prompt falls on one side of the held-out split")
    p.add_argument("--batch-size", type=int, default=8, help="conversations decoded together (default 8)")
    p.add_argument("--chat-template-kwargs", default="{}", metavar="JSON",
                   help='extra chat-template arguments, e.g. \'{"enable_thinking": false}\' (merged over the '
                        "recipe's data.chat_template_kwargs; sent to a server as chat_template_kwargs)")
    p.add_argument("--reasoning", choices=("keep", "strip"), default="keep",
                   help="keep (default) the target's <think>...</think> reasoning in the answers (a server's "
                        "reasoning_content is put back in front), or strip it")
    s = p.add_argument_group("server (an OpenAI-compatible vLLM / SGLang endpoint decodes instead of this process)")
    s.add_argument("--server", default="", metavar="URL[,URL...]",
                   help="server roots or /v1/chat/completions URLs, used round-robin")
    s.add_argument("--server-model", default="", help="the served model name (default: the recipe's target)")
    s.add_argument("--concurrency", type=int, default=64, help="rows in flight at once (default 64)")
    s.add_argument("--retries", type=int, default=5, help="retries per request with backoff (default 5)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    e = p.add_argument_group("engine (spectrain starts a llama.cpp server on the recipe's GGUF target, answers "
                             "through it and stops it; build it once with `spectrain engine fetch llama.cpp`)")
    e.add_argument("--engine", choices=("llama.cpp",), default=None, help="serve the target with this engine")
    e.add_argument("--parallel", type=int, default=16, help="server slots = rows in flight (default 16)")
    e.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads (default: every core)")
    e.add_argument("--ctx", type=int, default=2048, help="tokens per slot (prompt + answer; default 2048); a "
                   "longer prompt is rejected by the server and its row skipped")
    e.add_argument("--spin", action="store_true", help="let the engine's threads busy-wait: faster on an idle "
                   "machine, collapses beside any other busy process (docs/engine.md)")
    return p


def _template_kwargs(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs {text!r} is not JSON ({e}); e.g. '{{\"enable_thinking\": false}}'"
                         ) from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs {text!r}: give a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return value


def _temperatures(text: str) -> float | list[float]:
    """--temperature: one value, or a comma-separated mix."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number or a comma-separated list such as 0,1") from None
    return values[0] if len(values) == 1 else values


def engine_target(recipe) -> Path:
    """The recipe's target as a local GGUF file, which is what llama.cpp serves."""
    t = recipe.target
    path = Path(t.name_or_path) / t.gguf_file if t.gguf_file else Path(t.name_or_path)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"--engine llama.cpp serves a local .gguf target; the recipe's target is {t.name_or_path!r}"
                         f"{' + ' + t.gguf_file if t.gguf_file else ''}: point target.name_or_path at a .gguf file "
                         "(spectrain target fetch, or llama.cpp's convert_hf_to_gguf.py), or start your own server "
                         "and pass --server URL")
    return path.resolve()


def _regenerate_with_engine(args: argparse.Namespace, cfg: RegenConfig) -> RegenStats:
    """Start llama-server on the target (args.parallel slots), answer through it, stop it, whatever happens."""
    cfg.validate()  # a temperature the decoder refuses is refused before a server loads the model
    if args.parallel < 1 or args.threads < 1 or args.ctx <= cfg.max_new_tokens:
        raise ValueError(f"--parallel {args.parallel} / --threads {args.threads} must be >= 1 and --ctx {args.ctx} "
                         f"> --max-new-tokens {cfg.max_new_tokens}")
    _check_out(Path(args.out))  # refused before a server starts, not after it loaded the model
    gguf = engine_target(load_recipe(args.recipe, args.overrides))
    engine = llama_cpp.require()
    log = Path(args.out).with_name(Path(args.out).name + ".llama-server.log")
    print(f"regenerate: starting llama-server ({engine.version}) on {gguf.name}: {args.parallel} slots of "
          f"{args.ctx} tokens, {args.threads} threads (log {log})", flush=True)
    with LlamaServer(engine, gguf, threads=args.threads, ctx=args.ctx, parallel=args.parallel, spin=args.spin,
                     log=log, timeout=args.timeout) as srv:
        # every sampler named: llama-server's defaults (top-k 40, top-p 0.95, min-p 0.05) would truncate the target's
        # distribution, and "T = 1" rows would not be what in-process regeneration writes (engines/server.py)
        server = ServerConfig(urls=[srv.url], model=str(gguf), concurrency=args.parallel, retries=args.retries,
                              timeout_s=args.timeout, gone=srv.gone, samplers=dict(NEUTRAL_SAMPLERS)).validate()
        return regenerate(args.recipe, args.overrides, args.out, cfg, server=server)


def main(args: argparse.Namespace) -> int:
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                      batch_size=args.batch_size, n=args.n, reasoning=args.reasoning, shuffle=args.shuffle,
                      skip=args.skip, samples=args.samples,
                      chat_template_kwargs=_template_kwargs(args.chat_template_kwargs))
    server = None
    if args.server and args.engine:
        raise ValueError("--server and --engine: give one (--server asks a running server; --engine starts one)")
    if args.server:
        model = args.server_model or load_recipe(args.recipe, args.overrides).target.name_or_path
        server = ServerConfig(urls=[u for u in args.server.split(",") if u.strip()], model=model,
                              concurrency=args.concurrency, retries=args.retries, timeout_s=args.timeout).validate()
    try:
        if args.engine:
            stats = _regenerate_with_engine(args, cfg)
        else:
            kw = {"server": server} if server is not None else {}
            stats = regenerate(args.recipe, args.overrides, args.out, cfg, **kw)
    except KeyboardInterrupt:
        print(f"regenerate: interrupted; rerun the same command to resume from {args.out}.tmp", flush=True)
        return 130
    return 1 if getattr(stats, "failed", 0) else 0  # rows the server never answered: rerun to retry them
