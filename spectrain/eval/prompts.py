"""Prompt sets for evaluation: the shipped Spec-Bench categories, HumanEval, MT-bench, the recipe's held-out
split, any JSONL file; rendered with the target's chat template."""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from spectrain.data.dataset import heldout_prompts
from spectrain.io.resources import prompts_dir

PROMPTS_DIR = prompts_dir()  # eval/prompts/ of the checkout, or the copy inside the installed wheel


SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


DEFAULT_OOD_SETS = [f"spec_bench/{c}" for c in SPEC_BENCH_CATEGORIES] + ["humaneval"]


@dataclass
class PromptSet:
    name: str
    split: str  # "held-out" | "in-domain" | "OOD"
    prompts: list[list[dict]]  # chat message lists ending with the first user turn
    source: str
    skipped: Counter = field(default_factory=Counter)  # reason -> count (malformed lines, too long ...)
    truncated: int = 0  # prompts cut to --max-prompt-tokens (kept)
    bad_lines: list[int] = field(default_factory=list)  # first malformed line numbers, to find them
    n_used: int = 0  # prompts actually run (the first --n that fit)


def _iter_jsonl(path: Path):
    """(line number, record or None if the line is not valid JSON) for every non-blank line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError:
                yield lineno, None


def _first_user_turn(rec: dict) -> list[dict] | None:
    """The messages up to the first user turn: later turns depend on the model's own answers."""
    if isinstance(rec.get("turns"), list) and rec["turns"]:
        text = rec["turns"][0]
        return [{"role": "user", "content": text}] if isinstance(text, str) and text.strip() else None
    msgs = rec.get("messages") or rec.get("conversations")
    if isinstance(msgs, list):
        out = []
        for m in msgs:
            if not isinstance(m, dict):
                return None
            role = m.get("role", {"human": "user", "gpt": "assistant"}.get(m.get("from"), m.get("from")))
            content = m.get("content", m.get("value"))
            if not isinstance(content, str) or not content.strip():
                return None
            out.append({"role": role, "content": content})
            if role == "user":
                return out
        return None
    for key in ("prompt", "question", "instruction"):
        text = rec.get(key)
        if isinstance(text, str) and text.strip():
            return [{"role": "user", "content": text}]
    return None


