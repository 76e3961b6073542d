#!/usr/bin/env bash
# The main job, end to end on the bundled reference target (CPU, about 20 minutes on 2 free cores):
#   1. validate the tiny EAGLE-3 recipe,
#   2. train an EAGLE-3 head (runs/tiny-eagle3: metrics.jsonl, step-N/, best/, init/ = untrained head),
#   3. evaluate the trained head, the untrained head and the n-gram baseline on the held-out split
#      and OOD prompt sets, greedy and sampled, chain k=5 and a tree, against plain decoding in the
#      same run -> runs/tiny-eagle3/eval/report.{json,md} + PNG plots.
# Usage: bash scripts/demo.sh            (RUN=dir to write elsewhere; N=prompts per set, default 8)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="${RUN:-runs/tiny-eagle3}"
N="${N:-8}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

spectrain check recipes/tiny/eagle3.yaml "output_dir=$RUN"
if [ -e "$RUN/last" ]; then resume="training.resume_from=auto"; else resume=""; fi
spectrain train recipes/tiny/eagle3.yaml "output_dir=$RUN" $resume
spectrain eval --recipe recipes/tiny/eagle3.yaml --target assets/reference-target \
    --drafter "$RUN/best" --drafter "$RUN/init" --drafter ngram \
    --prompts heldout --prompts spec_bench/mt_bench --prompts spec_bench/summarization \
    --prompts spec_bench/math_reasoning --prompts spec_bench/rag --prompts humaneval \
    --k 5 --tree topk=4,depth=5,total=32 --temperature 0 --temperature 1 \
    --n "$N" --max-new-tokens 64 --out "$RUN/eval" --force
spectrain plot "$RUN"                  # -> $RUN/train_curve.png
echo "report: $RUN/eval/report.md"
