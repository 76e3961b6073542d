"""The distributed side of training: the accelerate ``Accelerator`` (DDP / FSDP / DeepSpeed, CPU or GPU)
and the frozen target placed to match it (one device, an HF device map, or ZeRO-3 partitions)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.cpp_extension import get_default_build_root
from transformers.utils import logging as hf_logging

from spectrain.targets.model import gathered, load_target


def resolve_precision(precision: str) -> str:
    """Recipe precision -> accelerate mixed_precision. auto: bf16 on CUDA with bf16 support, else fp32."""
    cuda = torch.cuda.is_available()
    if precision == "auto":
        return "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"
    if precision == "fp32":
        return "no"
    if precision == "fp16" and not cuda:
        raise ValueError("training.precision=fp16 needs a CUDA device (CPU autocast is bf16 only); "
                         "use precision=fp32 (or auto) on CPU")
    return precision


def check_trackers(recipe) -> list[str]:
    """The recipe's wandb / tensorboard trackers, each installed (also run by `spectrain check`)."""
    trackers = [t for t in recipe.tracking.report_to if t in ("wandb", "tensorboard")]
    for t in trackers:
        if importlib.util.find_spec(t) is None:
            raise ValueError(f"tracking.report_to includes {t} but {t} is not installed: "
                             f"pip install 'spectrain[{t}]' (or drop it from tracking.report_to)")
    return trackers


