"""Tokenised chat rows as a dataset: the tokenisation cache, the train / held-out split, padding, vocab
statistics."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from spectrain.data.chat import (
    SkipReport,
    is_heldout,
    load_conversations,
    sample_index,
    tokenize_parallel,
    tokenize_workers,
)
from spectrain.io.errors import writing

CACHE_VERSION = 1


class ChatDataset(torch.utils.data.Dataset):
    """Tokenised rows stored as flat tensors (compact, picklable for DataLoader workers)."""

    def __init__(self, ids: list[str], input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 offsets: torch.Tensor, report: SkipReport | None = None):
        self.ids, self.input_ids, self.loss_mask, self.offsets = ids, input_ids, loss_mask, offsets
        self.report = report or SkipReport()

    @classmethod
    def from_rows(cls, rows: list[tuple[str, list[int], list[int]]], report: SkipReport) -> ChatDataset:
        lengths = torch.tensor([len(r[1]) for r in rows], dtype=torch.long)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        flat_ids = torch.tensor([t for r in rows for t in r[1]], dtype=torch.int32)
        flat_mask = torch.tensor([m for r in rows for m in r[2]], dtype=torch.bool)
        return cls([r[0] for r in rows], flat_ids, flat_mask, offsets, report)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"id": self.ids[i], "input_ids": self.input_ids[a:b].long(), "loss_mask": self.loss_mask[a:b].long()}

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def state(self) -> dict:
        return {"ids": self.ids, "input_ids": self.input_ids, "loss_mask": self.loss_mask,
                "offsets": self.offsets, "report": self.report.to_dict()}


def _fingerprint_sources(files: list[str]) -> list:
    out = []
    for f in files:
        p = Path(f)
        paths = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p] if p.is_file() else []
        if not paths:  # a hub dataset name: the name (and the datasets cache) is all we can key on
            out.append(["hub", f])
        for q in paths:
            st = q.stat()
            out.append([str(q.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    blob = json.dumps([vocab, tokenizer.chat_template, tokenizer.all_special_tokens], ensure_ascii=False)
    return hashlib.sha1(blob.encode()).hexdigest()


def cache_key(data_cfg, tokenizer, split: str) -> str:
    blob = json.dumps({
        "v": CACHE_VERSION, "split": split, "sources": _fingerprint_sources(list(data_cfg.train_files)),
        "format": data_cfg.format, "max_rows": data_cfg.max_rows, "max_length": data_cfg.max_length,
        "heldout_fraction": data_cfg.heldout_fraction, "heldout_rows": data_cfg.heldout_rows,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
    }, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


def _split_rows(rows: list[dict], data_cfg, split: str) -> list[dict]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split {split!r}: use 'train' or 'heldout'")
    want = split == "heldout"
    picked = [r for r in rows if is_heldout(r["id"], data_cfg.heldout_fraction) == want]
    if want:  # one answer per prompt: more samples per prompt (regenerate --samples) leave the held-out set as it was
        picked = [r for r in picked if not sample_index(r["id"])][: data_cfg.heldout_rows or None]
    return picked


def _read_cache(path: Path) -> ChatDataset | None:
    """The cached split, or None when the file is damaged (truncated by a crash, a full disk, or edited):
    it is named, removed and rebuilt by the caller. Plain tensors only: weights_only=True unpickles nothing."""
    try:
        st = torch.load(path, weights_only=True)
        return ChatDataset(st["ids"], st["input_ids"], st["loss_mask"], st["offsets"],
                           SkipReport.from_dict(st["report"]))
    except Exception as e:  # zip/pickle/key errors: any of them means the file cannot be trusted
        print(f"data: warning: tokenized-data cache {path} is corrupt ({type(e).__name__}: "
              f"{' '.join(str(e).split())[:120]}); discarding it and rebuilding", file=sys.stderr)
        path.unlink(missing_ok=True)
        return None


def build_dataset(data_cfg, tokenizer, split: str = "train", use_cache: bool = True,
                  verbose: bool = True) -> ChatDataset:
    """Load, split, tokenise and mask; cached under data_cfg.cache_dir (keyed by data, tokenizer, settings)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; use an instruct/chat target or set "
                         "tokenizer.chat_template in its tokenizer_config.json")
    path = Path(data_cfg.cache_dir) / f"{split}-{cache_key(data_cfg, tokenizer, split)}.pt"
    if use_cache and path.is_file():
        ds = _read_cache(path)
        if ds is not None:
            if verbose:
                print(f"data: {split} split loaded from cache {path} ({len(ds)} rows)")
            return ds
    rows, report = load_conversations(data_cfg.train_files, data_cfg.format, data_cfg.max_rows)
    picked = _split_rows(rows, data_cfg, split)
    report.other_split = len(rows) - len(picked)
    out = []
    encoded = tokenize_parallel(tokenizer, [r["messages"] for r in picked], data_cfg.max_length,
                                tokenize_workers(), verbose)
    for r, res in zip(picked, encoded):
        if isinstance(res, ValueError):
            report.skip(f"chat template: {res}")
            continue
        ids, mask = res
        if not any(mask):
            report.skip(f"over-long: no assistant token within max_length={data_cfg.max_length}")
            continue
        out.append((r["id"], ids, mask))
    report.kept = len(out)
    if verbose:
        print(f"data: {split} split, {len(out)} rows after tokenisation\n{report}")
    if not out and split == "train":
        raise ValueError(f"no usable rows in the train split of {list(data_cfg.train_files)}:\n{report}")
    if not out and verbose:  # an empty held-out split only means no held-out evaluation
        print(f"data: warning: the held-out split is empty (heldout_fraction={data_cfg.heldout_fraction})")
    ds = ChatDataset.from_rows(out, report)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")  # atomic: several ranks may build at once

        with writing(tmp, name=path):  # a failed write (disk full) leaves no partial cache file
            torch.save(ds.state(), tmp)
        os.replace(tmp, path)
    return ds


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of rows to the longest -> input_ids, attention_mask, loss_mask (LongTensors)."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), int(pad_id), dtype=torch.long)
    attn = torch.zeros((len(rows), n), dtype=torch.long)
    loss = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        attn[i, :k] = 1
        loss[i, :k] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


def token_frequencies(rows: Iterable[dict] | ChatDataset, vocab_size: int) -> torch.Tensor:
    """Counts [vocab_size] of tokens under the loss mask (the EAGLE-3 draft vocabulary is built from it)."""
    if isinstance(rows, ChatDataset):
        ids = rows.input_ids[rows.loss_mask].long()
    else:
        parts = [torch.as_tensor(r["input_ids"])[torch.as_tensor(r["loss_mask"]).bool()] for r in rows]
        ids = torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"token id {int(ids.max())} >= vocab_size {vocab_size}: data tokenised with another tokenizer?")
    return torch.bincount(ids, minlength=vocab_size)


def heldout_prompts(data_cfg, n: int) -> list[list[dict]]:
    """The first n held-out conversations, cut before their first assistant turn (eval prompts)."""
    rows, _ = load_conversations(data_cfg.train_files, data_cfg.format, data_cfg.max_rows)
    out = []
    for r in _split_rows(rows, data_cfg, "heldout"):
        first = next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")
        if first > 0:
            out.append(r["messages"][:first])
        if len(out) >= n:
            break
    return out
