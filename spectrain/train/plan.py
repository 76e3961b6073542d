"""A cost plan before any compute: `spectrain check RECIPE --plan 8xH100 [--mfu 0.17]`.

Every number here is an **estimate** from the recipe, the target's config, the data's row count and the
mean tokenised length of a sample, by the formulas printed next to it:

- model FLOPs per trained token, the convention of scripts/gpu_check.py (PaLM appendix B; s = tokens per
  row, L / H = layers / hidden size, P = weights of the Linear layers that run):
  target forward 2 * P_target_layers + 4 * L * H * s (online features only: offline, prepare-features
  pays it once) + teacher logits 2 * H * V; the drafter's, from its family's ``train.cost`` hook (in the
  family's own module; spectrain/drafters/costs.py holds the shapes they share): EAGLE-3 fc 6 * P_fc + K TTT
  steps x (6 * P_layer+lm_head + 12 * L_d * H * s); Medusa 6 * P_heads; a draft LM 6 * P_student + 12 * L_s *
  H_s * s.
- wall time = tokens x FLOPs/token / (GPUs x peak bf16 FLOP/s x MFU); GPU-hours = GPUs x wall time.
- memory per GPU, feature-cache and checkpoint sizes: the arithmetic of recipes/README.md.

The default MFU 0.17 is **calibrated on one measurement**: scripts/gpu_check.py on one H200 trained an
EAGLE-3 head on a synthetic 1.24B Llama target (micro 4 x 2048 tokens, TTT 7) at 19,376 tokens/s = 17.1%
of 989 TFLOP/s by this same formula (docs/gpu_check_h200.md). Larger targets usually reach a higher MFU,
so the estimate errs long; ``--mfu`` replaces it. GPU peaks are the vendors' dense (no sparsity) bf16
datasheet figures. The disk checks prepare-features and train run are in spectrain/io/disk.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from spectrain import registry
from spectrain.data.chat import is_heldout, load_conversations, tokenize_conversations
from spectrain.data.features import bytes_per_token
from spectrain.drafters.costs import Shape, TrainingCost
from spectrain.io.disk import free_bytes, gib, require_disk

DEFAULT_MFU = 0.17  # measured once: see the module doc
MIN_MFU = 1e-3  # below 0.1 % of peak no GPU run is meant: a typo (1e-300) would print a 300-digit wall time
# name: (dense bf16 TFLOP/s, memory GiB, source)
GPUS: dict[str, tuple[float, float, str]] = {
    "H100": (989.0, 80, "NVIDIA H100 SXM5 datasheet: 989 TFLOPS bf16 dense, 80 GB HBM3"),
    "H200": (989.0, 141, "NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 141 GB HBM3e"),
    "A100": (312.0, 80, "NVIDIA A100 SXM datasheet: 312 TFLOPS bf16 dense, 80 GB HBM2e (a 40 GB model exists)"),
    "L40S": (362.0, 48, "NVIDIA L40S datasheet: 362 TFLOPS bf16 dense, 48 GB GDDR6"),
}
GiB = 2**30


@dataclass
class Hardware:
    gpus: int
    name: str
    peak_flops: float  # per GPU, FLOP/s
    memory: float  # per GPU, bytes


def parse_hardware(text: str) -> Hardware:
    """'8xH100' / '4xA100' / 'H200' (one GPU) -> Hardware."""
    m = re.fullmatch(r"(?:(\d+)\s*[xX*]\s*)?([A-Za-z0-9]+)", text.strip())
    name = m.group(2).upper() if m else ""
    if not m or name not in GPUS or (m.group(1) is not None and int(m.group(1)) < 1):
        raise ValueError(f"--plan {text!r}: give GPUsxNAME, e.g. 8xH100; known GPUs: {', '.join(GPUS)}")
    tflops, mem, _ = GPUS[name]
    return Hardware(int(m.group(1) or 1), name, tflops * 1e12, mem * GiB)


def check_mfu(mfu: float) -> float:
    """--mfu as a fraction of peak in [MIN_MFU, 1] (nan, <= 0, > 1 and absurdly small values refused)."""
    if not MIN_MFU <= mfu <= 1:  # also false for nan
        raise ValueError(f"--mfu {mfu}: give the model FLOPs utilisation as a fraction in [{MIN_MFU:g}, 1], e.g. "
                         f"0.3 (default {DEFAULT_MFU})")
    return mfu


def batch_split_problem(global_batch: int, micro: int, gpus: int) -> str:
    """Why `global_batch` rows per step cannot be split over `gpus` GPUs of `micro` rows, and the fix."""
    per = micro * gpus
    up = -(-global_batch // per) * per
    micros = [m for m in range(micro - 1, 0, -1) if global_batch % (m * gpus) == 0]
    alt = f", or training.micro_batch_size={micros[0]}" if micros else ""
    return (f"global batch {global_batch} cannot be split over {gpus} GPUs x micro {micro} = {per} rows per "
            f"micro-step: set training.global_batch_size={up} (a multiple of {per}){alt}")


def gpu_from_device_name(device_name: str) -> str | None:
    """The table's name for a CUDA device name such as 'NVIDIA H100 80GB HBM3', or None."""
    return next((n for n in GPUS if n in device_name.upper()), None)


