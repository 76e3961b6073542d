"""Train a recipe's drafter: the entry point for `accelerate launch` and `torchrun` (same as `spectrain train`).

Usage (from the repository root; any `a.b=value` after the recipe overrides it, typed):

    # tiny CPU run on the bundled reference target, one process
    python scripts/train.py recipes/tiny/eagle3.yaml
    accelerate launch --cpu --num_processes 1 scripts/train.py recipes/tiny/eagle3.yaml training.max_steps=50

    # the same without this script (any directory, installed wheel): the command starts accelerate itself
    spectrain train tiny/eagle3 --nproc 2                  # 2 CPU gloo ranks without CUDA, N GPUs with it
    spectrain train eagle3 --accelerate-config zero2       # shipped config by name, all visible GPUs
    accelerate launch --config_file recipes/accelerate/zero2.yaml -m spectrain train eagle3

    # two CPU processes (gloo), to try the multi-process path without GPUs
    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/accelerate/cpu_ddp.yaml \
        scripts/train.py recipes/tiny/eagle3.yaml
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 scripts/train.py recipes/tiny/eagle3.yaml

    # GPUs: one node DDP, or DeepSpeed ZeRO-2 for an 8B target (global batch stays the recipe's;
    # gradient accumulation = global_batch_size / (micro_batch_size * processes))
    accelerate launch --config_file recipes/accelerate/ddp.yaml scripts/train.py recipes/eagle3.yaml
    accelerate launch --config_file recipes/accelerate/zero2.yaml scripts/train.py recipes/eagle3.yaml

    # after preemption (SIGTERM/SIGINT write a checkpoint first): continue exactly where it stopped
    accelerate launch ... scripts/train.py recipes/eagle3.yaml training.resume_from=auto

Exit status: 0 done; 2 bad input (one-line message); 128+signal when stopped by SIGTERM/SIGINT after
writing a checkpoint.
"""

import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spectrain.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["train", *sys.argv[1:]]))
