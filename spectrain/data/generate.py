"""Batched generation by the frozen target for `spectrain regenerate`: left-padded prompts, one KV cache,
greedy or sampled with a per-row seed; the settings (``RegenConfig``) and counters (``RegenStats``)."""

from __future__ import annotations

import functools
import inspect
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from spectrain.data.chat import sample_index
from spectrain.data.regen_server import (
    REASONING_MODES,
    _row_seed,
    apply_reasoning,
    row_record,
)
from spectrain.decoding.left_padded import left_padded_decode
from spectrain.decoding.sampling import Sampler
from spectrain.decoding.step import resolve_eos
from spectrain.decoding.validate import check_sampling


@dataclass
class RegenConfig:
    max_new_tokens: int = 512
    temperature: float | list[float] = 0.0  # a list = a mix: each row draws one by its id (row_temperature)
    seed: int = 0
    batch_size: int = 8
    n: int | None = None  # None = every conversation
    chat_template_kwargs: dict = field(default_factory=dict)  # the recipe's data.chat_template_kwargs + the flag
    reasoning: str = "keep"  # keep | strip <think>...</think> (spectrain/data/regen_server.py)
    shuffle: bool = False  # answer the rows in a seeded order (a hash of seed and id): any prefix is a uniform sample
    skip: int = 0  # leave out the first `skip` rows (after the shuffle): a later run continues an earlier --n
    samples: int = 1  # answers per conversation; the 2nd.. are rows ID#s1.. and always sampled

    def row_temperature(self, row_id: str) -> float:
        """The row's temperature: the one given, or for a mix the entry the (seed, id) hash picks; a prompt's
        extra samples (ID#sJ) draw from the mix's temperatures above 0 (another greedy answer repeats the first)."""
        temps = _as_list(self.temperature)
        if sample_index(row_id) and max(temps) > 0:
            temps = [t for t in temps if t > 0]
        return temps[_row_seed(self.seed, f"temperature:{row_id}", 0) % len(temps)]

    def validate(self) -> RegenConfig:
        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"--reasoning {self.reasoning}: use one of {', '.join(REASONING_MODES)}")
        for bad, msg in ((self.n is not None and self.n <= 0, f"--n {self.n}: must be > 0 (omit it for all rows)"),
                         (self.max_new_tokens <= 0, f"--max-new-tokens {self.max_new_tokens}: must be > 0"),
                         (min(_as_list(self.temperature)) < 0,
                          f"--temperature {self.temperature}: must be >= 0 (0 = greedy)"),
                         (self.skip < 0, f"--skip {self.skip}: must be >= 0"),
                         (self.samples < 1, f"--samples {self.samples}: must be >= 1"),
                         (self.samples > 1 and max(_as_list(self.temperature)) <= 0,
                          f"--samples {self.samples} with --temperature {self.temperature}: every answer after the "
                          "first would repeat the greedy one; give a temperature > 0 (e.g. --temperature 0,1)"),
                         (self.batch_size <= 0, f"--batch-size {self.batch_size}: must be > 0")):
            if bad:
                raise ValueError(msg)
        for t in _as_list(self.temperature):  # what the decoder's sampler accepts, for every path (server, engine)
            try:
                check_sampling(t, 1.0, 0)
            except ValueError as e:
                raise ValueError(f"--temperature {self.temperature}: {e}") from None
        return self


def _as_list(t: float | list[float]) -> list[float]:
    if isinstance(t, list) and not t:
        raise ValueError("--temperature: give a value or a comma-separated mix such as 0,1")
    return t if isinstance(t, list) else [t]


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


def stop_token_ids(target) -> set[int]:
    """The decoder's eos ids plus the token the chat template closes an assistant turn with."""
    tok, stop = target.tokenizer, set(resolve_eos(target, None))
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


def _last_logits(target, ids, attn, pos, cache) -> torch.Tensor:
    kw = {"attention_mask": attn, "position_ids": pos, getattr(target, "_cache_kw", "past_key_values"): cache,
          "use_cache": True}
    if _takes_logits_to_keep(type(target.model)):
        kw["logits_to_keep"] = 1  # the prefill would otherwise project every prompt position onto the vocab
    return target.model(ids, **kw).logits[:, -1].float()


@functools.cache
def _takes_logits_to_keep(model_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def generate_batch(target, prompts: list[list[int]], seeds: list[int], max_new: int, temperature: float,
                   stop: set[int]) -> list[tuple[list[int], bool]]:
    """Left-padded KV-cached decoding -> per prompt (answer ids without the stop token, truncated?)."""
    dev, b = target.device, len(prompts)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    sampler = Sampler(temperature=temperature)  # the one warp the decoder uses
    gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
    out, done, stopped = [[] for _ in prompts], [False] * b, [False] * b

    def pick(logits):
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
        return None if all(done) else [pad if d else t for t, d in zip(nxt, done)]

    left_padded_decode(functools.partial(_last_logits, target), prompts, pad, max_new, pick, dev)
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
        answers = _answer_turn(target, [rows[k]["id"] for k in active], prompts, turn, cfg, stop)
        stats.gen_time_s += time.perf_counter() - t0
        for k, (ids, truncated) in zip(active, answers):
            stats.tokens += len(ids) + (not truncated)
            # Keep every token the target wrote, spaces included, so that training sees its exact text.
            text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if cfg.reasoning == "strip":
                text = apply_reasoning(text, "", "strip")
            if not text.strip():  # training drops rows with an empty turn; end the conversation before it
                _stop_row(convs, todo, k, turn, "empty answer", stats)
                continue
            stats.answers += 1
            stats.truncated += int(truncated)
            convs[k].append({"role": "assistant", "content": text})
    return [{"id": r["id"], "_skipped": c} if isinstance(c, str) else row_record(r["id"], c, cfg)
            for r, c in zip(rows, convs)]


def _answer_turn(target, ids: list[str], prompts: list[list[int]], turn: int, cfg: RegenConfig, stop: set[int]
                 ) -> list[tuple[list[int], bool]]:
    """One turn of a batch; under a temperature mix, one decode per temperature (a row's numbers do not depend
    on its neighbours: per-row seeds)."""
    temps = [cfg.row_temperature(i) for i in ids]
    answers: list = [None] * len(ids)
    for t in dict.fromkeys(temps):
        group = [k for k, tk in enumerate(temps) if tk == t]
        seeds = [_row_seed(cfg.seed, ids[k], turn) for k in group]
        for k, a in zip(group, generate_batch(target, [prompts[k] for k in group], seeds, cfg.max_new_tokens, t, stop)):
            answers[k] = a
    return answers


def _stop_row(convs: list, todo: list, k: int, turn: int, why: str, stats: RegenStats) -> None:
    """First turn: skip the row. Later: keep it through the last answered turn."""
    if turn == 0:
        convs[k] = f"first turn: {why}"  # counted when the part files are merged (resumed rows too)
    else:
        while convs[k][-1]["role"] != "assistant":
            convs[k].pop()
        todo[k] = todo[k][:turn]
        stats.shortened += 1