def load_jsonl_set(name: str, path: Path, keep=None) -> PromptSet:
    """Every usable record of a JSONL(.gz) file, in file order; bad lines are skipped and counted."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt set {name!r}: file {path} not found (see eval/prompts/README.md)")
    ps = PromptSet(name=name, split="OOD", prompts=[], source=str(path))
    for lineno, rec in _iter_jsonl(path):
        if rec is None or not isinstance(rec, dict):
            ps.skipped["malformed line (not a JSON object)"] += 1
            ps.bad_lines.append(lineno)
            continue
        if keep is not None and not keep(rec):
            continue  # another category of the same file: not a skip
        msgs = _first_user_turn(rec)
        if msgs is None:
            ps.skipped["malformed line (no usable prompt text)"] += 1
            ps.bad_lines.append(lineno)
        else:
            ps.prompts.append(msgs)
    return ps


def _spec_bench(category: str, prompts_dir: Path, recipe=None) -> PromptSet:
    others = set(SPEC_BENCH_CATEGORIES) - {"mt_bench"}
    # Spec-Bench's MT-bench part carries the 8 MT-bench categories rather than "mt_bench".
    keep = (lambda r: r.get("category") not in others) if category == "mt_bench" else (
        lambda r: r.get("category") == category)
    return load_jsonl_set(f"spec_bench/{category}", prompts_dir / "spec_bench_question.jsonl", keep)


def _heldout(prompts_dir: Path, recipe=None) -> PromptSet:
    if recipe is None:
        raise ValueError("prompt set 'heldout' is the held-out split of a recipe's training data: pass --recipe R")

    # All of the split (data.heldout_rows caps it): --n picks from these after the length filter.
    convs = heldout_prompts(recipe.data, 10**9)
    prompts = [m for m in (_first_user_turn({"messages": c}) for c in convs) if m]
    return PromptSet("heldout", "held-out", prompts, source=", ".join(recipe.data.train_files))


PROMPT_SETS = {
    "heldout": _heldout,
    **{f"spec_bench/{c}": partial(_spec_bench, c) for c in SPEC_BENCH_CATEGORIES},
    "mt_bench": lambda d, recipe=None: load_jsonl_set("mt_bench", d / "mt_bench_question.jsonl"),
    "gsm8k": lambda d, recipe=None: load_jsonl_set("gsm8k", d / "gsm8k_test.jsonl"),
    "humaneval": lambda d, recipe=None: load_jsonl_set("humaneval", d / "HumanEval.jsonl.gz"),
}


def load_prompt_set(name: str, prompts_dir: Path = PROMPTS_DIR, recipe=None,
                    in_domain: tuple[str, ...] = ()) -> PromptSet:
    """A registered set by name, or a JSONL file path. An empty set is an error naming the cause."""
    if name in PROMPT_SETS:
        ps = PROMPT_SETS[name](Path(prompts_dir), recipe=recipe)
    elif Path(name).is_file():
        ps = load_jsonl_set(Path(name).name.split(".")[0], Path(name))
    elif ("/" in name and not name.startswith("spec_bench/")) or name.endswith((".jsonl", ".gz", ".json")):
        raise FileNotFoundError(f"prompt file {name} not found (a --prompts value with a path is read as a JSONL "
                                f"file); check the path, or use a shipped set: {', '.join(PROMPT_SETS)}")
    else:
        raise ValueError(f"unknown prompt set {name!r}: use one of {', '.join(PROMPT_SETS)} or a JSONL file path")
    trained_on = {Path(f).name for f in recipe.data.train_files} if recipe is not None else set()
    if ps.split == "OOD" and (name in in_domain or ps.name in in_domain or Path(ps.source).name in trained_on):
        ps.split = "in-domain"  # the user says so, or the recipe trains on this very file
    if not ps.prompts:
        why = "; ".join(f"{c} x {r}" for r, c in ps.skipped.items()) or "the file has no records"
        where = f" (lines {', '.join(map(str, ps.bad_lines[:10]))})" if ps.bad_lines else ""
        raise ValueError(f"prompt set {ps.name!r} has no usable prompts in {ps.source}: {why}{where}; each line "
                         "must be a JSON object with 'turns', 'messages', 'prompt' or 'question'")
    if ps.bad_lines:
        print(f"note: prompt set {ps.name!r}: skipped {len(ps.bad_lines)} malformed line(s) of {ps.source} "
              f"(line {', '.join(map(str, ps.bad_lines[:10]))}{' ...' if len(ps.bad_lines) > 10 else ''})",
              file=sys.stderr)
    return ps


def _render(tokenizer, msgs: list[dict], chat_template: bool) -> list[int]:
    if not chat_template:
        return tokenizer("\n\n".join(m["content"] for m in msgs))["input_ids"]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _truncate(tokenizer, msgs: list[dict], ids: list[int], limit: int, chat_template: bool) -> list[int]:
    """Cut the middle of the last message so the rendered prompt has <= `limit` tokens. The middle,
    because instructions sit at the start ("Summarize: ...") and questions at the end (RAG)."""
    content = tokenizer(msgs[-1]["content"], add_special_tokens=False)["input_ids"]
    over = len(ids) - limit + len(tokenizer(" ... ", add_special_tokens=False)["input_ids"])
    for margin in (1, 8, 32):  # re-tokenising at the cut can merge differently: retry with more room
        keep = len(content) - over - margin
        if keep <= 0:
            break
        head = keep // 3
        text = tokenizer.decode(content[:head]) + " ... " + tokenizer.decode(content[len(content) - (keep - head):])
        new = _render(tokenizer, msgs[:-1] + [{**msgs[-1], "content": text}], chat_template)
        if len(new) <= limit:
            return new
    return ids[-limit:]  # the template alone is longer than the limit: keep the end (generation prompt)


def encode_prompts(ps: PromptSet, tokenizer, n: int, max_len: int | None, max_prompt_tokens: int | None = None,
                   chat_template: bool = True) -> list[list[int]]:
    """The first `n` prompts that fit, rendered with the target's chat template; over-long ones on the
    way are skipped and counted (never silently cut: truncation is opt-in via `max_prompt_tokens`)."""
    out: list[list[int]] = []
    for msgs in ps.prompts:
        if len(out) >= n:
            break
        ids = _render(tokenizer, msgs, chat_template)
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            ids = _truncate(tokenizer, msgs, ids, max_prompt_tokens, chat_template)
            ps.truncated += 1
        if max_len is not None and len(ids) > max_len:
            ps.skipped["prompt too long for the context window"] += 1
            continue
        out.append(ids)
    if not out:
        raise ValueError(
            f"prompt set {ps.name!r}: every prompt is longer than the {max_len} tokens that fit the target's "
            "context window with --max-new-tokens; lower --max-new-tokens or truncate with --max-prompt-tokens"
        )
    return out
