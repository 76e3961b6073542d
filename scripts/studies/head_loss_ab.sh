#!/usr/bin/env bash
# A/B of Medusa's training step on SmolLM2: a baseline checkout (default 9f69432, the last commit whose heads
# built their whole [N, V] logits) against this checkout's blocked head loss (losses.head_loss,
# docs/training.md). 24 steps each over the pool, online bf16 target features, bf16 autocast; glibc's
# allocator defaults, or SPECTRAIN_MALLOC=keep with MALLOC=keep. Prints median tokens/s of steps 5-24, peak
# RSS, minor page faults and the loss at step 24 (equal when the two compute the same thing). Needs the
# SmolLM2 target (`spectrain target fetch smollm2-135m`); ~6 min.
#   bash scripts/studies/head_loss_ab.sh [BASE_REF]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
base=${TMPDIR:-/tmp}/spectrain-ab-base
git -C "$here" worktree remove -f "$base" 2>/dev/null || true
git -C "$here" worktree add -f -q --detach "$base" "${1:-9f69432}"
ln -sfn "$here/models" "$base/models"
export OMP_NUM_THREADS=2 SPECTRAIN_NUM_THREADS=2 HF_HUB_OFFLINE=1
pool=$(ls "$here"/data/train/smollm2_engine_regen_*.jsonl.gz | sed "s|$here/||" | paste -sd, -)
run() {  # $1 label, $2 the checkout that runs (python -m puts its own directory first on sys.path)
  out=${TMPDIR:-/tmp}/ab-$1${MALLOC:+-$MALLOC}; rm -rf "$out"
  (cd "$2" && env ${MALLOC:+SPECTRAIN_MALLOC=$MALLOC} /usr/bin/time -f "$1: peak RSS %M kB, %R minor faults, %e s" \
    python -m spectrain train smollm2-135m/medusa "data.train_files=[$pool]" training.features=online \
    target.dtype=bfloat16 training.precision=bf16 training.max_steps=24 training.eval_every=1000 \
    training.checkpoint_every=1000 output_dir="$out") > "$out.log" 2>&1
  tail -1 "$out.log"
  python - "$1" "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(f"{sys.argv[2]}/metrics.jsonl") if '"tokens_per_s"' in l]
tps = [r["tokens_per_s"] for r in rows if r["step"] > 4]
print(f"{sys.argv[1]}: steps 5-24 median {statistics.median(tps):.0f} tok/s, loss at step 24 {rows[-1]['loss']:.4f}")
PY
}
run whole-logits "$base"
run blocked "$here"
git -C "$here" worktree remove -f "$base"
