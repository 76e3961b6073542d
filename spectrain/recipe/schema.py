"""Recipe schema: one typed dataclass per section, defaults in one place. Loading and validation: load.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

LossName = Literal["fkl", "rkl", "jsd", "tvd", "accept", "lk", "soft_ce", "hard_ce"]


DEVICE_MAPS = ("", "auto", "balanced", "balanced_low_0", "sequential")


Tracker = Literal["none", "jsonl", "wandb", "tensorboard"]


@dataclass
class TargetConfig:
    name_or_path: str = "assets/reference-target"  # an HF dir or hub id, or a .gguf file (dequantized once, cached)
    gguf_file: str = ""  # with a dir or hub repo in name_or_path: the GGUF file in it
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"] = "auto"
    trust_remote_code: bool = False
    device_map: str = ""  # "" = one device; auto | balanced | sequential = spread over the visible GPUs (HF device_map)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/train/chat_mix_messages.jsonl"])
    format: Literal["auto", "messages", "sharegpt"] = "auto"
    max_length: int = 512
    heldout_fraction: float = 0.05
    max_rows: int = 0  # 0 = all rows
    heldout_rows: int = 64  # cap on the held-out split size
    cache_dir: str = ".cache/spectrain"
    # extra arguments of the target's chat template when `spectrain regenerate` renders prompts (in-process)
    # or asks a server (sent as the request's chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Eagle3RolloutConfig:
    """drafter.eagle3.rollout (spectrain/drafters/eagle3/rollout.py): on that fraction of the optimizer steps,
    TTT feeds `anchors` anchors per row the head's own drafts and trains them against the target's
    distribution on those drafted prefixes (one extra target pass per micro-batch)."""
    fraction: float = 0.0  # share of optimizer steps that roll out (0 = off: plain TTT)
    anchors: int = 16  # rolled-out anchors per row (the extra target pass grows with anchors x (ttt_steps - 1))
    temperature: float = 0.0  # 0 = greedy drafts (the T=0 decoding path); > 0 = drafts sampled from the head


@dataclass
class Eagle3Config:
    aux_layers: list[int] = field(default_factory=list)  # [] = derive from the target
    num_layers: int = 1
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    intermediate_size: int = 0  # 0 = the target's
    num_attention_heads: int = 0  # 0 = the target's
    # layer layout (speculators' names; all false = the original EAGLE-3 layer, see drafters/eagle3/model.py)
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states before fc
    fc_norm: bool = False  # one RMSNorm per aux state before fc (exclusive with norm_before_fc)
    norm_before_residual: bool = False  # layer 0's residual = hidden_norm(hidden)
    norm_output: bool = False  # feed the final norm's output to the next step
    sliding_window: int = 0  # > 0: every draft layer attends to anchors within this window (speculators' default 2048)
    init_from: str = ""  # a head dir to fine-tune (spectrain, speculators/vLLM or EAGLE/SGLang format)
    # target: lm_head = the target's lm_head rows of the draft vocabulary (target_with_norm: also the
    # final norm's weight from the target's final norm); random: normal(0, 0.02)
    lm_head_init: Literal["random", "target", "target_with_norm"] = "random"
    freeze_lm_head: bool = False
    # which TTT positions carry loss: "predicted" = the predicted token is an assistant token;
    # "input" = the step's input token is (the speculators rule)
    loss_positions: Literal["predicted", "input"] = "predicted"
    # positions whose target argmax lies outside the draft vocab: "mask" = no loss there, "keep" = trained
    out_of_vocab: Literal["mask", "keep"] = "mask"
    rollout: Eagle3RolloutConfig = field(default_factory=Eagle3RolloutConfig)


@dataclass
class MedusaConfig:
    num_heads: int = 4
    num_resblocks: int = 1


@dataclass
class DraftLMConfig:
    model: str = ""
    init: str = "pretrained"  # pretrained | layers:0,1 | config


@dataclass
class NgramConfig:
    max_n: int = 3
    min_n: int = 1


@dataclass
class DrafterConfig:
    kind: str = "eagle3"  # a family in spectrain/registry.py (eagle3 | medusa | draft), or ngram
    loss: LossName = "fkl"
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    draft: DraftLMConfig = field(default_factory=DraftLMConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    # drafter.<kind> of families registered outside this schema (their Family.train.section), by kind
    sections: dict[str, Any] = field(default_factory=dict)


@dataclass
class OnPolicyConfig:
    """training.on_policy (drafter.kind=draft; spectrain/train/on_policy.py): on that fraction of the optimizer steps
    the batches are the student's own continuations of the training prompts, scored by the target."""
    fraction: float = 0.0  # share of optimizer steps that roll out (0 = off: fixed data only; 1 = every step)
    temperature: float = 1.0  # the student's sampling temperature (0 = greedy)
    max_new_tokens: int = 32  # tokens sampled per prompt (fewer when an eos comes first)
    refresh_every: int = 1  # 1 = sample from the current student; N = from a snapshot refreshed every N steps