def training_cost(recipe, t: Shape, student=None, seq: float = 0.0) -> TrainingCost:
    """The drafter's size, its training FLOPs per token (`seq` = tokens per row, for attention) and memory:
    the family's ``train.cost`` hook (spectrain/registry.py). A family without one has no plan: costing it with
    another family's formula would print wrong numbers with confidence."""
    cost = registry.hook(recipe.drafter.kind, "train.cost")
    if cost is None:
        raise ValueError(f"drafter.kind={recipe.drafter.kind}: the family declares no training cost (its "
                         "registry record's `train.cost` hook), so there is no plan for it")
    return cost(recipe, t, student, seq)


# ---- disk --------------------------------------------------------------------------------------------


def checkpoint_bytes(params: int, trained: int) -> tuple[float, float]:
    """(one weights dir: fp32 save_pretrained, one resumable step-N/: weights + accelerate's state with the
    fp32 model and two Adam moments of the trained weights)."""
    weights = 4.0 * params
    return weights, 2 * weights + 8.0 * trained


def train_disk_bytes(params: int, trained: int, keep: int) -> float:
    """init/, best/ and last/ weights plus keep + 1 step-N/ (a new one is written before the oldest goes)."""
    weights, step = checkpoint_bytes(params, trained)
    return 3 * weights + (keep + 1) * step


def require_train_disk(output_dir: str | Path, params: int, trained: int, keep: int) -> None:
    """`train` refuses to start when its checkpoints cannot fit (what a resumed run already wrote counts)."""
    out = Path(output_dir)
    have = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else 0
    require_disk(out, max(0.0, train_disk_bytes(params, trained, keep) - have), "training's checkpoints",
                 "choose an output_dir on a larger disk or lower training.keep_checkpoints")


# ---- the plan --------------------------------------------------------------------------------------------


@dataclass
class DataSize:
    train_rows: int
    heldout_rows: int
    mean_tokens: float  # per row, after the chat template and data.max_length


def memory_per_gpu(recipe, t: Shape, d: TrainingCost, gpus: int) -> dict[str, float]:
    """Estimated bytes per GPU under each distributed backend (recipes/README.md, "The arithmetic")."""
    b, s = recipe.training.micro_batch_size, recipe.data.max_length
    act = b * s * (d.logits_bytes + d.act_bytes + 4 * t.hidden * 2)
    target, frozen = 2.0 * t.params(), d.params - d.trained
    return {"ddp": target + 16.0 * d.trained + 4 * frozen + act,
            "zero2": target + (2 + 14 / gpus) * d.trained + 2 * frozen + act,
            "zero3": target / gpus + 16.0 * d.params / gpus + act}


