"""Chat data: conversations -> token ids + an assistant-only loss mask (the dataset, its cache and the
splits: dataset.py).

Inputs are OpenAI-style ``{"messages": [{"role", "content"}]}`` or ShareGPT-style
``{"conversations": [{"from", "value"}]}`` rows, from local .json / .jsonl / .jsonl.gz files, a
local HF ``datasets`` directory, or a hub dataset name. Every row becomes ``{"id", "messages"}``.
Bad rows are skipped and counted by reason (``SkipReport``); zero usable rows is an error.

Conventions:
- ``loss_mask[j] == 1`` means token j was written by the assistant (its content and its
  end-of-turn token), i.e. position j-1 is trained to predict it.
- Held-out rows are chosen by a hash of the row id (``is_heldout``), so the split is stable across
  runs, machines and file order. The reference-target builder uses the same rule.
- A conversation longer than ``max_length`` is truncated; it is skipped as "over-long" only when no
  assistant token survives the truncation.
- Relative paths are relative to the current working directory.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spectrain.io.progress import Progress

ID_KEYS = ("id", "conversation_id", "prompt_id", "question_id")
ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant"}
__all__ = ["SkipReport", "load_conversations", "is_heldout", "prompt_id", "sample_index", "tokenize_conversation",
           "tokenize_conversations"]


@dataclass
class SkipReport:
    """Counts of skipped rows by reason (plus rows seen / kept)."""

    seen: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    other_split: int = 0  # rows set aside for the other split (not an error)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def lines(self) -> list[str]:
        head = f"data: {self.kept} of {self.seen} rows usable, {sum(self.skipped.values())} skipped"
        if self.other_split:
            head += f", {self.other_split} in the other split"
        return [head] + [f"  skipped {n:6d}  {reason}" for reason, n in self.skipped.most_common()]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict:
        return {"seen": self.seen, "kept": self.kept, "skipped": dict(self.skipped), "other_split": self.other_split}

    @classmethod
    def from_dict(cls, d: dict) -> SkipReport:
        return cls(d["seen"], d["kept"], Counter(d["skipped"]), d.get("other_split", 0))


# ---- reading raw rows ----------------------------------------------------------------------------------


def _read_json_file(path: Path, report: SkipReport) -> Iterator[Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    with opener(path, "rt", encoding="utf-8") as f:
        if name.endswith(".jsonl"):
            for line in f:
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    report.seen += 1
                    report.skip("malformed JSON line")
        elif name.endswith(".json"):
            data = json.load(f)
            if isinstance(data, dict):  # {"data": [...]} / {"train": [...]} or one row
                lists = [v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
                data = lists[0] if len(lists) == 1 and "messages" not in data else [data]
            yield from data
        else:
            raise ValueError(f"{path}: unsupported file type; use .json, .jsonl, .jsonl.gz or a datasets dir")


def _read_hf(source: str, local: bool) -> Iterable[dict]:
    """A `datasets` dir (save_to_disk), a dir of data files, or a hub name ("name" or "name:split")."""
    import datasets

    name, _, split = (source, "", "") if local else source.partition(":")
    p = Path(name)
    try:
        if local and any((p / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(name, split=split or None)
    except Exception as e:  # hub/network/format errors come in many types; all mean "cannot read it"
        where = "local dataset dir" if local else "hub dataset (no such local file or dir either)"
        raise FileNotFoundError(f"cannot load {source!r} as a {where}: {type(e).__name__}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train" if "train" in ds else next(iter(ds))]
    return ds


def _raw_rows(source: str, report: SkipReport) -> Iterable[Any]:
    p = Path(source)
    if p.is_file():
        return _read_json_file(p, report)
    if p.is_dir():
        return _read_hf(source, local=True)
    if source.startswith((".", "/", "~")) or p.suffix in (".json", ".jsonl", ".gz") or source.count("/") > 1:
        hint = "; a recipe's regenerated data: run the `spectrain regenerate` line of its header first" \
            if "regen" in p.parts else ""
        raise FileNotFoundError(f"data file not found: {source} (relative paths are from the current directory){hint}")
    return _read_hf(source, local=False)


# ---- normalising one row ---------------------------------------------------------------------------------


def _normalize_messages(turns: Any, sharegpt: bool) -> tuple[list[dict] | None, str]:
    if not isinstance(turns, list) or not turns:
        return None, "empty or non-list conversation"
    key_role, key_text = ("from", "value") if sharegpt else ("role", "content")
    out = []
    for t in turns:
        if not isinstance(t, dict) or key_role not in t or key_text not in t:
            return None, f"message missing '{key_role}' or '{key_text}'"
        role = SHAREGPT_ROLES.get(t[key_role]) if sharegpt else t[key_role]
        if role not in ROLES:
            return None, f"unknown role {t[key_role]!r}"
        text = t[key_text]
        if not isinstance(text, str):
            return None, "non-string content"
        if not text.strip():
            return None, "empty content"
        out.append({"role": role, "content": text})
    # Trailing non-assistant turns carry no training signal; drop them.
    while out and out[-1]["role"] != "assistant":
        out.pop()
    if not out:
        return None, "no assistant turn"
    return out, ""


def normalize_row(row: Any, fmt: str = "auto") -> tuple[dict | None, str]:
    """-> ({"id", "messages"}, "") or (None, reason)."""
    if not isinstance(row, dict):
        return None, "row is not a JSON object"
    if fmt == "auto":
        fmt = "messages" if "messages" in row else "sharegpt" if "conversations" in row else ""
        if not fmt:
            return None, "no 'messages' or 'conversations' field"
    key = "messages" if fmt == "messages" else "conversations"
    if key not in row:
        return None, f"missing '{key}' field"
    messages, reason = _normalize_messages(row[key], sharegpt=fmt == "sharegpt")
    if messages is None:
        return None, reason
    rid = next((row[k] for k in ID_KEYS if row.get(k) not in (None, "")), None)
    if rid is None:
        rid = hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    return {"id": str(rid), "messages": messages}, ""


def load_conversations(files: str | list[str], format: str = "auto", max_rows: int = 0
                       ) -> tuple[list[dict], SkipReport]:
    """Read and normalise conversations from all `files` (in order); stop after `max_rows` (0 = all)."""
    if format not in ("auto", "messages", "sharegpt"):
        raise ValueError(f"data format {format!r}: use auto, messages or sharegpt")
    report, rows = SkipReport(), []
    for source in [files] if isinstance(files, str) else files:
        for raw in _raw_rows(str(source), report):
            report.seen += 1
            row, reason = normalize_row(raw, format)
            if row is None:
                report.skip(reason)
                continue
            rows.append(row)
            if max_rows and len(rows) >= max_rows:
                break
        if max_rows and len(rows) >= max_rows:
            break
    report.kept = len(rows)
    if not rows:
        raise ValueError(f"no usable conversations in {files}:\n{report}")
    return rows, report


SAMPLE_SUFFIX = re.compile(r"#s(\d+)$")  # `regenerate --samples N`: answers 2..N of a prompt are ID#s1..ID#s{N-1}


def prompt_id(row_id: str) -> str:
    """The id of the prompt a row answers: the row's own id, less a `#sJ` sample suffix."""
    return SAMPLE_SUFFIX.sub("", row_id)


