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
- Resumable, atomic: rows are appended to FILE.tmp (settings in FILE.tmp.meta.json), a restart skips the
  rows already there, FILE appears when all are done. Under torchrun rank r answers rows i % world == r
  into FILE.rank{r}.tmp and rank 0 merges them in input order once every rank's ``.done`` marker exists.
- ``--server URL[,URL...]``: an OpenAI-compatible server (vLLM, SGLang) answers instead, ``--concurrency`` rows
  at a time, with retries; rows it could not answer are counted as failed and retried by a rerun
  (spectrain/regen_server.py). ``data.chat_template_kwargs`` / ``--chat-template-kwargs`` (e.g.
  ``{"enable_thinking": false}`` for Qwen3) and ``--reasoning keep|strip`` apply to both paths.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import json
import os
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spectrain.outputs import write_text_safe
from spectrain.sampling import Sampler


@dataclass
class RegenConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 8
    n: int | None = None  # None = every conversation
    chat_template_kwargs: dict = field(default_factory=dict)  # the recipe's data.chat_template_kwargs + the flag
    reasoning: str = "keep"  # keep | strip <think>...</think> (spectrain/regen_server.py)

    def validate(self) -> RegenConfig:
        from spectrain.regen_server import REASONING_MODES

        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"--reasoning {self.reasoning}: use one of {', '.join(REASONING_MODES)}")
        for bad, msg in ((self.n is not None and self.n <= 0, f"--n {self.n}: must be > 0 (omit it for all rows)"),
                         (self.max_new_tokens <= 0, f"--max-new-tokens {self.max_new_tokens}: must be > 0"),
                         (self.temperature < 0, f"--temperature {self.temperature}: must be >= 0 (0 = greedy)"),
                         (self.batch_size <= 0, f"--batch-size {self.batch_size}: must be > 0")):
            if bad:
                raise ValueError(msg)
        return self


_RANK_COUNTS = ("resumed", "shortened", "answers", "truncated", "tokens", "gen_time_s")


@dataclass
class RegenStats:
    written: int = 0  # rows in the final file (including resumed ones)
    resumed: int = 0  # rows found already done in the tmp file
    skipped: Counter = field(default_factory=Counter)  # reason -> rows not written
    shortened: int = 0  # rows cut before a later turn (context full / empty answer)
    answers: int = 0
    truncated: int = 0  # answers that hit max_new_tokens (kept)
    tokens: int = 0  # generated tokens, stop tokens included
    gen_time_s: float = 0.0  # inside generation (tokens/s uses this)
    wall_s: float = 0.0  # the whole command: loading, templating, generation, files
    failed: int = 0  # --server: rows with no answer after every retry (not written; a rerun retries them)
    last_error: str = ""

    def lines(self) -> list[str]:
        tps = self.tokens / self.gen_time_s if self.gen_time_s > 0 else 0.0
        failed = f", {self.failed} failed (server: {self.last_error})" if self.failed else ""
        return [f"regenerate: {self.written} rows written ({self.resumed} from an earlier run), "
                f"{sum(self.skipped.values())} skipped, {self.shortened} shortened{failed}",
                f"  answers {self.answers}, truncated at max_new_tokens {self.truncated}, tokens generated "
                f"{self.tokens} in {self.gen_time_s:.1f}s = {tps:.1f} tokens/s; wall {self.wall_s:.1f}s",
                *(f"  skipped {n:6d}  {why}" for why, n in self.skipped.most_common())]


# ---- generation ----------------------------------------------------------------------------------------


def stop_token_ids(target) -> set[int]:
    """The decoder's eos ids plus the token the chat template closes an assistant turn with."""
    from spectrain.decoding import _resolve_eos

    tok, stop = target.tokenizer, set(_resolve_eos(target, None))
    if tok.eos_token_id is not None:
        stop.add(int(tok.eos_token_id))
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "PROBE"}]
    try:  # e.g. ChatML targets whose eos is <|endoftext|> end turns with <|im_end|>
        text = tok.apply_chat_template(probe, tokenize=False)
        tail = tok(text[text.rindex("PROBE") + 5:], add_special_tokens=False)["input_ids"]
        if tail and tail[0] in set(tok.all_special_ids) | set(tok.added_tokens_decoder):
            stop.add(int(tail[0]))
    except Exception:  # a template that rejects the probe (e.g. requires a system turn): eos only
        pass
    return stop


