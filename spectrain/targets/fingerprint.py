"""The identity of a target: which model every drafter, checkpoint and feature cache was trained against.

v2 hashes the config and every parameter (bf16-rounded, by name), plus the GGUF file and quantization a
dequantized target came from. A local target's value is cached by its files' inode, size, mtime and ctime:
an edit that restores size and mtime still changes the ctime (which no user can set back), and a file
changed within the last RACY_NS, or on a filesystem that keeps no ctime, is not cached (a second change
within the timestamp's resolution could keep it), so it is hashed in full again. v1 (older spectrain)
hashed a few rows and is still compared when a recorded value is v1.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from spectrain.io.cache import cache_root
from spectrain.io.integrity import WEIGHT_SUFFIXES
from spectrain.io.outputs import write_text_safe
from spectrain.targets.gguf import untrusted_file
from spectrain.targets.model import gathered

RACY_NS = 2_000_000_000  # a file changed this recently (or later) is not cached: timestamps have a resolution
FINGERPRINT_PREFIX = "v2-"  # v2: every parameter + the config; older checkpoints / caches hold a v1 value
_VOLATILE_CONFIG = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation_autoset",
                    "use_cache", "_commit_hash", "attn_implementation", "_attn_implementation"}


def legacy_fingerprint(target, with_gguf: bool = False) -> str:
    """v1 (older spectrain): shapes + final norm + the first 64 rows of lm_head and embeddings, bf16-rounded.
    From the first GGUF release on, v1 also hashed the GGUF file and quantization (``with_gguf``)."""
    h = hashlib.sha256(json.dumps([target.num_layers, target.hidden_size, target.vocab_size]).encode())
    if with_gguf:
        h.update(_gguf_blob(target))
    weights = (target.norm.weight, target.lm_head.weight, target.embed_tokens.weight)
    with gathered(weights):  # ZeRO-3 keeps only a slice of each weight on a rank
        full = [w.full_tensor() if hasattr(w, "full_tensor") else w for w in weights]
        for w in (full[0], full[1][:64], full[2][:64]):
            h.update(w.detach().to(torch.bfloat16).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def _config_blob(target) -> bytes:
    cfg = target.config.to_dict() if hasattr(target.config, "to_dict") else dict(vars(target.config))
    cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG}
    return json.dumps(cfg, sort_keys=True, default=str).encode()


def _sharded(model) -> bool:
    return any(hasattr(p, "ds_shape") or hasattr(p, "full_tensor") for p in model.parameters())


def _cache_key(target) -> tuple[Path, dict] | None:
    """Where a local target's fingerprint is cached (the user's cache dir, never the model's own directory),
    and the inode, size, mtime and ctime of its weight and JSON files that must still match. None: not a
    local directory."""
    root = Path(str(getattr(target, "load_path", None) or target.name_or_path)).expanduser()  # a GGUF's copy
    if not root.is_dir():
        return None
    files = {}
    for f in sorted(root.iterdir()):
        if f.is_file() and f.suffix in (*WEIGHT_SUFFIXES, ".json"):
            st = f.stat()  # follows a link (an HF cache snapshot links into blobs/), which is recorded too
            files[f.name] = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] + \
                ([os.readlink(f)] if f.is_symlink() else [])
    base = cache_root() / "fingerprints"
    name = str(root.resolve()) + _gguf_blob(target).decode()
    return base / (hashlib.sha256(name.encode()).hexdigest()[:24] + ".json"), files


def _stats_trusted(files: dict, now_ns: int) -> bool:
    """The stats can stand for the content: every ctime is set and older than RACY_NS."""
    ctimes = [v[3] for v in files.values()]
    return all(ctimes) and now_ns - max(ctimes, default=0) >= RACY_NS


def _cached_value(record: Path, files: dict) -> str | None:
    """The recorded fingerprint when the record is the user's own and the files' stats still match."""
    try:
        if untrusted_file(record, record.lstat()):
            return None  # another user could have written it
        rec = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    fp = rec.get("fingerprint") if isinstance(rec, dict) else None
    ok = rec.get("files") == json.loads(json.dumps(files)) and str(fp or "").startswith(FINGERPRINT_PREFIX)
    return fp if ok else None


def _gguf_blob(target) -> bytes:
    """A dequantized GGUF target: which file and quantization its weights came from (part of its identity)."""
    gguf = getattr(target, "gguf", None)
    return json.dumps([gguf["gguf_sha256"], gguf["quant_type"]]).encode() if gguf else b""


def _stream_hash(target) -> str:
    """sha256 over the config and every parameter (by name, bf16-rounded: stable across load dtypes), one
    tensor at a time (a ZeRO-3 / FSDP shard is gathered for its turn only)."""
    h = hashlib.sha256(_config_blob(target) + _gguf_blob(target))
    for name, p in target.model.named_parameters(remove_duplicate=False):
        with gathered([p]):
            w = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(name.encode() + json.dumps(list(w.shape)).encode())
            h.update(w.detach().to(torch.bfloat16).view(torch.int16).cpu().contiguous().numpy().tobytes())
    return FINGERPRINT_PREFIX + h.hexdigest()[:32]


def target_fingerprint(target) -> str:
    """Identity of a target: its config and every parameter (v2). A local target's value is cached by its
    files' inode, size, mtime and ctime, so a new target costs one pass over its weights and a known one
    costs nothing."""
    cached = getattr(target, "_spectrain_fingerprint", None)
    if cached:
        return cached
    key = None if _sharded(target.model) else _cache_key(target)  # sharded: every rank computes (collectives)
    stat_time = time.time_ns()
    if key is not None and (fp := _cached_value(*key)):
        target._spectrain_fingerprint = fp
        return fp
    fp = _stream_hash(target)
    if key is not None and _stats_trusted(key[1], stat_time):
        try:
            key[0].parent.mkdir(parents=True, exist_ok=True)
            write_text_safe(key[0], json.dumps({"target": str(target.name_or_path), "files": key[1], "fingerprint": fp}))
            os.chmod(key[0], 0o600)  # whatever the umask: a record others can write is ignored
        except OSError:
            pass  # a read-only cache dir: the value is recomputed next time
    try:
        target._spectrain_fingerprint = fp
    except AttributeError:
        pass
    return fp


def same_target(recorded: str | None, target) -> bool | None:
    """Does a recorded fingerprint name this target? None when nothing was recorded. A v1 value (older
    spectrain) is compared with the v1 fingerprint, so older checkpoints and caches keep working."""
    if not recorded:
        return None
    if str(recorded).startswith(FINGERPRINT_PREFIX):
        return recorded == target_fingerprint(target)
    variants = (False, True) if getattr(target, "gguf", None) else (False,)
    return any(recorded == legacy_fingerprint(target, g) for g in variants)
