"""Offline target-feature cache: run the frozen target once, train many times.

``spectrain prepare-features RECIPE [features.dtype=bf16|fp32|fp8] [features.shard_mb=1024]
[features.batch_size=8]`` (the recipe's ``features:`` section; ``spectrain check`` validates it) writes, under ``training.feature_cache``::

    manifest.json                    target fingerprint, aux layer ids, sizes, dtype, data hash, shards
    train-00000.safetensors ...      one split = consecutive rows, packed without padding
    heldout-00000.safetensors ...

Per shard: ``input_ids`` [N] int32, ``loss_mask`` [N] uint8, ``offsets`` [rows+1] int64 (row r =
tokens offsets[r]:offsets[r+1]), ``last_hidden`` [N, H] (the last decoder layer's *pre-norm*
output; teacher logits are rebuilt from it with the frozen norm + lm_head, never stored) and, when
the drafter needs aux layers, ``aux`` [N, n_aux*H] (the concatenated inputs of those layers).

Bytes per token (H = target hidden size, 3 aux layers): bf16 (default) 8H + 5 (Llama-3.1-8B,
H = 4096: 32.0 KiB/token); fp32 16H + 5; fp8 5H + 9 (aux in float8 e4m3 with one fp32 scale per
row, last_hidden kept bf16 because the teacher distribution is rebuilt from it; 20.0 KiB/token
for H = 4096). Measured on the tiny test target (tests/test_features.py, first TTT-loss of one
batch): bf16 storage changes it by 3e-5 relative, fp8 by 2e-4, fp32 by < 1e-5 (batch-composition
noise only). Every shard is written to a temp file and renamed, its sha256 recorded in the
manifest after each shard, so an interrupted run resumes by skipping the finished shards.

A finished cache grows with its data: when a split's rows are the cached rows followed by new ones (more
regenerated data appended to ``data.train_files``), only the new rows are computed; each such growth is a
``segments`` entry of the split, sharded on its own so the earlier shards keep their bounds. The manifest
records the dtype the target computed in (``target_dtype``), and a cache is never grown or finished by a
target computing in another dtype (its features would mix two numerics); a cache written before that field
keeps it unrecorded when it grows, since its earlier features' dtype is not known.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env
from safetensors.torch import save_file

from spectrain import registry
from spectrain.data.dataset import build_dataset, collate
from spectrain.io.disk import free_bytes, require_disk
from spectrain.io.errors import writing
from spectrain.io.integrity import sha256
from spectrain.io.outputs import MARKER, check_placement, write_marker, write_text_safe
from spectrain.io.progress import Progress
from spectrain.recipe.load import load_recipe
from spectrain.targets.fingerprint import same_target, target_fingerprint
from spectrain.targets.model import load_target

FORMAT_VERSION = 1
STORE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
SPLITS = ("train", "heldout")


def bytes_per_token(hidden: int, n_aux: int, dtype: str) -> int:
    """Storage cost of one token (ids int32 + mask uint8 + features), excluding the tiny offsets."""
    if dtype not in STORE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r}: use one of {', '.join(STORE_DTYPES)}")
    if dtype == "fp8":
        return 5 + (n_aux * hidden + 4 if n_aux else 0) + 2 * hidden
    width = 4 if dtype == "fp32" else 2
    return 5 + width * (n_aux + 1) * hidden


def data_hash(rows) -> str:
    """Content hash of tokenised rows (ids + loss masks), independent of file paths and mtimes."""
    h = hashlib.sha256()
    for r in rows:
        h.update(torch.as_tensor(r["input_ids"]).to(torch.int64).numpy().tobytes())
        h.update(torch.as_tensor(r["loss_mask"]).to(torch.uint8).numpy().tobytes() + b"|")
    return h.hexdigest()[:32]


def _quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.float().abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    return (x.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def _shard_bounds(lengths: list[int], budget_tokens: int) -> list[tuple[int, int]]:
    """Consecutive row ranges of about `budget_tokens` tokens (deterministic, so resume finds them)."""
    bounds, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= budget_tokens:
            bounds.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(lengths):
        bounds.append((start, len(lengths)))
    return bounds


def _segment_bounds(lengths: list[int], budget_tokens: int, segments: list[int]) -> list[tuple[int, int]]:
    """Shard bounds of a split grown in ``segments`` (row counts, summing to len(lengths)): each segment is
    sharded on its own, so the shards written before the split grew keep their bounds and are reused."""
    bounds, start = [], 0
    for n in segments:
        bounds += [(start + a, start + b) for a, b in _shard_bounds(lengths[start:start + n], budget_tokens)]
        start += n
    return bounds


def _segments(out: Path, split: str, prev: dict | None, rows, dh: str) -> list[int]:
    """How the split's rows divide into the cache's growth segments; refuses rows that are not the cached
    rows, or the cached rows followed by new ones."""
    if prev is None:
        return [len(rows)]
    have = prev.get("segments", [prev["rows"]])
    if prev["data_hash"] == dh:
        return have
    if prev.get("complete") and len(rows) > prev["rows"] and data_hash(rows[i] for i in range(prev["rows"])) \
            == prev["data_hash"]:
        return [*have, len(rows) - prev["rows"]]  # appended rows: a new segment
    raise ValueError(f"the {split} data changed since {out} was written (data hash {prev['data_hash']} -> {dh}; "
                     f"a finished cache grows only when the new rows follow its {prev['rows']} rows unchanged); "
                     f"choose another training.feature_cache or delete {out}")


def _pad_id(target) -> int:
    tok = target.tokenizer
    for v in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None),
              getattr(target.config, "pad_token_id", None)):
        if isinstance(v, int):
            return v
    return 0


@torch.no_grad()
def _compute_shard(target, rows, aux_layers: list[int], dtype: str, batch_size: int,
                   progress: Callable[[int, int], None] = lambda rows, tokens: None) -> dict[str, torch.Tensor]:
    ids, masks, aux, last = [], [], [], []
    for b in range(0, len(rows), batch_size):
        part = rows[b: b + batch_size]
        batch = {k: v.to(target.device) for k, v in collate(part, _pad_id(target)).items()}
        out = target.forward(batch["input_ids"], batch["attention_mask"], aux_layers=aux_layers,
                             want_last_hidden=True, want_logits=False)
        for j, r in enumerate(part):
            n = len(r["input_ids"])
            ids.append(torch.as_tensor(r["input_ids"]).to(torch.int32))
            masks.append(torch.as_tensor(r["loss_mask"]).to(torch.uint8))
            last.append(out.last_hidden[j, :n].cpu())
            if aux_layers:
                aux.append(torch.cat([h[j, :n] for h in out.aux_hidden], -1).cpu())
        progress(len(part), sum(len(r["input_ids"]) for r in part))
    lengths = torch.tensor([len(x) for x in ids])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    keep = torch.bfloat16 if dtype == "fp8" else STORE_DTYPES[dtype]  # fp8 applies to aux only
    t = {"input_ids": torch.cat(ids), "loss_mask": torch.cat(masks), "offsets": offsets,
         "last_hidden": torch.cat(last).to(keep)}
    if aux_layers:
        a = torch.cat(aux)
        if dtype == "fp8":
            t["aux"], t["aux_scale"] = _quantize_fp8(a)
        else:
            t["aux"] = a.to(STORE_DTYPES[dtype])
    return t


def _write_manifest(out: Path, manifest: dict) -> None:
    write_text_safe(out / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def cache_header(target, aux_layers: list[int], dtype: str, max_length: int) -> dict:
    """The manifest fields a reader (and a resumed writer) must agree with."""
    return {"format_version": FORMAT_VERSION, "target": target.name_or_path,
            "target_fingerprint": target_fingerprint(target), "num_layers": target.num_layers,
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "aux_layers": list(aux_layers),
            "target_dtype": str(target.dtype).replace("torch.", ""), "dtype": dtype, "max_length": max_length,
            "bytes_per_token": bytes_per_token(target.hidden_size, len(aux_layers), dtype)}


def _reusable(out: Path, name: str, known: dict, a: int, b: int) -> dict | None:
    """The entry of a finished shard (from the manifest or its sidecar) if the file still matches it."""
    side = out / f"{name}.json"
    for s in (known.get(name), json.loads(side.read_text()) if side.is_file() else None):
        if s and s["row_start"] == a and s["rows"] == b - a and (out / name).is_file() \
                and sha256(out / name) == s["sha256"]:
            return s
    return None


def _write_shard(target, out: Path, name: str, split: str, rows, a: int, b: int, lengths: list[int],
                 aux_layers: list[int], dtype: str, batch_size: int, progress=lambda rows, tokens: None) -> dict:
    tensors = _compute_shard(target, [rows[i] for i in range(a, b)], aux_layers, dtype, batch_size, progress)
    path = out / name
    tmp = out / f"{name}.tmp{os.getpid()}"
    with writing(tmp, name=path):  # a failed write (disk full) leaves no half shard; finished ones stay (resume)
        save_file(tensors, str(tmp), metadata={"split": split, "row_start": str(a)})
    os.replace(tmp, path)
    entry = {"file": name, "row_start": a, "rows": b - a, "lengths": lengths[a:b], "tokens": sum(lengths[a:b]),
             "bytes": path.stat().st_size, "sha256": sha256(path)}
    # The sidecar is how another rank (or a resumed run) learns that this shard is finished.
    write_text_safe(out / f"{name}.json", json.dumps(entry))
    return entry


def _collect_entries(out: Path, names: list[str]) -> list[dict]:
    missing = [n for n in names if not (out / f"{n}.json").is_file()]
    if missing:
        raise RuntimeError(f"feature shards {missing[:3]} were not finished by their rank; rerun "
                           "`spectrain prepare-features` with the same launch line (it resumes)")
    return [json.loads((out / f"{n}.json").read_text()) for n in names]


def write_feature_cache(target, splits: dict, out_dir, aux_layers: list[int], dtype: str = "bf16",
                        max_length: int = 0, shard_mb: float = 1024.0, batch_size: int = 8,
                        verbose: bool = True, rank: int = 0, world: int = 1,
                        barrier: Callable[[], None] = lambda: None) -> tuple[dict, dict]:
    """Write (or finish) the cache for ``splits`` = {name: rows with input_ids/loss_mask}.
    Returns (manifest, {"written": n, "skipped": n}) for this rank. Finished shards whose sha256 matches
    are kept. With ``world`` > 1 every rank calls this with the same rows; rank r computes shards
    j = r, r + world, ... and rank 0 writes the manifest once all are done (``barrier`` = the group's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0 and not (out / MARKER).is_file():
        write_marker(out, "features")  # a later run may finish / reuse this cache; nothing else replaces it
    aux_layers = target.validate_aux_layers(aux_layers)
    header = cache_header(target, aux_layers, dtype, max_length)
    mpath = out / "manifest.json"
    old = json.loads(mpath.read_text()) if mpath.is_file() else None
    if old is not None:
        # a field an older cache did not record (target_dtype) is not known, so not compared; a v1 fingerprint still matches
        diff = {k: (old[k], v) for k, v in header.items() if k in old and old[k] != v
                and not (k == "target_fingerprint" and same_target(old[k], target))}
        if diff:
            raise ValueError(f"{out} already holds a feature cache written with other settings "
                             f"(field: (cache, now) = {diff}); choose another training.feature_cache or delete {out}")
    manifest = {**header, "splits": dict(old["splits"]) if old else {}}
    if old is not None and "target_dtype" not in old:
        del manifest["target_dtype"]  # its features came from a target of unknown dtype: stamping ours would mislabel them
    budget = max(1, int(shard_mb * 2**20 / header["bytes_per_token"]))
    stats = {"written": 0, "skipped": 0}
    for split, rows in splits.items():
        lengths = [len(r["input_ids"]) for r in rows]
        dh = data_hash(rows)
        prev = manifest["splits"].get(split)
        segments = _segments(out, split, prev, rows, dh)
        known = {s["file"]: s for s in prev["shards"]} if prev else {}
        entry = {"rows": len(lengths), "tokens": sum(lengths), "data_hash": dh, "shards": [], "complete": False}
        if len(segments) > 1:
            entry["segments"] = segments
        manifest["splits"][split] = entry
        bounds = _segment_bounds(lengths, budget, segments)
        names = [f"{split}-{j:05d}.safetensors" for j in range(len(bounds))]
        mine = range(rank, len(bounds), world)

        who = f" (rank 0 of {world}, every {world}th shard)" if world > 1 else ""
        bar = Progress(sum(sum(lengths[a:b]) for a, b in (bounds[j] for j in mine)), "tok", f"features {split}{who}",
                       enabled=verbose and rank == 0, total_rows=sum(bounds[j][1] - bounds[j][0] for j in mine))
        for j in mine:
            a, b = bounds[j]
            s = _reusable(out, names[j], known, a, b)
            stats["skipped" if s else "written"] += 1
            if s is None:
                s = _write_shard(target, out, names[j], split, rows, a, b, lengths, aux_layers, dtype, batch_size,
                                 bar.advance)
            else:
                bar.advance(b - a, sum(lengths[a:b]))
            entry["shards"].append(s)
            if world == 1:
                _write_manifest(out, manifest)  # after every shard: an interrupted run resumes from here
        bar.close()
        barrier()
        entry["shards"], entry["complete"] = _collect_entries(out, names), True
        if rank == 0:
            _write_manifest(out, manifest)
        barrier()
    return manifest, stats


def aux_layers_for(recipe, target) -> list[int]:
    """The aux layers the recipe's drafter needs, as its family's record says ([] for families that only use
    the last hidden state)."""
    return list(registry.feature_spec(recipe.drafter.kind, recipe, target).aux_layers)


def _require_cache_disk(out: str, splits: dict, per_token: int, verbose: bool) -> None:
    """Say what the cache will take and refuse to start when its disk cannot hold it (shards already
    written by an interrupted run count as done)."""
    tokens = sum(len(r["input_ids"]) for rows in splits.values() for r in rows)
    done = sum(f.stat().st_size for f in Path(out).glob("*.safetensors")) if Path(out).is_dir() else 0
    need = max(0, tokens * per_token - done)
    if verbose:
        print(f"features: {tokens} tokens x {per_token} bytes/token = {tokens * per_token / 2**30:.2f} GiB to {out} "
              f"({done / 2**30:.2f} GiB already there, {free_bytes(out) / 2**30:.1f} GiB free)", flush=True)
    require_disk(out, need, "the feature cache", "point training.feature_cache at a larger disk, lower "
                 "data.max_rows, or use features.dtype=fp8 (5H + 9 bytes per token instead of 8H + 5)")


def _process_group():
    """(rank, world, device, barrier) from the launcher's environment (torchrun / accelerate launch)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None, lambda: None

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as Accelerator reads it
    if state.num_processes != world:
        raise ValueError(f"the launcher started {world} processes (WORLD_SIZE) but they formed a group of "
                         f"{state.num_processes}; on CPU set ACCELERATE_USE_CPU=1")
    return state.process_index, world, state.device, state.wait_for_everyone


def main(recipe_path: str, overrides: list[str]) -> int:
    """`spectrain prepare-features RECIPE [features.dtype=bf16|fp32|fp8] [features.shard_mb=N] [overrides]`.
    One process (optionally with target.device_map to spread a large target over the GPUs), or N ranks
    under torchrun / accelerate launch, each computing every N-th shard on its own device."""
    recipe = load_recipe(recipe_path, overrides)  # features.dtype / shard_mb / batch_size are recipe keys
    opts = dataclasses.asdict(recipe.features)
    out = recipe.training.feature_cache
    if not out:
        raise ValueError("training.feature_cache is empty: set the cache directory, e.g. "
                         "training.feature_cache=.cache/features/tiny-eagle3")
    check_placement(out, "features", [("target", recipe.target.name_or_path),
                                      *(("data file", f) for f in recipe.data.train_files)],
                    option="training.feature_cache")
    rank, world, device, barrier = _process_group()
    if world > 1 and recipe.target.device_map:
        raise ValueError(f"target.device_map={recipe.target.device_map!r} spreads one target over all visible "
                         f"GPUs, but {world} ranks were launched: use one process with device_map, or ranks "
                         "without it (each rank then holds a full target copy)")
    target = load_target(recipe.target.name_or_path, gguf_file=recipe.target.gguf_file, dtype=recipe.target.dtype,
                         device=device,
                         device_map=recipe.target.device_map or None,
                         trust_remote_code=recipe.target.trust_remote_code)
    splits = {}
    for split in SPLITS if recipe.data.heldout_fraction > 0 else SPLITS[:1]:
        if rank > 0:
            barrier()  # rank 0 tokenises first and fills the data cache; the others then read it
        splits[split] = build_dataset(recipe.data, target.tokenizer, split, verbose=rank == 0)
        if rank == 0:
            barrier()
    aux = aux_layers_for(recipe, target)
    _require_cache_disk(out, splits, bytes_per_token(target.hidden_size, len(aux), opts["dtype"]), rank == 0)
    manifest, stats = write_feature_cache(target, splits, out, aux, opts["dtype"],
                                          recipe.data.max_length, opts["shard_mb"], opts["batch_size"],
                                          rank=rank, world=world, barrier=barrier)
    total = sum(sh["bytes"] for s in manifest["splits"].values() for sh in s["shards"])
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    if rank == 0:
        print(f"features: {out}: {stats['written']} shards written, {stats['skipped']} already done (rank 0 of "
              f"{world}); {tokens} tokens, {total / 2**20:.1f} MiB ({total / max(tokens, 1):.0f} bytes/token on "
              f"disk, {manifest['bytes_per_token']} nominal, dtype {manifest['dtype']})")
    return 0
