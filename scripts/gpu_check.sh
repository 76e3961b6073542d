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
#                  EAGLE-3 training steps through spectrain.train.loop -> tokens/s, TFLOP/s and MFU
#                  (formula in scripts/gpu_check.py; peak 989 TFLOP/s bf16 dense, override with PEAK)
#   3. lossless    greedy speculative decoding (n-gram drafter and the three step-1 drafters) against
#                  HF generate(do_sample=False) on the device: fp32 must match token for token; bf16
#                  divergences are reported (batched verification can round a near-tie differently)
#   4. wheel       builds the wheel, installs it into a fresh venv that sees this environment's torch
#                  (--system-site-packages; WHEELHOUSE=DIR supplies missing deps offline), records that torch
#                  is unchanged, and runs --version / check / a 2-step train / a 1-prompt eval from an empty dir
#   5. sweep       spectrain eval --batch-size 1..32 with the step-1 EAGLE-3 head and n-gram: plain vs
#                  speculative throughput per batch size, the crossover, the roofline prediction (H200)
#   6. summary     RESULTS/summary.md from the JSON files; exit status 1 if any step failed
# GPU_CHECK_STEPS="tiny synthetic lossless wheel sweep" (the default) selects steps; GPU_CHECK_FAMILIES
# (default "eagle3 medusa draft") the tiny recipes of step 1.
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
    SWEEP_ROWS="${SWEEP_ROWS:-32}"
    SWEEP_BS=(--batch-size 1 --batch-size 2 --batch-size 4 --batch-size 8 --batch-size 16 --batch-size 32)
    nvidia-smi > "$RESULTS/nvidia-smi.txt" 2>&1 || true
else
    TINY_STEPS="${TINY_STEPS:-3}"
    SYN_ARGS=(--size tiny --steps 3 --seq 64 --micro 2 --ttt 3 --peak "$PEAK")
    LOSSLESS_ARGS=(--prompts 2 --max-new 12 --k 3)
    PRECISION=fp32
    SWEEP_ROWS="${SWEEP_ROWS:-4}"
    SWEEP_BS=(--batch-size 1 --batch-size 4)
fi
python -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" > "$RESULTS/versions.txt" 2>&1

STEPS=" ${GPU_CHECK_STEPS:-tiny synthetic lossless wheel sweep} "
FAMILIES="${GPU_CHECK_FAMILIES:-eagle3 medusa draft}"
want() { [[ "$STEPS" == *" $1 "* ]]; }
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
if want tiny && [ -f assets/reference-target/config.json ]; then
    rm -f "$RESULTS"/tiny_train*.log "$RESULTS"/tiny_train_*.json
    for fam in $FAMILIES; do
        run="$RESULTS/tiny-$fam"
        rm -rf "$run"
        run_step tiny_train_$fam 600 python -m spectrain train "recipes/tiny/$fam.yaml" \
            "training.max_steps=$TINY_STEPS" "training.precision=$PRECISION" training.eval_every=100 \
            training.checkpoint_every=0 training.resume_from= "tracking.report_to=[jsonl]" "output_dir=$run"
        run_step tiny_train_$fam 60 python -m scripts.gpu_check tiny-report --run "$run" --out "$RESULTS" \
            --device "$DEVICE"
        if [ -d "$run/last" ]; then DRAFTERS+=(--drafter "$run/last"); fi
    done
elif want tiny; then
    echo "gpu_check: tiny_train skipped: assets/reference-target is missing (python scripts/build_reference_target.py)" \
        | tee "$RESULTS/tiny_train.log"
fi

# 2. synthetic ~1B target: EAGLE-3 training throughput and MFU
rm -rf "$RESULTS/synthetic-run" "$RESULTS/synthetic.log"
want synthetic && run_step synthetic 900 python -m scripts.gpu_check synthetic --out "$RESULTS" --device "$DEVICE" "${SYN_ARGS[@]}"

# 3. greedy losslessness on the device
rm -f "$RESULTS/lossless.log"
want lossless && run_step lossless 900 python -m scripts.gpu_check lossless --out "$RESULTS" --device "$DEVICE" \
    --target assets/reference-target "${LOSSLESS_ARGS[@]}" "${DRAFTERS[@]}"