@dataclass
class TrainingConfig:
    global_batch_size: int = 8
    micro_batch_size: int = 4
    lr: float = 3.0e-4
    weight_decay: float = 0.0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 20
    epochs: int = 1
    max_steps: int = 0  # 0 = run `epochs`
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    grad_clip: float = 1.0  # 0 = no clipping
    checkpoint_every: int = 100
    eval_every: int = 50
    keep_checkpoints: int = 2
    resume_from: str = ""
    features: Literal["online", "offline"] = "online"
    feature_cache: str = ""
    max_nan_steps: int = 10
    num_workers: int = 0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    num_threads: int = 0  # torch CPU threads; 0 = $SPECTRAIN_NUM_THREADS, else the cores this process may use
    packing: bool = False  # pack each micro-batch's rows into one row with document masking (EAGLE-3)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)

    def grad_accum(self, world_size: int = 1) -> int:
        """Micro-steps per optimizer step so that one step sees exactly `global_batch_size` rows."""
        per_step = self.micro_batch_size * world_size
        if world_size < 1 or self.global_batch_size % per_step:
            raise ValueError(
                f"training.global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size ({self.micro_batch_size}) x world size ({world_size}) = {per_step}; "
                f"pick a global batch size that is a multiple of {per_step} or change micro_batch_size"
            )
        return self.global_batch_size // per_step


@dataclass
class TrackingConfig:
    report_to: list[Tracker] = field(default_factory=lambda: ["jsonl"])
    project: str = "spectrain"
    run_name: str = ""  # "" = the output directory's name (also the wandb group; see spectrain/train/tracking.py)


@dataclass
class LaunchConfig:
    """How `spectrain train` starts itself: N processes through `accelerate launch` (0 = every visible GPU,
    one process without CUDA; 1 = one process; --nproc wins) and an accelerate config (a shipped name such
    as zero2, or a path)."""
    nproc: int = 0
    accelerate_config: str = ""


@dataclass
class DeployConfig:
    """The serving engine the head is for ("" = not said): recipe validation refuses, before any training, a
    drafter that engine cannot compute (spectrain/recipe/deploy.py engine_problems)."""
    engine: Literal["", "vllm", "sglang", "trtllm"] = ""


@dataclass
class FeaturesConfig:
    """How `spectrain prepare-features` stores the offline cache (spectrain/data/features.py)."""
    dtype: Literal["bf16", "fp32", "fp8"] = "bf16"  # fp8: aux states in float8 e4m3 + one scale per row
    shard_mb: float = 1024.0  # target size of one shard file
    batch_size: int = 8  # rows per target forward


class _RecipeDumper(yaml.SafeDumper):
    """Block-style sections, inline lists: the shape of the recipe files."""


_RecipeDumper.add_representer(
    list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


@dataclass
class Recipe:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    output_dir: str = "runs/tiny-eagle3"

    def to_dict(self) -> dict[str, Any]:
        """The recipe file's shape: a registered family's section is ``drafter.<kind>`` like the built-in ones."""
        d = dataclasses.asdict(self)
        d["drafter"].update(d["drafter"].pop("sections"))
        return d

    def to_yaml(self) -> str:
        """Block-style sections with inline lists: the same shape as the recipe files."""
        return yaml.dump(self.to_dict(), Dumper=_RecipeDumper, sort_keys=False, default_flow_style=False)
