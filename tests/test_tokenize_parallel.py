"""Tokenisation over forked worker processes (build_dataset's path) gives exactly the one-process result."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from spectrain.data import chat as D

ROOT = Path(__file__).resolve().parents[1]


def test_parallel_tokenisation_equals_one_process(monkeypatch, capsys):
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "reference-target"))
    rows = [json.loads(line)["messages"] for line in (ROOT / "data/train/chat_mix_messages.jsonl").open()][:300]
    rows[7] = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]  # a template error
    one = D.tokenize_conversations(tok, rows, 64)
    two = D.tokenize_parallel(tok, rows, 64, workers=2, verbose=True, chunk=50)
    assert [str(x) if isinstance(x, ValueError) else x for x in two] == \
        [str(x) if isinstance(x, ValueError) else x for x in one]
    assert isinstance(two[7], ValueError) and "tokenise" in capsys.readouterr().err  # the progress bar
    monkeypatch.setenv("SPECTRAIN_TOKENIZE_WORKERS", "3")
    assert D.tokenize_workers() == 3
    monkeypatch.delenv("SPECTRAIN_TOKENIZE_WORKERS")
    assert 1 <= D.tokenize_workers() <= 16