# 4. the wheel in this (GPU) environment, run from an empty directory
SPECTRAIN=(python -m spectrain)
if want wheel; then
    rm -rf "$RESULTS/wheel.log" "$RESULTS/dist" "$RESULTS/venv"
    wheel_step() {
        set -e
        unset PYTHONPATH  # a checkout on the path (with its build's egg-info) would read as installed
        python -m pip wheel -q --no-deps --no-build-isolation -w "$RESULTS/dist" .
        python -m venv --system-site-packages "$RESULTS/venv"
        local vpy="$RESULTS/venv/bin/python" links=()
        # when this python is itself a venv (e.g. a CUDA env), --system-site-packages sees only the base
        # interpreter's packages: a .pth makes this environment's (its torch) visible behind the venv's own
        python -c "import site; print('\n'.join(site.getsitepackages()))" \
            > "$("$vpy" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_gpu_check_parent_env.pth"
        if [ -n "${WHEELHOUSE:-}" ]; then links=(--no-index --find-links "$WHEELHOUSE"); fi
        echo "torch before: $("$vpy" -c 'import torch; print(torch.__version__)')"
        local nodeps=()
        if "$vpy" -m pip install -q "${links[@]}" --dry-run --report "$RESULTS/wheel_plan.json" "$RESULTS"/dist/*.whl; then
            "$vpy" -c "import json,sys; p=json.load(open(sys.argv[1])); print('pip plans:', {i['metadata']['name']: i['metadata']['version'] for i in p['install']})" "$RESULTS/wheel_plan.json"
        else  # offline and a dependency missing from WHEELHOUSE: say so, then check the package itself
            echo "pip could not resolve every dependency offline (above); installing spectrain with --no-deps"
            nodeps=(--no-deps)
        fi
        "$vpy" -m pip install -q "${links[@]}" "${nodeps[@]}" "$RESULTS"/dist/*.whl
        "$vpy" -m pip check || true
        echo "torch after: $("$vpy" -c 'import torch; print(torch.__version__)')"
        local empty; empty=$(mktemp -d)
        (cd "$empty" && PYTHONPATH= "$RESULTS/venv/bin/spectrain" --version \
            && PYTHONPATH= "$RESULTS/venv/bin/spectrain" check tiny/eagle3 > check.txt && echo "check tiny/eagle3: ok" \
            && PYTHONPATH= "$RESULTS/venv/bin/spectrain" train tiny/eagle3 training.max_steps=2 output_dir=w > train.txt \
            && PYTHONPATH= "$RESULTS/venv/bin/spectrain" eval --recipe tiny/eagle3 --drafter ngram --prompts heldout --n 1 \
                --max-new-tokens 16 --temperature 0 --out e > eval.txt && echo "2-step train + 1-prompt eval from $empty: ok")
    }
    export RESULTS WHEELHOUSE="${WHEELHOUSE:-}"
    export -f wheel_step
    run_step wheel 300 bash -c wheel_step
    if [ -x "$RESULTS/venv/bin/spectrain" ]; then SPECTRAIN=(env PYTHONPATH= "$RESULTS/venv/bin/spectrain"); fi
fi

# 5. batch-size sweep: plain vs speculative throughput, crossover, roofline prediction
if want sweep; then
    rm -rf "$RESULTS/sweep" "$RESULTS/sweep.log"
    SWEEP_DRAFTERS=(--drafter ngram)
    if [ -d "$RESULTS/tiny-eagle3/last" ]; then SWEEP_DRAFTERS+=(--drafter "$RESULTS/tiny-eagle3/last"); fi
    run_step sweep 600 "${SPECTRAIN[@]}" eval --recipe tiny/eagle3 "${SWEEP_DRAFTERS[@]}" --prompts heldout \
        --prompts spec_bench/mt_bench --n "$SWEEP_ROWS" --max-new-tokens 64 --k 4 --temperature 0 \
        --device "$DEVICE" --dtype "$( [ "$DEVICE" = cuda ] && echo bfloat16 || echo float32 )" --gpu h200 \
        "${SWEEP_BS[@]}" --out "$RESULTS/sweep"
fi

# 6. summary
python -m scripts.gpu_check summary --out "$RESULTS" --device "$DEVICE" || failed+=("summary")
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: failed steps: ${failed[*]}" | tee -a "$RESULTS/summary.md" >&2
    exit 1
fi
echo "gpu_check: all steps passed; results in $RESULTS"
