#!/usr/bin/env bash
# Drafter quality on SmolLM2-135M-Instruct (issue 16; docs/on_policy.md): spectrain's EAGLE-3 default against
# the public speculators 0.9.0 trainer at equal budget, the acceptance loss and draft-path rollouts for EAGLE-3,
# and on-policy distillation for the draft model; every head decoded by spectrain's lossless decoder.
#
#   bash scripts/smollm2_quality_study.sh                    # all stages; each is skipped when its output exists
#   STAGES="eval table" bash scripts/smollm2_quality_study.sh
#
# Needs: the real-target study's fetch / features / train stages (runs/smollm2-eagle3/best, runs/smollm2-draft/best:
# scripts/real_target_study.sh) and, for the speculators stages, a venv with speculators 0.9.0 ($SPEC_VENV; how to
# build it: ../shared/anchors/speculators_cpu/README.md). Every job runs on one torch thread (two run at once on a
# 2-core machine). Stages, with the times measured on a 2-core CPU running two jobs:
#   rows      spectrain's train + held-out rows of the EAGLE-3 recipe, as JSONL (the rows speculators trains on)
#   specdata  the target's hidden states for those rows in speculators' offline layout, fp32 (~20 min, 1.1 GB)
#   spec      speculators, 300 steps: its defaults (lr 1e-3) and at spectrain's lr 2e-3 (~75 min each)
#   eagle3    spectrain EAGLE-3, unpacked, $E3_STEPS steps: fkl (the baseline), lk, rollout fraction 0.5
#   eagle3lr  spectrain EAGLE-3 at speculators' optimizer (lr 1e-3, betas 0.9/0.999), 300 steps: unpacked fkl
#             (~65 min) then packed (the recipe as it is), beside unpacked rollout fraction 0.5 (~100 min)
#   lk        the recipe as it is (a rerun of spectrain's default, on one thread) beside the same with
#             drafter.loss=lk, 300 steps, packed, one job per core (~60 min)
#   medusa    Medusa, the recipe as it is (fkl) beside drafter.loss=lk, 100 steps, one job per core (21 / 27 min)
#   draftdiv  the draft model as it is (fkl, fixed data) beside drafter.loss=tvd, 150 steps, one job per core (16 min)
#   draftdiv2 the same with drafter.loss=rkl beside jsd (paired with draftdiv's fkl run)
#   draft     the draft model, 150 steps, on-policy fraction 0.5 (fixed data: runs/smollm2-draft/best)
#   eval*     tau per set at T=0 and T=1, chain k=3, $N prompts per set, 48 new tokens
#   table     eval/reference/smollm2_quality.json (scripts/studies/smollm2_quality_tables.py), rendered by gen_tables.py
#
# At scale (issue 31): ROWS=N takes the first N rows of the recipe's data for the rows / specdata stages, and
#   SCALE_STEPS=S STAGES="rows specdata specrows e3rows evalrows table" W=runs/study31 THREADS=2 bash ...
# trains speculators' default (specrows) and the shipped recipe as it is (e3rows: data.max_rows=N, S steps, the
# offline cache prefix) on those N rows, one job at a time on $THREADS threads, then decodes both (evalrows);
# e3rowslr / evalrowslr: the recipe at speculators' optimizer on the same rows (its records pair with evalrows').
# e3rowsfp32 / evalrowsfp32: the recipe as it is on fp32 features of an fp32 target for the same rows (their own
# cache, written first: speculators' hidden states are fp32 of an fp32 target; the shared cache is bf16 of bf16).
# e3rowsnorm / evalrowsnorm: the recipe with drafter.eagle3.norm_output=true (speculators' layer layout; the recipe
# drops it because llama.cpp feeds the draft layer's pre-norm state back).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGES=${STAGES:-"rows specdata spec eagle3 eagle3lr lk medusa draftdiv draftdiv2 draft evalspec evalvariants evallr evallk evalmedusa evaldraftdiv evaldraftdiv2 evaldraft table"}
W=${W:-runs/study16}
N=${N:-10}
E3_STEPS=${E3_STEPS:-60}
ROWS=${ROWS:-0}            # 0: the recipe's whole data
SCALE_STEPS=${SCALE_STEPS:-300}
THREADS=${THREADS:-1}
SPEC_VENV=${SPEC_VENV:-/work/spec_venv}
ANC=${SPECULATORS_ANCHOR:-../shared/anchors/speculators_cpu}
export OMP_NUM_THREADS=$THREADS SPECTRAIN_NUM_THREADS=$THREADS HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
has() { [[ " $STAGES " == *" $1 "* ]]; }
stage() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; SECONDS=0; }
done_in() { echo "== $1 took ${SECONDS}s"; }
mkdir -p "$W" "$W/lr1e-3" "$W/lk" "$W/medusa" "$W/draftdiv"
# speculators reads an HF dir: the GGUF's dequantized copy (written by `spectrain target fetch smollm2-135m`)
HFD=$(python -c "from spectrain.targets.gguf import resolve_target_path as r; print(r('models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf'))")
sed "s#name_or_path: models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf#name_or_path: $HFD#" \
  recipes/smollm2-135m/eagle3.yaml > "$W/eagle3_hfdir.yaml"
