#!/usr/bin/env bash
# A/B of training's allocator setting (keep_freed_memory, docs/training.md) on the SmolLM2 draft recipe over
# the pool: 40 steps each, glibc's defaults then SPECTRAIN_MALLOC=keep; peak anonymous RSS
# sampled every second. Needs the pool feature cache (recipes/smollm2-135m/eagle3.yaml's header); ~6 min.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=2 SPECTRAIN_NUM_THREADS=2 HF_HUB_OFFLINE=1
for mode in system kept; do
  rm -rf ${TMPDIR:-/tmp}/ab-$mode
  if [ $mode = system ]; then unset SPECTRAIN_MALLOC; else export SPECTRAIN_MALLOC=keep; fi
  python -m spectrain train smollm2-135m/draft training.precision=bf16 \
    training.max_steps=40 training.checkpoint_every=1000 training.eval_every=1000 output_dir=${TMPDIR:-/tmp}/ab-$mode > ${TMPDIR:-/tmp}/ab-$mode.log 2>&1 &
  pid=$!; peak=0
  while kill -0 $pid 2>/dev/null; do
    a=$(grep RssAnon /proc/$pid/status 2>/dev/null | awk '{print $2}'); [ -n "$a" ] && [ "$a" -gt "$peak" ] && peak=$a; sleep 1
  done
  python - "$mode" "$peak" "${TMPDIR:-/tmp}/ab-$mode" <<'PY'
import json, statistics, sys
mode, peak, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"tokens_per_s"' in l]
tps = [r["tokens_per_s"] for r in rows if r["step"] > 10]
print(f"{mode}: steps 11-40 median {statistics.median(tps):.0f} tok/s, peak RssAnon {peak/1e6:.2f} GB")
PY
done
