#!/usr/bin/env bash
# GPU check (about 5 minutes on one GPU; never run by CI). From the repository root:
#
#   bash scripts/gpu_check.sh                      # results in ./gpu_check_results/
#   OUT=/some/dir bash scripts/gpu_check.sh        # results in $OUT/
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh # dry run of every step on CPU (tiny sizes, numbers meaningless)
#
# Steps (each logs to RESULTS/<step>.log; one failing step does not stop the others):
#   1. tiny_train  recipes/tiny/{eagle3,medusa,draft}.yaml on the device, bf16, 1 process, TINY_STEPS
#                  optimizer steps each -> tokens/s (needs assets/reference-target; skipped if absent)
#   2. synthetic   a random-weight Llama with Llama-3.2-1B's shape (1.24B params) built in-process;
#                  EAGLE-3 training steps through spectrain.train -> tokens/s, TFLOP/s and MFU
#                  (formula in scripts/gpu_check.py; peak 989 TFLOP/s bf16 dense, override with PEAK)
#   3. lossless    greedy speculative decoding (n-gram drafter and the three step-1 drafters) against
#                  HF generate(do_sample=False) on the device: fp32 must match token for token; bf16
#                  divergences are reported (batched verification can round a near-tie differently)
#   4. summary     RESULTS/summary.md from the JSON files; exit status 1 if any step failed
set -uo pipefail

cd "$(dirname "$0")/.."
RESULTS="${OUT:-./gpu_check_results}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
PEAK="${PEAK:-989e12}"
mkdir -p "$RESULTS"

if [ "$DEVICE" = "cuda" ]; then
    if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: torch sees no CUDA device; nothing to check (GPU_CHECK_DEVICE=cpu for a dry run)" >&2
        exit 2
    fi
    export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # one process, one GPU
    TINY_STEPS="${TINY_STEPS:-200}"
    SYN_ARGS=(--size 1b --steps "${SYN_STEPS:-30}" --seq 2048 --micro 4 --ttt 7 --peak "$PEAK")
    LOSSLESS_ARGS=(--prompts 6 --max-new 64 --k 4)  # k <= the tiny Medusa recipe's 4 heads
    PRECISION=bf16
    nvidia-smi > "$RESULTS/nvidia-smi.txt" 2>&1 || true
else
    TINY_STEPS="${TINY_STEPS:-3}"
    SYN_ARGS=(--size tiny --steps 3 --seq 64 --micro 2 --ttt 3 --peak "$PEAK")
    LOSSLESS_ARGS=(--prompts 2 --max-new 12 --k 3)
    PRECISION=fp32
fi
python -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" > "$RESULTS/versions.txt" 2>&1

failed=()
run_step() {  # run_step NAME TIMEOUT_S CMD...: log to RESULTS/NAME.log, remember failures
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    # -k: the training loop treats SIGTERM as preemption (checkpoint, then exit), so follow up with SIGKILL
    if timeout -k 60 "$limit" "$@" >> "$RESULTS/$name.log" 2>&1; then
        echo "gpu_check: $name ok ($((SECONDS - t0)) s)"
    else
        echo "gpu_check: $name FAILED (exit $?, $((SECONDS - t0)) s); see $RESULTS/$name.log" >&2
        failed+=("$name")
    fi
}

# 1. the tiny recipes on the device
DRAFTERS=()
if [ -f assets/reference-target/config.json ]; then
    rm -f "$RESULTS"/tiny_train*.log "$RESULTS"/tiny_train_*.json
    for fam in eagle3 medusa draft; do
        run="$RESULTS/tiny-$fam"
        rm -rf "$run"
        run_step tiny_train_$fam 600 python scripts/train.py "recipes/tiny/$fam.yaml" \
            "training.max_steps=$TINY_STEPS" "training.precision=$PRECISION" training.eval_every=100 \
            training.checkpoint_every=0 training.resume_from= "tracking.report_to=[jsonl]" "output_dir=$run"
        run_step tiny_train_$fam 60 python scripts/gpu_check.py tiny-report --run "$run" --out "$RESULTS" \
            --device "$DEVICE"
        if [ -d "$run/last" ]; then DRAFTERS+=(--drafter "$run/last"); fi
    done
else
    echo "gpu_check: tiny_train skipped: assets/reference-target is missing (python scripts/build_reference_target.py)" \
        | tee "$RESULTS/tiny_train.log"
fi

# 2. synthetic ~1B target: EAGLE-3 training throughput and MFU
rm -rf "$RESULTS/synthetic-run" "$RESULTS/synthetic.log"
run_step synthetic 900 python scripts/gpu_check.py synthetic --out "$RESULTS" --device "$DEVICE" "${SYN_ARGS[@]}"

# 3. greedy losslessness on the device
rm -f "$RESULTS/lossless.log"
run_step lossless 900 python scripts/gpu_check.py lossless --out "$RESULTS" --device "$DEVICE" \
    --target assets/reference-target "${LOSSLESS_ARGS[@]}" "${DRAFTERS[@]}"

# 4. summary
python scripts/gpu_check.py summary --out "$RESULTS" --device "$DEVICE" || failed+=("summary")
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: failed steps: ${failed[*]}" | tee -a "$RESULTS/summary.md" >&2
    exit 1
fi
echo "gpu_check: all steps passed; results in $RESULTS"
