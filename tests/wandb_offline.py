"""Read an offline wandb run back (history rows, config, run record) from its run-<id>.wandb file.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks
of chunks, each a 7-byte header (crc32c, little-endian uint16 length, type FULL=1 / FIRST=2 /
MIDDLE=3 / LAST=4) and a piece of one serialized ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path} is not a wandb log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the rest of a block too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(run_dir: Path) -> dict:
    """{"id", "group", "name", "history": [row dicts], "config": {key: value}, "metrics": {name: definition}}
    of one offline-run-* directory."""
    (log,) = list(Path(run_dir).glob("run-*.wandb"))
    out = {"id": None, "group": None, "name": None, "history": [], "config": {}, "metrics": {}}
    for rec in records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["group"], out["name"] = rec.run.run_id, rec.run.run_group, rec.run.display_name
            for item in rec.run.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "metric":  # define_metric: name (or glob) -> its step metric and summaries
            m = rec.metric
            out["metrics"][m.name or m.glob_name] = {"step_metric": m.step_metric,
                                                     "summary": [f.name for f, v in m.summary.ListFields() if v]}
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
    return out