def sample_index(row_id: str) -> int:
    """0 for a prompt's first answer, J for its answer `ID#sJ`."""
    m = SAMPLE_SUFFIX.search(row_id)
    return int(m.group(1)) if m else 0


def is_heldout(row_id: str, fraction: float) -> bool:
    """Deterministic split by id hash. Do not change: the reference-target builder uses the same rule.
    Every answer to one prompt falls on the same side (the hash is of `prompt_id`): a held-out prompt's
    second sample must not leak into training."""
    return int(hashlib.sha1(prompt_id(row_id).encode()).hexdigest()[:8], 16) / 2**32 < fraction


# ---- tokenisation ----------------------------------------------------------------------------------------


def _render(tokenizer, messages: list[dict], gen_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    except Exception as e:  # jinja raises its own errors (e.g. "roles must alternate")
        raise ValueError(f"template rejected the conversation ({type(e).__name__}: {str(e)[:80]})") from None


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans written by the assistant.

    For assistant turn i, rendering messages[:i] with the generation prompt gives the text just
    before the reply starts, and rendering messages[:i+1] gives the text through its end-of-turn
    marker. When both are prefixes of the full rendering (true for ChatML, Llama-3, Mistral,
    Gemma ... templates) the span between them is exactly the reply. Templates that rewrite
    earlier turns (e.g. dropping reasoning) break the prefix property; then the reply segment is
    searched for verbatim after the previous span, and a clear error is raised if it is absent.
    """
    full = _render(tokenizer, messages, False)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        through = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], False)
        # Some templates put extra text in the generation prompt; the reply starts after the common part.
        prefix = len(before) if through.startswith(before) else len(os.path.commonprefix([before, through]))
        segment = through[prefix:]
        if through.startswith(before) and full.startswith(through) and len(before) >= cursor:
            start, end = len(before), len(through)
        else:
            start, end = _locate_reply(full, segment, m["content"], cursor)
        # Keep the end-of-turn marker but not whitespace the template puts after it ("<|im_end|>\n").
        content = m["content"].strip()
        c = full.rfind(content, start, end) if content else -1
        tail_from = c + len(content) if c >= 0 else start
        end = tail_from + len(full[tail_from:end].rstrip())
        if end > start:
            spans.append((start, end))
        cursor = max(cursor, end)
    return full, spans


def _locate_reply(full: str, segment: str, content: str, cursor: int) -> tuple[int, int]:
    """Fallback for templates that render a turn differently once later turns follow it."""
    i = full.find(segment, cursor)
    if i >= 0:
        return i, i + len(segment)
    content = content.strip()
    c = segment.rfind(content)
    j = full.find(content, cursor)
    if c >= 0 and j >= 0:
        tail = segment[c + len(content):].rstrip()  # the end-of-turn marker
        if full.startswith(tail, j + len(content)):
            return j, j + len(content) + len(tail)
    raise ValueError("cannot locate an assistant reply in the rendered conversation: the chat template "
                     "rewrites reply text; render it with a template that keeps replies verbatim")


def _mask_from_offsets(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """A token is the assistant's when its characters overlap an assistant span."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(off), dtype=bool)
    for s, e in spans:
        mask |= (off[:, 0] < e) & (off[:, 1] > s)
    return mask.astype(np.int64).tolist()


def _encode_slow(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    # Slow tokenizers have no offsets: encode prompt and reply pieces separately.
    ids, mask, pos = [], [], 0
    for s, e in [*spans, (len(text), len(text))]:
        for piece, flag in ((text[pos:s], 0), (text[s:e], 1)):
            if piece:
                toks = tokenizer.encode(piece, add_special_tokens=False)
                ids += toks
                mask += [flag] * len(toks)
        pos = e
    return ids, mask


def tokenize_conversations(tokenizer, conversations: list[list[dict]], max_length: int,
                           chunk: int = 256) -> list[tuple[list[int], list[int]] | ValueError]:
    """Batched `tokenize_conversation`; a conversation the template cannot handle yields its ValueError."""
    out: list = []
    for k in range(0, len(conversations), chunk):
        rendered = []
        for messages in conversations[k:k + chunk]:
            try:
                rendered.append(assistant_spans(tokenizer, messages))
            except ValueError as e:
                rendered.append(e)
        ok = [r for r in rendered if not isinstance(r, ValueError)]
        if getattr(tokenizer, "is_fast", False) and ok:
            enc = tokenizer([t for t, _ in ok], add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            encoded = iter(zip(enc["input_ids"], enc["offset_mapping"]))
        for r in rendered:
            if isinstance(r, ValueError):
                out.append(r)
                continue
            if getattr(tokenizer, "is_fast", False):
                ids, offsets = next(encoded)
                ids, mask = list(ids), _mask_from_offsets(offsets, r[1])
            else:
                ids, mask = _encode_slow(tokenizer, *r)
            out.append((ids[:max_length], mask[:max_length]))
    return out


_POOL_TOKENIZER = None  # the tokenizer a forked worker inherits (set just before the pool forks)


def _tokenize_chunk(args: tuple[list[list[dict]], int]) -> list:
    return tokenize_conversations(_POOL_TOKENIZER, *args)


def tokenize_workers() -> int:
    """Processes for tokenising a split: $SPECTRAIN_TOKENIZE_WORKERS, else the usable cores (up to 16) when
    there are at least 4 (a 2-core machine gains little and keeps one process)."""
    env = os.environ.get("SPECTRAIN_TOKENIZE_WORKERS", "")
    if env:
        return max(1, int(env))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(16, cores) if cores >= 4 else 1


def tokenize_parallel(tokenizer, conversations: list[list[dict]], max_length: int, workers: int = 1,
                      verbose: bool = False, chunk: int = 256) -> list:
    """`tokenize_conversations` over `workers` forked processes (same results, same order) with a progress
    bar; one process below 4 chunks of work."""
    parts = [(conversations[k:k + chunk], max_length) for k in range(0, len(conversations), chunk)]
    bar = Progress(len(conversations), "row", "tokenise", enabled=verbose and len(parts) > 1)
    out: list = []
    global _POOL_TOKENIZER
    if workers <= 1 or len(parts) < 4 or "fork" not in multiprocessing.get_all_start_methods():
        for part in parts:
            out += tokenize_conversations(tokenizer, *part, chunk=chunk)
            bar.advance(len(part[0]))
        bar.close()
        return out
    _POOL_TOKENIZER = tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers parallelise; no nested threads
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(parts))) as pool:
            for res in pool.imap(_tokenize_chunk, parts):  # in order
                out += res
                bar.advance(len(res))
    finally:
        _POOL_TOKENIZER = None
        bar.close()
    return out


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """Render with the tokenizer's chat template -> (input_ids, loss_mask), truncated to max_length.

    The mask covers the assistant's tokens only (reply text + its end-of-turn token). The rendered
    string already holds the template's BOS, so no special tokens are added again.
    """
    (res,) = tokenize_conversations(tokenizer, [messages], max_length)
    if isinstance(res, ValueError):
        raise res
    return res


