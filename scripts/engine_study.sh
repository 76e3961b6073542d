#!/usr/bin/env bash
# SmolLM2's EAGLE-3 head served by llama.cpp, measured beside spectrain's own evaluator (docs/engine.md):
#
#   bash scripts/engine_study.sh                      # every stage; needs an idle machine for the timings
#   HEAD=runs/smollm2-eagle3 N=8 TOKENS=64 bash scripts/engine_study.sh
#
# Stages: the engine (built once, cached), the target GGUF, the head exported to GGUF, spectrain's own eval
# (fp32, the dequantized target) on the same prompts, then `spectrain eval --engine llama.cpp` with
# --conform-to that report: plain vs speculative llama-server, k = 1..K, T = 0 and 1, the engine's n-gram mode
# beside the head, the engine's cost curve and the predicted speedup. Run it alone: llama.cpp's threads spin,
# and anything else on the 2 cores collapses its timings.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
HEAD=${HEAD:-runs/smollm2-eagle3/best}  # a checkpoint dir (spectrain eval loads it; export takes it too)
OUT=${OUT:-runs/engine-study}
N=${N:-8}
TOKENS=${TOKENS:-64}
KS=${KS:-"1 2 3"}
PROMPTS=(--recipe smollm2-135m/eagle3 --prompts heldout --prompts mt_bench --prompts humaneval --n "$N"
         --max-new-tokens "$TOKENS" --seed 0)
# spectrain's own eval at T = 0 only: at T > 0 llama.cpp accepts while its own sample matches the draft (not
# p/q rejection), a different rule with lower acceptance, so only greedy acceptance is comparable
OWN_TEMPS=${OWN_TEMPS:-"--temperature 0"}
KARGS=(); for k in $KS; do KARGS+=(--k "$k"); done
stage() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; SECONDS=0; }

STAGES=${STAGES:-"engine target export own-eval engine-eval"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has engine; then stage engine; python -m spectrain engine fetch llama.cpp; fi
if has target; then stage target; python -m spectrain target fetch smollm2-135m; fi
if has export; then stage export; python -m spectrain export "$HEAD" --format llama.cpp --out "$OUT/head-gguf" --target "$GGUF" --force; fi
if has own-eval; then stage own-eval
python -m spectrain eval --target "$GGUF" --drafter "$HEAD" "${PROMPTS[@]}" $OWN_TEMPS "${KARGS[@]}" --out "$OUT/own" --force
echo "own eval took ${SECONDS}s"; fi
if has engine-eval; then stage engine-eval
python -m spectrain eval --engine llama.cpp --target "$GGUF" --drafter "$OUT/head-gguf" --drafter ngram \
    "${PROMPTS[@]}" --temperature 0 --temperature 1 "${KARGS[@]}" --threads 2 \
    $([ -f "$OUT/own/report.json" ] && echo --conform-to "$OUT/own/report.json") --out "$OUT/engine" --force
echo "engine eval took ${SECONDS}s"; fi
