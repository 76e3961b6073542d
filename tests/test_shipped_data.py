"""The engine-written SmolLM2 chunks shipped in data/train: what data/README.md says of each file is true of it.

The chunks are consecutive slices of one seeded order of the chat mix (`regenerate --shuffle --seed 0`, then
`--skip`), so together they are a uniform sample that never repeats a conversation, and their held-out rows are
the id-hash split training drops. A chunk re-compressed, re-written or cut from another order fails here."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest

from spectrain.data.chat import is_heldout, load_conversations
from spectrain.data.regen_server import _row_seed

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = sorted((ROOT / "data/train").glob("smollm2_engine_regen_*.jsonl.gz"),
                key=lambda p: int(re.search(r"_(\d+)\.jsonl\.gz$", p.name).group(1)))
# | `train/NAME` | BYTES (UNPACKED unpacked) | ROWS (HELD held out) | TURNS | TOKENS | `SHA…` (unpacked `SHA…`) |
ROW = re.compile(r"^\| `train/(?P<name>[^`]+)` \| (?P<bytes>[\d,]+) \((?P<unpacked>[\d,]+) unpacked\) \| "
                 r"(?P<rows>[\d,]+) \((?P<held>[\d,]+) held out\) \| (?P<turns>[\d,]+) \| [\d,]+ \| "
                 r"`(?P<sha>[0-9a-f]+)…(?P<sha_end>[0-9a-f]+)` \(unpacked `(?P<usha>[0-9a-f]+)…(?P<usha_end>[0-9a-f]+)`\) \|$")


def _stated() -> dict[str, dict]:
    lines = (ROOT / "data/README.md").read_text().splitlines()
    return {m["name"]: {k: v.replace(",", "") for k, v in m.groupdict().items()}
            for m in map(ROW.match, lines) if m}


def _matches(digest: str, head: str, tail: str) -> bool:
    return digest.startswith(head) and digest.endswith(tail)


def test_every_chunk_is_listed_with_its_true_size_rows_and_checksums():
    stated = _stated()
    assert CHUNKS and sorted(stated) == sorted(p.name for p in CHUNKS), "data/README.md lists other files"
    for path in CHUNKS:
        s, packed = stated[path.name], path.read_bytes()
        raw = gzip.decompress(packed)
        rows = [json.loads(line) for line in raw.decode().splitlines()]
        assert (len(packed), len(raw)) == (int(s["bytes"]), int(s["unpacked"])), path.name
        assert _matches(hashlib.sha256(packed).hexdigest(), s["sha"], s["sha_end"]), path.name
        assert _matches(hashlib.sha256(raw).hexdigest(), s["usha"], s["usha_end"]), path.name
        assert len(rows) == int(s["rows"]) and sum(is_heldout(r["id"], 0.05) for r in rows) == int(s["held"])
        assert sum(m["role"] == "assistant" for r in rows for m in r["messages"]) == int(s["turns"])
        assert {r["temperature"] for r in rows} <= {0.0, 1.0}


@pytest.mark.parametrize("seed", [0])
def test_chunks_are_consecutive_slices_of_the_seeded_order(seed):
    pool, _ = load_conversations([str(ROOT / "data/train/chat_mix_messages.jsonl")], "messages")
    order = [r["id"] for r in sorted(pool, key=lambda r: _row_seed(seed, f"order:{r['id']}", 0))]
    start = 0
    for path in CHUNKS:
        ids = [json.loads(line)["id"] for line in gzip.open(path, "rt")]
        assert sorted(ids) == sorted(order[start:start + len(ids)]), f"{path.name} is not rows {start}.. of the order"
        start += len(ids)