def _row_seed(seed: int, row_id: str, turn: int) -> int:
    return int(hashlib.sha1(f"{seed}:{row_id}:{turn}".encode()).hexdigest()[:15], 16)


def _last_logits(target, ids, attn, pos, cache) -> torch.Tensor:
    kw = {"attention_mask": attn, "position_ids": pos, getattr(target, "_cache_kw", "past_key_values"): cache,
          "use_cache": True}
    if _takes_logits_to_keep(type(target.model)):
        kw["logits_to_keep"] = 1  # the prefill would otherwise project every prompt position onto the vocab
    return target.model(ids, **kw).logits[:, -1].float()


@functools.cache
def _takes_logits_to_keep(model_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


@torch.no_grad()
def generate_batch(target, prompts: list[list[int]], seeds: list[int], max_new: int, temperature: float,
                   stop: set[int]) -> list[tuple[list[int], bool]]:
    """Left-padded KV-cached decoding -> per prompt (answer ids without the stop token, truncated?)."""
    from transformers import DynamicCache

    dev, b, n = target.device, len(prompts), max(len(p) for p in prompts)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    ids = torch.full((b, n), pad, dtype=torch.long)
    attn = torch.zeros((b, n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):], attn[i, n - len(p):] = torch.tensor(p), 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    sampler = Sampler(temperature=temperature)  # the one warp the decoder uses
    gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
    cache, out, done, stopped = DynamicCache(), [[] for _ in prompts], [False] * b, [False] * b
    for _ in range(max_new):
        logits = _last_logits(target, ids, attn, pos, cache)
        if sampler.greedy:
            nxt = logits.argmax(-1).tolist()
        else:
            probs = sampler.probs(logits)
            nxt = [int(torch.multinomial(probs[i], 1, generator=gens[i])) for i in range(b)]
        for i, t in enumerate(nxt):
            if done[i]:
                continue
            if t in stop:
                done[i] = stopped[i] = True
            else:
                out[i].append(t)
                done[i] = len(out[i]) >= max_new
        if all(done):
            break
        ids = torch.tensor([[pad if d else t] for t, d in zip(nxt, done)], device=dev)
        attn = torch.cat([attn, torch.ones((b, 1), dtype=attn.dtype, device=dev)], 1)
        pos = pos[:, -1:] + 1
    return [(o, not s) for o, s in zip(out, stopped)]


def _prompt_ids(tok, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    # Same path as training: render to text, then encode without adding specials (the template has BOS).
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    return tok(text, add_special_tokens=False)["input_ids"]


def regenerate_batch(target, rows: list[dict], cfg: RegenConfig, stop: set[int], stats: RegenStats
                     ) -> list[dict]:
    """Answer every assistant turn of `rows`, turn by turn across the batch; a skipped row becomes
    {"id", "_skipped": reason}."""
    tok, limit = target.tokenizer, target.max_positions
    convs: list[list[dict] | str] = [[] for _ in rows]  # a str = the reason the row is skipped
    todo = [[i for i, m in enumerate(r["messages"]) if m["role"] == "assistant"] for r in rows]
    for turn in range(max(len(t) for t in todo)):
        active, prompts = [], []
        for k, r in enumerate(rows):
            if isinstance(convs[k], str) or turn >= len(todo[k]):
                continue
            done_through = todo[k][turn - 1] + 1 if turn else 0
            convs[k] += [dict(m) for m in r["messages"][done_through:todo[k][turn]]]
            why = ""
            try:
                ids = _prompt_ids(tok, convs[k], cfg.chat_template_kwargs)
                if limit is not None and len(ids) > limit - cfg.max_new_tokens:
                    why = f"prompt longer than max positions ({limit}) - max_new_tokens ({cfg.max_new_tokens})"
            except Exception as e:  # jinja raises its own types ("roles must alternate" ...)
                why = f"chat template: {type(e).__name__}: {str(e)[:60]}"
            if why:
                _stop_row(convs, todo, k, turn, why, stats)
                continue
            active.append(k)
            prompts.append(ids)
        if not active:
            continue
        t0 = time.perf_counter()
        seeds = [_row_seed(cfg.seed, rows[k]["id"], turn) for k in active]
        answers = generate_batch(target, prompts, seeds, cfg.max_new_tokens, cfg.temperature, stop)
        stats.gen_time_s += time.perf_counter() - t0
        for k, (ids, truncated) in zip(active, answers):
            stats.tokens += len(ids) + (not truncated)
            # Keep every token the target wrote, spaces included, so that training sees its exact text.
            text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if cfg.reasoning == "strip":
                from spectrain.regen_server import apply_reasoning

                text = apply_reasoning(text, "", "strip")
            if not text.strip():  # training drops rows with an empty turn; end the conversation before it
                _stop_row(convs, todo, k, turn, "empty answer", stats)
                continue
            stats.answers += 1
            stats.truncated += int(truncated)
            convs[k].append({"role": "assistant", "content": text})
    return [{"id": r["id"], "_skipped": c} if isinstance(c, str) else {"id": r["id"], "messages": c}
            for r, c in zip(rows, convs)]


def _stop_row(convs: list, todo: list, k: int, turn: int, why: str, stats: RegenStats) -> None:
    """First turn: skip the row. Later: keep it through the last answered turn."""
    if turn == 0:
        convs[k] = f"first turn: {why}"  # counted when the part files are merged (resumed rows too)
    else:
        while convs[k][-1]["role"] != "assistant":
            convs[k].pop()
        todo[k] = todo[k][:turn]
        stats.shortened += 1


# ---- files: resume, atomic rename, per-rank parts --------------------------------------------------------
# A part file holds one line per finished input row, in input order: the regenerated row, or
# {"id", "_skipped": reason} so that a resumed run does not redo rows it already had to skip.


def _read_done(tmp: Path) -> Counter:
    """Ids already in `tmp` (a multiset: input ids may repeat); a torn last line is cut off."""
    done: Counter = Counter()
    if not tmp.exists():
        return done
    good = 0
    with open(tmp, "rb") as f:
        for line in f:
            try:
                if not line.endswith(b"\n"):  # every row is written with its newline in one call: torn
                    raise ValueError
                done[json.loads(line)["id"]] += 1
                good += len(line)
            except (ValueError, KeyError, TypeError):  # JSON / UTF-8 errors are ValueErrors too
                if f.read():  # damage before the end is not an interruption
                    raise ValueError(f"{tmp} is corrupt (bad line after {sum(done.values())} rows); delete it "
                                     "to start over") from None
                break
    with open(tmp, "r+b") as f:
        f.truncate(good)  # drop the interrupted write, if any
    return done


def _check_meta(part: Path, meta: dict) -> None:
    """Refuse to mix rows generated with different settings into one file."""
    meta_path = part.with_name(part.name + ".meta.json")
    if part.exists() and meta_path.exists():
        old = json.loads(meta_path.read_text())
        diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
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
    from spectrain.progress import Progress

    stop = stop_token_ids(target)
    bar = Progress(len(rows), "row", "regenerate", enabled=int(os.environ.get("RANK", "0")) == 0,
                   initial=stats.resumed)  # rank 0's rows; the others go at the same pace
    with bar.bar, open(tmp, "a", encoding="utf-8") as f:
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
    tmp = out.with_name(out.name + ".merging")
    with open(tmp, "w", encoding="utf-8") as f:
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


# ---- entry point -----------------------------------------------------------------------------------------


def _check_out(out: Path, recipe=None, part: Path | None = None) -> None:
    """Placement (spectrain/outputs.py): a new .jsonl file, not in the target's directory, no symlink at it or
    at its temp files; a temp part is resumed only when it carries the .meta.json regenerate wrote beside it."""
    from spectrain.outputs import check_file_placement

    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a file path ending in .jsonl")
    if out.suffix != ".jsonl":
        raise ValueError(f"--out {out}: use a .jsonl name so that data.train_files can read it back")
    if out.exists():
        raise ValueError(f"--out {out} already exists; delete it or choose another path")
    temps = [] if part is None else [part, part.with_suffix(".done"), part.with_name(part.name + ".meta.json")]
    check_file_placement(out, [("target", recipe.target.name_or_path)] if recipe else [], temps)
    if part is not None and part.exists() and not temps[2].is_file():
        raise FileExistsError(f"--out {out}: {part} exists but regenerate did not write it (no {temps[2].name} "
                              "beside it); move it away or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)


def _load_rows(recipe, n: int | None):
    """The recipe's conversations, read as training reads them."""
    from spectrain.data import load_conversations

    limit = min(x for x in (n, recipe.data.max_rows) if x) if n or recipe.data.max_rows else 0
    return load_conversations(recipe.data.train_files, recipe.data.format, limit)


def _load_target(recipe, world: int):
    """The frozen target, after checking (from the tokenizer alone) that it can build prompts."""
    from transformers import AutoTokenizer

    from spectrain.gguf_target import resolve_target_path
    from spectrain.target import load_target

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
    from spectrain.recipe import load_recipe

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
    rows, report = _load_rows(recipe, cfg.n)
    stats = RegenStats()
    meta = {"target": recipe.target.name_or_path, "dtype": recipe.target.dtype, "format": recipe.data.format,
            "train_files": list(recipe.data.train_files), "max_rows": recipe.data.max_rows,
            "world_size": world, **asdict(cfg)}
    if server is not None:  # the URLs and the concurrency may change between runs; who answers may not
        meta.update(dtype="server", server_model=server.model)
    part = out.with_name(f"{out.name}.rank{rank}.tmp" if world > 1 else f"{out.name}.tmp")
    _check_out(out, recipe, part)
    marker = part.with_suffix(".done")
    marker.unlink(missing_ok=True)
    _check_meta(part, meta)
    if server is not None:
        from spectrain.regen_server import ChatClient, write_part_server

        write_part_server(ChatClient(server), rows, part, cfg, stats)
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
    stats.skipped.update({f"malformed input: {k}": v for k, v in report.skipped.items()})
    stats.wall_s = time.perf_counter() - t_start
    print("\n".join(stats.lines()) + f"\nregenerate: wrote {out}", flush=True)
    return stats


def add_regenerate_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", required=True, help="output .jsonl (rows {id, messages}; usable as data.train_files)")
    p.add_argument("--n", type=int, default=None, help="only the first N conversations (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="cap per answer (default 512); kept if hit")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (a row's stream: seed, id, turn)")
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


def main(args: argparse.Namespace) -> int:
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                      batch_size=args.batch_size, n=args.n, reasoning=args.reasoning,
                      chat_template_kwargs=_template_kwargs(args.chat_template_kwargs))
    server = None
    if args.server:
        from spectrain.recipe import load_recipe
        from spectrain.regen_server import ServerConfig

        model = args.server_model or load_recipe(args.recipe, args.overrides).target.name_or_path
        server = ServerConfig(urls=[u for u in args.server.split(",") if u.strip()], model=model,
                              concurrency=args.concurrency, retries=args.retries, timeout_s=args.timeout).validate()
    try:
        kw = {"server": server} if server is not None else {}
        stats = regenerate(args.recipe, args.overrides, args.out, cfg, **kw)
    except KeyboardInterrupt:
        print(f"regenerate: interrupted; rerun the same command to resume from {args.out}.tmp", flush=True)
        return 130
    return 1 if getattr(stats, "failed", 0) else 0  # rows the server never answered: rerun to retry them