def target_forward(t: Shape, seq: float) -> float:
    """FLOPs per token of the target's decoder layers (the lm_head is the teacher logits' part)."""
    return 2 * t.layers * t.layer() + 4 * t.layers * t.hidden * seq


@dataclass
class Estimate:
    shape: Shape
    drafter: TrainingCost
    steps: int
    tokens: float  # trained tokens over the whole run
    teacher_flops: float  # per token
    flops_per_token: float
    wall_s: float


def estimate(recipe, cfg, data: DataSize, hw: Hardware, mfu: float = DEFAULT_MFU, student_cfg=None) -> Estimate:
    """Steps, tokens, FLOPs and wall time of a run (the formulas of the module doc)."""
    tr, t = recipe.training, Shape.of(cfg)
    d = training_cost(recipe, t, Shape.of(student_cfg) if student_cfg is not None else None, data.mean_tokens)
    steps = tr.max_steps if tr.max_steps > 0 else tr.epochs * (data.train_rows // tr.global_batch_size)
    tokens = steps * tr.global_batch_size * data.mean_tokens
    teacher = 2 * t.vocab * t.hidden + (0 if tr.features == "offline" else target_forward(t, data.mean_tokens))
    flops = teacher + d.train_flops
    return Estimate(t, d, steps, tokens, teacher, flops, tokens * flops / (hw.gpus * hw.peak_flops * mfu))


def plan_lines(recipe, cfg, data: DataSize, hw: Hardware, mfu: float = DEFAULT_MFU, student_cfg=None
               ) -> tuple[list[str], list[str]]:
    """(lines to print, problems that must stop the run: a cache or checkpoints that do not fit the disk)."""
    tr = recipe.training
    est = estimate(recipe, cfg, data, hw, mfu, student_cfg)
    t, d, offline = est.shape, est.drafter, tr.features == "offline"
    rate = hw.gpus * hw.peak_flops * mfu
    cache_tokens = (data.train_rows + data.heldout_rows) * data.mean_tokens
    bpt = bytes_per_token(t.hidden, d.n_aux, recipe.features.dtype)
    cache, feat_wall = cache_tokens * bpt, cache_tokens * target_forward(t, data.mean_tokens) / rate
    where = tr.feature_cache or recipe.data.cache_dir
    free_cache, free_out = free_bytes(where), free_bytes(recipe.output_dir)
    weights, step = checkpoint_bytes(d.params, d.trained)
    ckpt_need = train_disk_bytes(d.params, d.trained, tr.keep_checkpoints)
    accum = tr.global_batch_size / (tr.micro_batch_size * hw.gpus)
    mem = memory_per_gpu(recipe, t, d, hw.gpus)
    how = "training.max_steps" if tr.max_steps > 0 else \
        f"{tr.epochs} epochs x ({data.train_rows} rows // global batch {tr.global_batch_size})"
    lines = [
        f"plan for {hw.gpus}x{hw.name} ({hw.peak_flops / 1e12:.0f} TFLOP/s bf16 dense and {hw.memory / GiB:.0f} GiB "
        f"each: {GPUS[hw.name][2]}); ESTIMATES, not measurements",
        f"  data: {data.train_rows} train + {data.heldout_rows} held-out rows, mean {data.mean_tokens:.0f} tokens/row "
        f"(a tokenised sample, max_length {recipe.data.max_length})",
        f"  steps: {est.steps} optimizer steps = {how}; "
        + (f"grad accumulation {accum:g} (micro {tr.micro_batch_size} x {hw.gpus} GPUs)" if accum == int(accum)
           else f"global batch {tr.global_batch_size} is not divisible by micro {tr.micro_batch_size} x {hw.gpus}"),
        f"  tokens trained: {est.tokens / 1e6:.1f} M; FLOPs/token {_g(est.flops_per_token)} = "
        f"{'teacher logits 2*H*V' if offline else 'target forward + teacher logits'} {_g(est.teacher_flops)} + "
        f"drafter fwd/bwd {_g(d.train_flops)} ({d.params / 1e6:.1f} M params, {d.trained / 1e6:.1f} M trained)",
        f"  wall time ~{_hours(est.wall_s)}, {hw.gpus * est.wall_s / 3600:.1f} GPU-hours = tokens x FLOPs/token / "
        f"({hw.gpus} x {hw.peak_flops / 1e12:.0f} TFLOP/s x MFU {mfu:.2f}" + (
            ", measured once on one H200: spectrain/train/plan.py)" if mfu == DEFAULT_MFU else ", --mfu)"),
        f"  feature cache ({'used: training.features=offline' if offline else 'only if training.features=offline'}): "
        f"~{gib(cache)} ({recipe.features.dtype}, {bpt} B/token), {gib(free_cache)} free at "
        f"{where}; prepare-features ~{_hours(feat_wall)} (the target forward per token)",
        f"  checkpoints: {gib(weights)} per weights dir, {gib(step)} per resumable step-N/; "
        f"~{gib(ckpt_need)} in all (keep_checkpoints {tr.keep_checkpoints}), {gib(free_out)} free "
        f"at {recipe.output_dir}",
        "  memory per GPU: " + ", ".join(f"{k} ~{gib(v)}" for k, v in mem.items())
        + f" of {hw.memory / GiB:.0f} (micro {tr.micro_batch_size} x {recipe.data.max_length} tokens)",
    ]
    problems = [] if accum == int(accum) else [batch_split_problem(tr.global_batch_size, tr.micro_batch_size,
                                                                     hw.gpus)]  # train would refuse it
    if offline and cache > free_cache and not (Path(where) / "manifest.json").is_file():
        problems.append(f"the feature cache needs ~{cache / GiB:.1f} GiB but {where} has {free_cache / GiB:.1f} GiB "
                        "free: point training.feature_cache at a larger disk, lower data.max_rows or use "
                        "features.dtype=fp8")
    if ckpt_need > free_out:
        problems.append(f"checkpoints need ~{ckpt_need / GiB:.1f} GiB but {recipe.output_dir} has "
                        f"{free_out / GiB:.1f} GiB free: choose another output_dir or lower training.keep_checkpoints")
    if min(mem.values()) > hw.memory:
        problems.append(f"no distributed backend fits {hw.memory / GiB:.0f} GiB per GPU: halve training.micro_batch_size "
                        "(the global batch stays) or lower data.max_length")
    return lines, problems


def _hours(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "n/a"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 else \
        f"{seconds:.0f} s"


def _g(flops: float) -> str:
    return f"{flops / 1e9:.3g} G"


def data_size(recipe, tok, sample: int = 256) -> DataSize:
    """Row counts of both splits (the real id-hash split) and the mean tokenised length of an evenly
    spaced sample; rows the tokeniser drops (no assistant token left) are discounted at the sample's rate."""
    dc = recipe.data
    rows, _ = load_conversations(dc.train_files, dc.format, dc.max_rows)
    held = sum(is_heldout(r["id"], dc.heldout_fraction) for r in rows)
    held = min(held, dc.heldout_rows) if dc.heldout_rows else held
    train = len(rows) - sum(is_heldout(r["id"], dc.heldout_fraction) for r in rows)
    picked = rows[::max(1, len(rows) // sample)][:sample]
    enc = tokenize_conversations(tok, [r["messages"] for r in picked], dc.max_length)
    good = [len(e[0]) for e in enc if not isinstance(e, ValueError) and any(e[1])]
    keep = len(good) / max(len(picked), 1)
    return DataSize(int(train * keep), int(held * keep), sum(good) / max(len(good), 1))
