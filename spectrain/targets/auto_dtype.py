"""`dtype: auto` on a CPU: bf16 where the CPU computes it natively AND a measured verify pass is cheaper.

    choice = auto_cpu_dtype(model, key="assets/reference-target", verify_tokens=6)
    choice.dtype, choice.reason   # torch.float32, "fp32: CPU lacks native bf16 (no avx512_bf16/amx_bf16)"

Without native bf16 (x86 ``avx512_bf16`` / ``amx_bf16``, aarch64 ``bf16`` in /proc/cpuinfo) bf16 matmuls are
emulated and slow: fp32, nothing measured. With it, whether bf16 pays depends on the target and the machine
(an overhead-bound HF forward can cost about the same in both), so one target pass over t = 1 and t = k + 1
new tokens (200 cached) is timed in both dtypes after a warm-up, and bf16 is chosen only when the verify pass
(t = k + 1, what every speculative step pays) is at least ``MIN_GAIN`` cheaper. The decision is cached per
target + machine + torch + threads under ``$SPECTRAIN_CACHE_DIR/auto_dtype.json``, so it is measured once.
``decide`` and ``native_bf16_flags`` are pure: tests inject flags and timings, never real timing.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from spectrain.io.cache import cache_root

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 BF16 / AMX; aarch64 FEAT_BF16
MIN_GAIN = 0.10  # bf16 rounds the target's activations: only worth it for a clear verify-time gain
CONTEXT, REPEATS = 200, 5


@dataclass
class DtypeChoice:
    """What `auto` (or the user) picked and why; written into eval reports."""

    dtype: str  # "float32" | "bfloat16" | "float16"
    reason: str
    flags: list[str] = field(default_factory=list)
    seconds: dict | None = None  # {"float32": {t: s}, "bfloat16": {t: s}} when measured

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_dict(self) -> dict:
        return asdict(self)


def native_bf16_flags(cpuinfo: str) -> list[str]:
    """The native-bf16 feature flags in /proc/cpuinfo text (x86 ``flags``, aarch64 ``Features``)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            present = set(value.split())
            return [f for f in NATIVE_BF16_FLAGS if f in present]
    return []


def decide(flags: list[str], seconds: dict | None, verify_tokens: int) -> DtypeChoice:
    """Pure: fp32 without native bf16; else bf16 iff its verify pass over `verify_tokens` is MIN_GAIN cheaper."""
    if not flags:
        return DtypeChoice("float32", "fp32: CPU lacks native bf16 (no avx512_bf16/amx_bf16 in /proc/cpuinfo)")
    f32, b16, t = seconds["float32"], seconds["bfloat16"], verify_tokens
    ratio = b16[t] / f32[t]
    detail = (f"{flags[0]} present; one verify pass over t={t} tokens: bf16 {b16[t] * 1e3:.1f} ms "
              f"({b16[t] / b16[1]:.2f}x its t=1) vs fp32 {f32[t] * 1e3:.1f} ms ({f32[t] / f32[1]:.2f}x its t=1); "
              f"t=1: bf16 {b16[1] * 1e3:.1f} vs fp32 {f32[1] * 1e3:.1f} ms")
    if ratio <= 1 - MIN_GAIN:
        return DtypeChoice("bfloat16", f"bf16: {detail}", flags, seconds)
    return DtypeChoice("float32", f"fp32: bf16 verify not {MIN_GAIN:.0%} cheaper ({ratio:.2f}x fp32); {detail}",
                       flags, seconds)


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags known, so fp32 (the safe choice)
        return ""


def auto_cpu_dtype(model, wrap, key: str, verify_tokens: int = 6, cpuinfo: str | None = None) -> DtypeChoice:
    """Resolve `auto` for an fp32-loaded CPU `model`: flags, then the cache, else measured (module doc).
    `wrap` makes the verifier (FrozenTarget) so the timed pass is the one decoding runs, fp32 head included."""
    flags = native_bf16_flags(read_cpuinfo() if cpuinfo is None else cpuinfo)
    if not flags:
        return decide(flags, None, verify_tokens)
    ckey = _cache_key(key, flags, verify_tokens)
    cached = _load_cache().get(ckey)
    if cached:
        return DtypeChoice(**cached)
    choice = decide(flags, measure_dtypes(model, wrap, (1, verify_tokens)), verify_tokens)
    _store(ckey, choice)
    return choice


@torch.no_grad()
def measure_dtypes(model, wrap, tokens: tuple[int, ...]) -> dict[str, dict[int, float]]:
    """Median seconds of one pass over t new tokens (CONTEXT cached) in fp32 and in a bf16 copy of `model`."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the fp32 weights stay untouched for an fp32 choice
    window = getattr(model.config, "max_position_embeddings", None) or CONTEXT + max(tokens)
    ctx = max(1, min(CONTEXT, window - max(tokens)))  # a short-context target still fits the timed pass
    return {name: verify_pass_seconds(wrap(m), tokens, context=ctx) for name, m in (("float32", model), ("bfloat16", bf16))}


@torch.no_grad()
def verify_pass_seconds(target, tokens=(1, 6), batch: int = 1, context: int = CONTEXT, repeats: int = REPEATS,
                        seed: int = 0) -> dict[int, float]:
    """Median seconds of one target pass over t new tokens per row (B rows, `context` cached), through the
    forward decoding verifies with; the eval's cost curve (spectrain/eval/cost_curve.py) is this too."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (batch, context + max(tokens)), generator=g).to(target.device)
    cache = DynamicCache()
    target.forward(ids[:, :context], cache=cache, use_cache=True, want_logits=False)
    out: dict[int, list[float]] = {t: [] for t in tokens}
    for r in range(repeats + 1):  # round 0 warms kernels and the allocator; interleaved so load hits all t alike
        for t in tokens:
            extra = cache.get_seq_length() - context
            if extra:
                cache.crop(-extra)  # transformers' crop takes a positive length no more: drop the last `extra`
            start = time.perf_counter()
            target.forward(ids[:, context:context + t], cache=cache, use_cache=True)
            if r:
                out[t].append(time.perf_counter() - start)
    return {t: statistics.median(v) for t, v in out.items()}


def _cache_key(key: str, flags: list[str], verify_tokens: int) -> str:
    machine = (platform.processor() or platform.machine(), _cpu_model(), flags, torch.__version__,
               torch.get_num_threads(), verify_tokens)
    return hashlib.sha256(json.dumps([str(key), *map(str, machine)]).encode()).hexdigest()[:24]


def _cpu_model() -> str:
    for line in read_cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def _cache_file() -> Path:
    return cache_root() / "auto_dtype.json"


def _load_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _store(ckey: str, choice: DtypeChoice) -> None:
    """Atomic (write + rename): two ranks measuring at once leave one valid file."""
    data = _load_cache()
    data[ckey] = json.loads(json.dumps(choice.to_dict()))  # int keys -> str, as they read back
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