def resolve_num_threads(requested: int = 0) -> int:
    """torch CPU threads for this process: the recipe's ``training.num_threads``, else
    $SPECTRAIN_NUM_THREADS, else $OMP_NUM_THREADS, else the cores this process may run on (its CPU
    affinity, which containers and `taskset` narrow) split over the ranks on this node. torch's own
    default counts every core of the host, which oversubscribes a shared or multi-rank machine."""
    if requested > 0:
        return requested
    for var in ("SPECTRAIN_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"${var}={value!r}: expected a positive integer number of threads")
            return int(value)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS / Windows: no affinity API
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


# glibc mallopt parameters (malloc.h) and the largest value mallopt accepts (an int).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, MALLOPT_MAX = -1, -3, 2**31 - 1


MALLOC_ENV = "SPECTRAIN_MALLOC"
_malloc_kept = False  # mallopt changes the whole process: this mirrors it for the run's record (run_info.json)


def malloc_setting() -> str:
    """$SPECTRAIN_MALLOC: "keep", or "" (unset or empty: glibc's defaults). Anything else is refused, so that a
    typo ("Keep", "on", "system") never silently runs with the other allocator behaviour."""
    value = os.environ.get(MALLOC_ENV, "").strip()
    if value not in ("", "keep"):
        raise ValueError(f"${MALLOC_ENV}={value!r} is not a known setting: use {MALLOC_ENV}=keep (glibc keeps freed "
                         "memory for reuse, docs/training.md) or leave it unset / empty for glibc's defaults")
    return value


def malloc_in_effect() -> dict:
    """What run_info.json records: the variable as given and whether glibc keeps freed memory in this process."""
    return {MALLOC_ENV: os.environ.get(MALLOC_ENV), "keep_freed_memory": _malloc_kept}


def keep_freed_memory() -> bool:
    """With $SPECTRAIN_MALLOC=keep, make glibc keep freed memory for reuse instead of handing it back to the kernel.
    Its default serves every allocation over 32 MiB with a fresh mmap and unmaps it on free, and a CPU training step
    allocates and frees several vocabulary-wide logit tensors (B x T x V floats, hundreds of MiB): every step then
    page-faults and zeroes them anew, which halved draft-model training speed on a 2-core CPU (docs/training.md).
    Opt-in because the heap fragments over varying sequence lengths: resident memory about doubled, and kept
    growing in a Medusa run (19 GB).
    A no-op off glibc (macOS, musl); returns whether it took effect."""
    global _malloc_kept
    if malloc_setting() != "keep" or sys.platform != "linux":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    _malloc_kept = all(mallopt(opt, ctypes.c_int(MALLOPT_MAX)) == 1 for opt in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    return _malloc_kept


# A real JIT build of DeepSpeed's CPU ops takes seconds to a minute or two; a lock this old was left by a killed build.
STALE_BUILD_LOCK_S = 600


def refuse_stale_build_locks(now: float | None = None) -> None:
    """DeepSpeed JIT-compiles C++ ops (on CPU, its shared-memory allreduce) under torch's extensions dir, one
    rank building while the others wait for the build's ``lock`` file to vanish. A build killed mid-way leaves
    that file behind and every later run waits on it forever without a word: name it instead."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time() if now is None else now
    stale = [lock for lock in root.glob("*/*/lock") if now - _mtime(lock) > STALE_BUILD_LOCK_S]
    if stale:
        raise RuntimeError(f"{len(stale)} stale build lock(s) under {root} ({', '.join(map(str, stale))}), left by a "
                           "C++ extension build that was killed mid-way; DeepSpeed would wait on them forever. "
                           "Delete them (no other build is running) and launch again")


def _mtime(path: Path) -> float:
    """When a lock was made (the link's own time, never its target's); a lock gone since the glob belongs to a
    build that just finished, so it counts as made now and later."""
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return float("inf")


def make_accelerator(recipe):
    # From the launcher's environment: building PartialState here would freeze its device choice
    # before Accelerator reads ACCELERATE_USE_CPU.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trackers = check_trackers(recipe)
    handlers = []
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        refuse_stale_build_locks()  # before Accelerator(): its DeepSpeed setup JIT-builds ops
        if not torch.cuda.is_available():
            # DeepSpeed's CPU accelerator forms a gloo group, but accelerate finds no device backend and
            # would report world size 1 unless told the backend.
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
    acc = Accelerator(
        kwargs_handlers=handlers,
        mixed_precision=resolve_precision(recipe.training.precision),
        gradient_accumulation_steps=recipe.training.grad_accum(world),
        log_with=trackers or None,
        project_dir=recipe.output_dir,
        step_scheduler_with_optimizer=False,  # the schedule is per optimizer step; we step it ourselves
    )
    if acc.num_processes != world:
        # e.g. torchrun on a CPU machine without ACCELERATE_USE_CPU=1: every process would believe it is
        # alone, train on all the data and overwrite the others' checkpoints.
        raise ValueError(f"the launcher started {world} processes (WORLD_SIZE) but accelerate formed a group of "
                         f"{acc.num_processes} ({acc.distributed_type}); on CPU set ACCELERATE_USE_CPU=1, or "
                         "launch with a matching recipes/accelerate config")
    _fill_deepspeed_config(acc, recipe.training)
    if not acc.is_main_process:
        hf_logging.disable_progress_bar()  # one "Loading weights" bar per run, not one per rank
    return acc


def _fill_deepspeed_config(acc, t) -> None:
    """DeepSpeed reads batch sizes and clipping from its own config; fill its "auto" values from the recipe
    (the loop has no DataLoader for accelerate to infer them from) and refuse contradicting ones."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    cfg = plugin.deepspeed_config
    want = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps":
            acc.gradient_accumulation_steps, "train_batch_size": t.global_batch_size}
    for key, value in want.items():
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value
        elif int(cfg[key]) != value:
            raise ValueError(f"the DeepSpeed config sets {key}={cfg[key]} but the recipe implies {value} "
                             f"(global_batch_size={t.global_batch_size}, micro_batch_size={t.micro_batch_size}, "
                             f"{acc.num_processes} processes); set it to \"auto\" in the DeepSpeed config")
    if cfg.get("gradient_clipping", "auto") == "auto":
        cfg["gradient_clipping"] = t.grad_clip


def zero3(acc) -> bool:
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def load_target_for(recipe, acc):
    tc = recipe.target
    if tc.device_map and acc.num_processes > 1:
        raise ValueError(f"target.device_map={tc.device_map!r} spreads one target over every visible GPU, but "
                         f"{acc.num_processes} processes were launched: train from offline features "
                         "(`spectrain prepare-features` with device_map, then training.features=offline) or "
                         "shard the target with ZeRO-3 (recipes/accelerate/zero3.yaml)")
    return load_target(tc.name_or_path, gguf_file=tc.gguf_file, dtype=tc.dtype, device=None if tc.device_map else acc.device,
                       device_map=tc.device_map or None, trust_remote_code=tc.trust_remote_code)


def shard_target(target) -> None:
    """ZeRO-3: the frozen target becomes a DeepSpeed inference engine, so each rank keeps 1/N of its weights
    and every layer is gathered on the fly (its hooks fire on target.model's own submodules, so FrozenTarget's
    forward, feature taps, embed() and logits_from_last_hidden() work unchanged). No optimizer: not trained."""
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=target.model, config=cfg)
    target.zero3_engine = engine  # keep it alive: it owns the gather hooks


def shard_target_fsdp(target, device_type: str) -> None:
    """FSDP: shard the frozen target with FSDP2 as well, one unit per decoder layer plus the embeddings,
    final norm and lm_head (tied ones in one unit), so each rank keeps 1/N of it and FrozenTarget's
    direct calls (embed, norm + lm_head) gather exactly the weights they use. No optimizer sees it."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in target.layers:
        fully_shard(layer, mesh=mesh)
    tied = target.lm_head.weight is target.embed_tokens.weight
    fully_shard([target.embed_tokens, target.lm_head] if tied else target.embed_tokens, mesh=mesh)
    if not tied:
        fully_shard(target.lm_head, mesh=mesh)
    fully_shard(target.norm, mesh=mesh)
    fully_shard(target.model, mesh=mesh)  # whatever is left (e.g. extra norms of some architectures)



def is_sharded(module: torch.nn.Module) -> bool:
    """True when ZeRO-3 (ds_shape) or FSDP2 (DTensor) holds only a shard of the module's weights here."""
    return any(hasattr(p, "ds_shape") or hasattr(p, "full_tensor") for p in module.parameters())


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's complete weights on the CPU, gathered from ZeRO-3 / FSDP2 shards (collective: every
    rank calls it and gets the whole dict; drafters are small enough for that)."""
    with gathered(module.parameters()):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                for k, v in module.state_dict().items()}