[ "$ROWS" -gt 0 ] && sed -i "s#^  format: messages#&\n  max_rows: $ROWS#" "$W/eagle3_hfdir.yaml"

if has rows && [ ! -f "$W/rows/rows_meta.json" ]; then
  stage rows; python "$ANC/export_spectrain_rows.py" --recipe "$W/eagle3_hfdir.yaml" --out "$W/rows"; done_in rows
fi
if has specdata && [ ! -f "$W/spec-data/harness_meta.json" ]; then
  stage specdata
  "$SPEC_VENV/bin/python" "$ANC/make_offline_from_rows.py" --rows "$W/rows/rows.jsonl" \
    --token-freq "$W/rows/token_freq_train.pt" --target "$HFD" --out "$W/spec-data" --seq-len 384 \
    --hs-dtype float32 --threads "$THREADS"
  done_in specdata
fi
# equal budget: the same 560 train rows (32 held-out rows as validation), draft vocab 8192 from the same counts,
# aux layers [2, 15, 27], 300 steps of ~1,600 tokens, cosine with 20 warm-up steps, TTT 4 with decay 0.8, no
# weight decay, fp32 hidden states; speculators keeps its own layer layout (the three norms) and AdamW betas
spec() {  # $1: run dir, $2: lr, $3: steps
  [ -f "$W/$1/summary.json" ] && return
  stage "speculators $1"
  # the train rows come first in rows.jsonl, the held-out rows after them: speculators' validation split
  # (it splits at int(len * ratio)) is exactly the held-out rows
  local ratio; ratio=$(python -c "import json; m = json.load(open('$W/rows/rows_meta.json'))
print((m['train']['rows'] + 0.5) / (m['train']['rows'] + m['heldout']['rows']))")
  "$SPEC_VENV/bin/python" "$ANC/run_speculators.py" --target "$HFD" --data "$W/spec-data" --run-dir "$W/$1" \
    --steps "${3:-300}" --ttt-steps 4 --lr "$2" --draft-vocab-size 8192 --total-seq-len 1800 --scheduler cosine \
    --warmup-steps 20 --hs-dtype float32 --train-ratio "$ratio" --threads "$THREADS" \
    -- --ttt-step-loss-decay 0.8 --weight-decay 0.0 > "$W/$1.log" 2>&1
  done_in "speculators $1"
}
if has spec; then for r in ${SPEC_RUNS:-spec_default:1e-3 spec_lr2e-3:2e-3}; do spec "${r%%:*}" "${r#*:}"; done; fi
if has specrows; then spec "spec_rows$ROWS" 1e-3 "$SCALE_STEPS"; fi
# "The recipe as it is" of the stored 2,000-row runs: its optimizer then (the recipe moved to lr 1e-3, betas
# 0.9 / 0.999 when it grew to the whole pool); the first 2,000 rows and their cached features are the same
E3_MEASURED=(training.lr=2.0e-3 "training.adam_betas=[0.9,0.95]")
e3rows() {  # $1: run dir under $W, then overrides: the recipe on the same first N rows, $SCALE_STEPS steps
  local run=$1; shift
  [ -d "$W/$run/best" ] && return
  stage "spectrain $run"
  python -m spectrain train smollm2-135m/eagle3 data.max_rows="$ROWS" training.max_steps="$SCALE_STEPS" \
    training.checkpoint_every=50 training.resume_from=auto output_dir="$W/$run" "${E3_MEASURED[@]}" "$@" \
    > "$W/$run.log" 2>&1
  done_in "spectrain $run"
}
if has e3rows; then e3rows "e3_rows$ROWS"; fi  # the recipe as it is
# e3rowslr: the recipe at speculators' optimizer (lr 1e-3, AdamW betas 0.9 / 0.999), all else as it is
if has e3rowslr; then e3rows "e3lr_rows$ROWS" training.lr=1e-3 "training.adam_betas=[0.9,0.999]"; fi
if has e3rowsnorm; then e3rows "e3norm_rows$ROWS" drafter.eagle3.norm_output=true; fi
FP32_CACHE=.cache/features/smollm2-135m-rows$ROWS-fp32
if has e3rowsfp32; then
  fp32=(data.max_rows="$ROWS" target.dtype=float32 features.dtype=fp32 training.feature_cache="$FP32_CACHE")
  if [ ! -d "$W/e3fp32_rows$ROWS/best" ]; then
    stage "fp32 features"; python -m spectrain prepare-features smollm2-135m/eagle3 "${fp32[@]}" \
      > "$W/features_fp32_rows$ROWS.log" 2>&1; done_in "fp32 features"
  fi
  e3rows "e3fp32_rows$ROWS" "${fp32[@]}"
fi
if has eagle3; then
  stage eagle3
  python -m scripts.studies.onpolicy_study --family eagle3 --recipe recipes/smollm2-135m/eagle3.yaml --steps "$E3_STEPS" \
    --work "$W" --variants fkl,lk,rollout0.5 | tee "$W/eagle3_variants.md"
  done_in eagle3
fi
if has eagle3lr; then  # two jobs at once, one per core
  stage eagle3lr
  for v in fkl,packed rollout0.5; do
    python -m scripts.studies.onpolicy_study --family eagle3 --recipe recipes/smollm2-135m/eagle3.yaml --steps 300 \
      --work "$W/lr1e-3" --variants $v --set training.lr=1e-3 "training.adam_betas=[0.9,0.999]" \
      training.checkpoint_every=50 > "$W/lr1e-3/${v%%,*}.log" 2>&1 &
  done
  wait
  done_in eagle3lr
fi
pair() {  # $1: stage (its work dir under $W), $2: family, $3: steps, $4 $5: two variants, one job per core;
  # resumable: a stopped stage continues from each run's last checkpoint
  stage "$1"
  for v in "$4" "$5"; do
    python -m scripts.studies.onpolicy_study --family "$2" --recipe "recipes/smollm2-135m/$2.yaml" --steps "$3" \
      --work "$W/$1" --variants "$v" --set training.checkpoint_every=50 training.resume_from=auto \
      > "$W/$1/$v.log" 2>&1 &
  done
  wait
  done_in "$1"
}
if has lk; then pair lk eagle3 300 packed lk_packed; fi
if has medusa; then pair medusa medusa 100 fkl lk; fi
if has draftdiv; then pair draftdiv draft 150 fixed tvd; fi
if has draftdiv2; then pair draftdiv draft 150 rkl jsd; fi
if has draft; then
  stage draft
  python -m scripts.studies.onpolicy_study --family draft --recipe recipes/smollm2-135m/draft.yaml --steps 150 \
    --work "$W" --variants on_policy0.5 | tee "$W/draft_variants.md"
  done_in draft
fi
last_ckpt() { ls -d "$W/$1"/ckpt/[0-9]* | sort -V | tail -1; }
link() { ln -sfn "$(realpath "$2")" "$W/heads/$1"; }
heads() {
  mkdir -p "$W/heads"
  [ -d runs/smollm2-eagle3/best ] && link spectrain_default runs/smollm2-eagle3/best
  [ -f "$W/spec_default/summary.json" ] && link speculators_default "$(last_ckpt spec_default)"
  [ -f "$W/spec_lr2e-3/summary.json" ] && link speculators_default_lr2e-3 "$(last_ckpt spec_lr2e-3)"
  for v in fkl lk rollout0.5; do [ -d "$W/eagle3-$v-$E3_STEPS/best" ] && link "e3_$v" "$W/eagle3-$v-$E3_STEPS/best"; done
  for v in fkl packed rollout0.5; do [ -d "$W/lr1e-3/eagle3-$v-300/best" ] && link "e3_lr1e-3_$v" "$W/lr1e-3/eagle3-$v-300/best"; done
  [ -d "$W/lk/eagle3-packed-300/best" ] && link e3_default_rerun "$W/lk/eagle3-packed-300/best"
  [ -d "$W/lk/eagle3-lk_packed-300/best" ] && link e3_lk_packed "$W/lk/eagle3-lk_packed-300/best"
  for v in fkl lk; do [ -d "$W/medusa/medusa-$v-100/best" ] && link "medusa_$v" "$W/medusa/medusa-$v-100/best"; done
  [ -d "$W/draftdiv/draft-fixed-150/best" ] && link draft_fixed_rerun "$W/draftdiv/draft-fixed-150/best"
  for v in tvd rkl jsd; do [ -d "$W/draftdiv/draft-$v-150/best" ] && link "draft_$v" "$W/draftdiv/draft-$v-150/best"; done
  [ -d runs/smollm2-draft/best ] && link draft_fixed runs/smollm2-draft/best
  [ -d "$W/e3_rows$ROWS/best" ] && link "spectrain_${ROWS}rows" "$W/e3_rows$ROWS/best"
  [ -d "$W/e3lr_rows$ROWS/best" ] && link "spectrain_lr1e-3_${ROWS}rows" "$W/e3lr_rows$ROWS/best"
  [ -d "$W/e3fp32_rows$ROWS/best" ] && link "spectrain_fp32feat_${ROWS}rows" "$W/e3fp32_rows$ROWS/best"
  [ -d "$W/e3norm_rows$ROWS/best" ] && link "spectrain_normout_${ROWS}rows" "$W/e3norm_rows$ROWS/best"
  [ -f "$W/spec_rows$ROWS/summary.json" ] && link "speculators_${ROWS}rows" "$(last_ckpt "spec_rows$ROWS")"
  [ -d "$W/draft-on_policy0.5-150/best" ] && link draft_on_policy0.5 "$W/draft-on_policy0.5-150/best"
  return 0
}
ev() {  # $1: tag of the report dir, rest: head names
  local tag=$1; shift
  local args=(); for h in "$@"; do args+=(--drafter "$W/heads/$h"); done
  stage "eval$tag"
  python -m spectrain eval --recipe smollm2-135m/eagle3 "${args[@]}" --prompts heldout --prompts mt_bench \
    --prompts humaneval --n "$N" --max-new-tokens 48 --k 3 --temperature 0 --temperature 1 --seed 0 \
    --out "$W/eval300$tag" --force > "$W/eval300$tag.log" 2>&1
  done_in "eval$tag"
}
# the reports merge by prompt id, so the heads may be decoded in several runs (SPEC_EVAL_TAG, SPEC_EVAL_HEADS)
if has evalspec; then heads; ev "${SPEC_EVAL_TAG:--spec}" ${SPEC_EVAL_HEADS:-spectrain_default speculators_default \
  speculators_default_lr2e-3}; fi
if has evalrows; then heads; ev "-rows$ROWS" "spectrain_${ROWS}rows" "speculators_${ROWS}rows"; fi
if has evalrowslr; then heads; ev "-rowslr$ROWS" "spectrain_lr1e-3_${ROWS}rows"; fi
if has evalrowsnorm; then heads; ev "-rowsnorm$ROWS" "spectrain_normout_${ROWS}rows"; fi
if has evalrowsfp32; then heads; ev "-rowsfp32$ROWS" "spectrain_fp32feat_${ROWS}rows"; fi
if has evaldraft; then heads; ev -draft draft_fixed draft_on_policy0.5; fi
if has evalvariants; then heads; N=${VARIANTS_N:-$N} ev -variants e3_fkl e3_lk e3_rollout0.5; fi
if has evallr; then heads; ev -lr e3_lr1e-3_fkl e3_lr1e-3_rollout0.5 e3_lr1e-3_packed; fi
if has evalmedusa; then heads; ev -medusa-a medusa_fkl & ev -medusa-b medusa_lk & wait; fi
if has evaldraftdiv; then heads; ev -draftdiv-a draft_fixed_rerun & ev -draftdiv-b draft_tvd & wait; fi
if has evaldraftdiv2; then heads; ev -draftdiv-c draft_rkl & ev -draftdiv-d draft_jsd & wait; fi
if has evallk; then heads; ev -lk-a e3_default_rerun & ev -lk-b e3_lk_packed & wait; fi  # one job per core
if has table; then  # the stored tables (eval/reference/smollm2_quality.json), rendered into the docs
  python -m scripts.studies.smollm2_quality_tables --work "$W" && python scripts/gen_tables.py
fi
