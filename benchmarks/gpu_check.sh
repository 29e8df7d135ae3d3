#!/usr/bin/env bash
# The GPU check: build, the doctor, the whole suite and the model figures on a CUDA machine, into one
# results file, benchmarks/results/<date>-<gpu>-<commit>.json, with its folder beside it (issue #41).
#
# A GPU lease (one GPU, 15 min of device time in all with the machine's start, at most 9 min a
# command, only $OUT comes back) runs it in two calls, after a dry run here:
#   0. here:   bash benchmarks/gpu_check.sh --dry-run        (both calls on this CPU, ~10 min; it also
#              fetches the wheels of pytest-xdist, pytest-timeout and pybind11 into .whl/: calls carry it)
#   1. run     command: BERT_FAST_CHECK_COMMIT=<HEAD> BERT_FAST_CHECK_PLAN=lease BERT_FAST_CHECK_BUDGET_S=380 bash benchmarks/gpu_check.sh
#              timeout_s: 410, carry: [".whl"]   (11-28: the machine's start took ~30 s, the suite needs
#              ~1300 s of test time: 8 loadfile workers were cut at 212 s, so 12 worksteal ones now)
#   2. at once (a machine idle ~30 s goes back), with T = min(540, lease.budget_left_s of call 1's reply - 30):
#      run     command: BERT_FAST_CHECK_COMMIT=<HEAD> BERT_FAST_CHECK_PLAN=measure BERT_FAST_CHECK_BUDGET_S=<T - 20> bash benchmarks/gpu_check.sh
#              timeout_s: T, carry: [".whl"]
# Each call leaves NAME.json, NAME.tar.gz and README.md in $OUT: unpack the tarball in the repo root
# and commit. (<HEAD>: `git rev-parse --short=12 HEAD` here; the machine's .git is an older one.)
#
# Plans (BERT_FAST_CHECK_PLAN; default: lease under a 900 s budget, else full):
#   lease    call 1, correctness: install (for this GPU's arch only), info, cuda-build; then at once
#            the doctor (embedding, linear, bias_gelu, residual_layer_norm, attention last), the suite
#            (12 xdist workers; BERT_FAST_TEST_GPU_ONLY=1: what runs the same without a GPU is left
#            to CI) and warm (one untimed call of every shape measured below, bert-base and
#            bert-large: the Triton cache and the first-use verdicts); leftovers killed; then
#            tune-dispatch (the linear table at bert-base's shapes, FFN first) with the time left.
#   measure  call 2, figures only: install only if the extension is missing (a fresh machine); the
#            grid, bf16, in order of value: graphs-1x128, dense-32x128, graphs-32x128, dense-128x128,
#            padded-16x512 (random:0.2, ~40% padding), train-32x128 and train-8x512 (an MLM step),
#            bert-base against hf-sdpa; timeline (with each case's host profile); the inference grid
#            against hf-compile (mode reduce-overhead with CUDA graphs, max-autotune-no-cudagraphs
#            otherwise: stages "-compile", apart because their compiles can outlast a stage's cap; the
#            training step's outran 160 s); the grid for bert-large against hf-sdpa; dense-32x128-solo
#            (bert_fast and hf-compile each alone in its own process: --solo).
#   full     (~25 min, fits no lease) install, info, cuda-build, doctor, the suite, tune-dispatch (our
#            GEMM or cuBLAS per shape into bert_fast/data/linear_dispatch.json), the grid against
#            every rival, timeline, bench-ops, pytest-bench; the kernels autotune after the suite.
# Both lease plans run the kernels' fixed configs (BERT_FAST_AUTOTUNE=0: no sweeps in a lease).
# timeline: benchmarks/model/gpu_timeline.py, a torch.profiler timeline per GPU kernel of a bert-base
# forward at 1x128 (graphs and eager) and 32x128 and of a training step at 32x128.
#
# Every stage runs under `timeout` with min(its cap, what is left of BERT_FAST_CHECK_BUDGET_S) and is
# recorded (name, exit status, seconds, status); one with no time left is recorded as skipped; a
# failing one never stops the next. Then the merge into the results file, the README's and docs'
# results (regenerated), and with $OUT set the copies there.
#
# --dry-run (BERT_FAST_CHECK_DRY_RUN=1): every stage of both lease calls (or of BERT_FAST_CHECK_PLAN)
# on this CPU, in a temporary copy of the tree (nothing tracked is written; the copy is printed),
# through the same code at CPU sizes: the tiny model, --device cpu, one thread, batch / 8 and
# seq / 8, the doctor's CPU shapes, a few test files (BERT_FAST_CHECK_DRY_TESTS), budget x3; setup.py
# build_ext --inplace in place of pip install -e (the venv stays as it is); cuda-build is recorded
# "skipped: dry run". $OUT defaults to the copy's out/ (BERT_FAST_CHECK_DRY_DIR: where copies go;
# BERT_FAST_CHECK_FETCH=0: no wheels fetched).
#
# Environment: PYTHON (python3), BERT_FAST_CHECK_BUDGET_S, BERT_FAST_CHECK_SKIP_INSTALL=1,
# BERT_FAST_CHECK_COMMIT, BERT_FAST_CHECK_ONLY / BERT_FAST_CHECK_SKIP="NAME ..." (glob patterns: run
# only those stages / skip those; the others are recorded as skipped).
#
# --detach / --wait S (a check longer than one command, on a machine that keeps it): --detach starts
# it in its own session (setsid nohup, log in $BERT_FAST_CHECK_LOG, default /tmp/gpu_check.log) and
# returns; each --wait S blocks until it ends or S seconds pass (exit 0 once ended, with the results
# copied into $OUT; 3 while it runs). Call --wait again at once: an idle machine is given back.

set -u -o pipefail

CHECK_LOG="${BERT_FAST_CHECK_LOG:-/tmp/gpu_check.log}"
CHECK_DONE="$CHECK_LOG.done"          # written at the end: "<exit status> <results name>"
PY="${PYTHON:-python3}"
# shellcheck source=benchmarks/gpu_check_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_check_lib.sh"

case "${1:-}" in
    --dry-run) shift; export BERT_FAST_CHECK_DRY_RUN=1 ;;
    --detach) shift; detach "${BASH_SOURCE[0]}" "$@"; exit $? ;;
    --wait) wait_detached "${2:-540}"; exit $? ;;
esac
DRY="${BERT_FAST_CHECK_DRY_RUN:-0}"
if [ "$DRY" = 1 ] && [ "${BERT_FAST_CHECK_IN_COPY:-0}" != 1 ]; then
    dry_run "${BASH_SOURCE[0]}" "$@"
    exit $?
fi

START=$(date +%s)                # the budget counts from here
[ "${BERT_FAST_CHECK_DETACHED:-0}" = 1 ] && echo $$ > "$CHECK_LOG.pid"
rm -f "$CHECK_DONE"
ROOT="$LIB_ROOT"
cd "$ROOT" || exit 1
PLAN="${BERT_FAST_CHECK_PLAN:-}"
BUDGET="${BERT_FAST_CHECK_BUDGET_S:-}"
if [ -z "$PLAN" ]; then if (( ${BUDGET:-1500} < 900 )); then PLAN=lease; else PLAN=full; fi; fi
case "$PLAN" in
    lease) BUDGET=${BUDGET:-380} ;;
    measure) BUDGET=${BUDGET:-480} ;;
    full) BUDGET=${BUDGET:-1500} ;;
    *) echo "unknown BERT_FAST_CHECK_PLAN=$PLAN (lease, measure or full)"; exit 2 ;;
esac
RESERVE=60                       # kept for the merge, the plots and the copies
[ "$DRY" = 1 ] && BUDGET=$(( BUDGET * 3 ))   # the CPU is slower: the same caps, more time in all
if [ "$PLAN" != full ]; then
    RESERVE=25
    export BERT_FAST_AUTOTUNE=0
    # one architecture instead of three: the build's nvcc passes are serial, ~3x shorter
    if [ -z "${BERT_FAST_CUDA_ARCHS:-}" ]; then
        ARCH=$("$PY" -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}-real')" 2>/dev/null)
        [ -n "$ARCH" ] && export BERT_FAST_CUDA_ARCHS="$ARCH"
    fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
use_wheels

DATE=$(date -u +%Y%m%d-%H%M%S)
COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [ "$COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    COMMIT="${COMMIT}-dirty"
fi
# A leased machine gets the working tree over the .git of an older snapshot (seen: every H200 run
# named the session's first commit, "-dirty"): pass the commit from where the tree came from.
COMMIT="${BERT_FAST_CHECK_COMMIT:-$COMMIT}"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
if [ -z "$GPU" ]; then
    GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no-gpu')" 2>/dev/null || echo unknown)
fi
[ "$DRY" = 1 ] && GPU="cpu dry run"
GPU_SLUG=$(printf '%s' "$GPU" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia//g; s/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
NAME="${DATE}-${GPU_SLUG:-gpu}-${COMMIT}-${PLAN}"
RESULTS="$ROOT/benchmarks/results"
RUN_DIR="$RESULTS/$NAME"
mkdir -p "$RUN_DIR"
STAGES="$RUN_DIR/stages.tsv"
: > "$STAGES"
FAILED=0
echo "GPU check $NAME  (device: $GPU, commit: $COMMIT, budget ${BUDGET}s, plan $PLAN, dry run $DRY)"
echo "results: $RESULTS/$NAME.json and $RUN_DIR/"

# What differs in a dry run: the sizes, the device, the test files; the code run is the same.
if command -v bert-fast >/dev/null 2>&1; then BF=(bert-fast); else BF=("$PY" -m bert_fast); fi
TL=("$PY" benchmarks/model/gpu_timeline.py)
if [ "$DRY" = 1 ]; then
    export OMP_NUM_THREADS=1      # one thread: two on a shared 2-core machine run ~100x slower
    MODELS=(tiny); DEV=(--device cpu); WORKERS=2
    read -ra TESTS <<< "${BERT_FAST_CHECK_DRY_TESTS:-tests/model/test_padding.py tests/bench/test_bench_fallback_flag.py}"
    DOCTOR=(--device cpu --shapes minilm --dtypes fp32 --layouts dense)
    INSTALL=("$PY" setup.py build_ext --inplace)
    ROUNDS=(--warmup 1 --min-rounds 2 --iters 3 --max-seconds 2 --threads 1 --in-process)
    TL_ROUNDS=(--warmup 1 --calls 2)
else
    MODELS=(bert-base bert-large); DEV=(); WORKERS=12; TESTS=(tests)
    # the lease's suite leaves out what runs the same without a GPU (tests/conftest.py)
    [ "$PLAN" != full ] && export BERT_FAST_TEST_GPU_ONLY=1
    # attention last: it passed 72/72 on 11-28 (its kernels unchanged since); the others never ran
    DOCTOR=(--ops embedding,linear,bias_gelu,residual_layer_norm,attention)
    INSTALL=("$PY" -m pip install --no-build-isolation --no-deps -e .)
    ROUNDS=(--warmup 5 --iters 30 --max-seconds 8)
    TL_ROUNDS=()
fi
[ "$PLAN" = full ] && [ "$DRY" != 1 ] && { WORKERS=4; ROUNDS=(--warmup 5 --iters 30 --max-seconds 20); }

# shape B S: the shape a case runs at (a dry run: batch / 8, seq / 8)
shape() { if [ "$DRY" = 1 ]; then echo "$(( $1 >= 8 ? $1 / 8 : 1 ))x$(( $2 / 8 ))"; else echo "$1x$2"; fi; }

# The grid, in order of value: kind batch seq lengths mode cap [flags]
GRID=(
    "graphs 1 128 full infer 100 --cuda-graphs"
    "dense 32 128 full infer 130"
    "graphs 32 128 full infer 100 --cuda-graphs"
    "dense 128 128 full infer 130"
    "padded 16 512 random:0.2 infer 130"
    "train 32 128 full train-mlm 160"
    "train 8 512 full train-mlm 160"
)
TL_CASES="fwd-$(shape 1 128)-graphs,fwd-$(shape 1 128),fwd-$(shape 32 128),train-$(shape 32 128)"
WARM_CASES=$(for line in "${GRID[@]}"; do
    read -r kind b s lengths mode _ <<< "$line"
    case $kind in graphs) echo "fwd-$(shape "$b" "$s")-graphs" ;; dense) echo "fwd-$(shape "$b" "$s")" ;;
        padded) echo "fwd-$(shape "$b" "$s")-padded" ;; train) echo "train-$(shape "$b" "$s")" ;; esac
done | paste -sd, -)

# case_stage MODEL LINE PROVIDERS [SUFFIX]: one case in GRID's form for MODEL, its own stage (named
# kind-BxS-model[-SUFFIX]); with --solo among its flags the rounds drop the dry run's --in-process
case_stage() {
    local model=$1 kind b s lengths mode cap flags bs name r rounds=()
    read -r kind b s lengths mode cap flags <<< "$2"
    bs=$(shape "$b" "$s")
    name="$kind-$bs-$model${4:+-$4}"
    for r in "${ROUNDS[@]}"; do [[ $r == --in-process && $flags == *--solo* ]] || rounds+=("$r"); done
    # shellcheck disable=SC2086
    run_stage "$name" "$cap" "$RUN_DIR/$name.log" "${BF[@]}" bench --model "$model" --batch "${bs%x*}" \
        --seq "${bs#*x}" --mode "$mode" --lengths "$lengths" --dtype bf16 --providers "$3" --no-progress \
        ${rounds[@]+"${rounds[@]}"} ${DEV[@]+"${DEV[@]}"} $flags --json "$RUN_DIR/model-$name.json"
}

# grid MODEL INFER_PROVIDERS TRAIN_PROVIDERS [SUFFIX]: every case of GRID for MODEL (case_stage);
# TRAIN_PROVIDERS "-": no training cases
grid() {
    local line providers
    for line in "${GRID[@]}"; do
        providers=$2; [[ $line == *train-mlm* ]] && providers=$3
        [ "$providers" = - ] && continue
        case_stage "$1" "$line" "$providers" "${4:-}"
    done
}

# the setup of every plan: install (measure: only where the extension is missing), info, cuda-build
setup() {
    local built="import sys, bert_fast; b = bert_fast.build_info(); sys.exit(not (b.get('extension_loaded') and b.get('cuda_compiled')))"
    if [ "${BERT_FAST_CHECK_SKIP_INSTALL:-0}" = 1 ]; then skip_stage install "BERT_FAST_CHECK_SKIP_INSTALL=1"
    elif [ "$PLAN" = measure ] && "$PY" -c "$built" 2>/dev/null; then skip_stage install "the extension is built here"
    else run_stage install 300 "$RUN_DIR/install.log" "${INSTALL[@]}"
    fi
    if [ "$PLAN" = measure ]; then skip_stage info "the measure plan (call 1 recorded it)"
    else run_stage info 90 "$RUN_DIR/info.log" "${BF[@]}" info --json "$RUN_DIR/info.json"
    fi
    # a build without nvcc still installs (CPU part only) and every later stage would quietly measure
    # the embedding's fallback: make that a failed stage
    if [ "$DRY" = 1 ]; then skip_stage cuda-build "dry run: the CUDA kernel's build needs nvcc and a GPU to check"
    else run_stage cuda-build 30 "$RUN_DIR/cuda-build.log" "$PY" -c "import sys, bert_fast; b = bert_fast.build_info(); \
print(b); sys.exit(0 if b.get('cuda_compiled') else 'the CUDA kernel was not compiled (nvcc not found?)')"
    fi
}

# correctness, the lease's way: the doctor, the suite and warm at once (they share the GPU; nothing
# is timed), leaving a minute for the timeline on the quiet GPU
correctness_at_once() {
    local left cap xdist=()
    "$PY" -c "import xdist" 2>/dev/null && xdist=(-n "$WORKERS" --dist worksteal)
    left=$(( BUDGET - ($(date +%s) - START) - RESERVE ))
    cap=$(( left - 60 ))
    (( cap < 120 )) && cap=$left
    run_stage doctor "$cap" "$RUN_DIR/doctor.log" "${BF[@]}" doctor --timeout 60 "${DOCTOR[@]}" \
        --json "$RUN_DIR/doctor.json" > /dev/null &
    run_stage warm "$cap" "$RUN_DIR/warm.log" "${TL[@]}" --warm-only --models "$(IFS=,; echo "${MODELS[*]}")" \
        --cases "$WARM_CASES" ${DEV[@]+"${DEV[@]}"} --out "$RUN_DIR/timeline" > /dev/null &
    run_stage tests "$cap" "$RUN_DIR/pytest.log" "$PY" -m pytest "${TESTS[@]}" -q -rfEs -p no:cacheprovider \
        -o timeout=120 ${xdist[@]+"${xdist[@]}"} --junitxml="$RUN_DIR/pytest.xml"
    wait
    end_leftovers
    tail -3 "$RUN_DIR/doctor.log" 2>/dev/null
}

# tune_dispatch CAP: the linear dispatch table (our GEMM, autotuned as users run it, or cuBLAS + our
# bias+GELU, per shape) at bert-base's GEMMs for the grid's token counts, FFN shapes first; a cut
# run keeps what it measured (bert_fast/data/linear_dispatch.json comes back in the tarball)
tune_dispatch() {
    if [ "$DRY" = 1 ]; then skip_stage tune-dispatch "dry run: it measures GPU GEMMs"; return 0; fi
    run_stage tune-dispatch "$1" "$RUN_DIR/tune-dispatch.log" env BERT_FAST_AUTOTUNE=1 TRITON_PRINT_AUTOTUNING=1 \
        "$PY" benchmarks/ops/tune_linear_dispatch.py --hidden 768 --tokens 4096 16384 128 --dtypes bf16
}

timeline() {
    run_stage timeline 90 "$RUN_DIR/timeline.log" "${TL[@]}" --model "${MODELS[0]}" --cases "$TL_CASES" \
        ${TL_ROUNDS[@]+"${TL_ROUNDS[@]}"} ${DEV[@]+"${DEV[@]}"} --out "$RUN_DIR/timeline"
}

RIVALS=bert_fast,hf-sdpa,hf-compile
setup
case "$PLAN" in
    lease)
        correctness_at_once
        # not the timeline here: call 2 takes it on a quiet GPU (11-28: 26 ms here beside the suite's
        # leftovers, 15.7 ms there); the FFN up-projection's backend is the open kernel question
        tune_dispatch 300
        ;;
    measure)
        # hf-compile apart, after every case against hf-sdpa: a stage cut by its cap loses all its
        # figures, and max-autotune's compile (minutes per shape) must not take bert_fast's with it
        grid "${MODELS[0]}" bert_fast,hf-sdpa bert_fast,hf-sdpa
        timeline
        # no training step under max-autotune here: its compile outran the stage's 160 s on 11-28
        grid "${MODELS[0]}" bert_fast,hf-compile - compile
        for model in "${MODELS[@]:1}"; do grid "$model" bert_fast,hf-sdpa bert_fast,hf-sdpa; done
        # last, the first GPU run of --solo: the headline pair each alone in its own process (beside
        # torch.compile in one process our eager forward measured 1.1-1.7x slower on 11-28)
        case_stage "${MODELS[0]}" "dense 32 128 full infer 150 --solo" bert_fast,hf-compile solo
        ;;
    full)
        run_stage doctor 300 "$RUN_DIR/doctor.log" env BERT_FAST_AUTOTUNE=0 "${BF[@]}" doctor --timeout 120 \
            ${DOCTOR[@]+"${DOCTOR[@]}"} --json "$RUN_DIR/doctor.json"
        XDIST=()
        "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$WORKERS" --dist loadfile)
        run_stage tests 540 "$RUN_DIR/pytest.log" env BERT_FAST_AUTOTUNE=0 "$PY" -m pytest "${TESTS[@]}" -q -rs \
            ${XDIST[@]+"${XDIST[@]}"} --junitxml="$RUN_DIR/pytest.xml"
        # from here on the kernels autotune; the logs record every winner (key, config, sweep time)
        export TRITON_PRINT_AUTOTUNING=1
        # the linear dispatch table at the grid's shapes (M buckets 128, 4096, 8192: the padded 16x512
        # batch, 16384), before the grid, which then runs the measured choice
        tune_dispatch 180
        grid "${MODELS[0]}" "bert_fast,hf-eager,$RIVALS" "$RIVALS,hf-trainer"
        timeline
        for model in "${MODELS[@]:1}"; do grid "$model" "bert_fast,hf-eager,$RIVALS" "$RIVALS,hf-trainer"; done
        run_stage bench-ops 360 "$RUN_DIR/bench-ops.log" "${BF[@]}" bench-ops --no-progress --dtype bf16 \
            --warmup 10 --iters 50 --max-seconds 3 ${DEV[@]+"${DEV[@]}"} --json "$RUN_DIR/ops.json" --plot "$RUN_DIR/ops.png"
        # last: it repeats what the CLI measured, the first thing a tight budget drops
        run_stage pytest-bench 180 "$RUN_DIR/pytest-bench.log" "$PY" -m pytest benchmarks -q -o python_files='bench_*.py' \
            --benchmark-json="$RUN_DIR/pytest-benchmark.json" --benchmark-max-time=0.5 --benchmark-min-rounds=5
        ;;
esac
# background stages set FAILED in their own subshell: read it back from the stage table
grep -q -v -P '\t(ok|skipped: .*)$' "$STAGES" && FAILED=1

# the merge into one results file (run as a script path: works even when bert_fast does not import)
MODEL_JSONS=(); TIMELINES=()
for f in "$RUN_DIR"/model-*.json; do [ -e "$f" ] && MODEL_JSONS+=("$f"); done
for f in "$RUN_DIR"/timeline/fwd-*.json "$RUN_DIR"/timeline/train-*.json; do [ -e "$f" ] && TIMELINES+=("$f"); done
NOTES=(--note "plan $PLAN, budget ${BUDGET}s, commit $COMMIT")
[ "$PLAN" != full ] && NOTES+=(--note "BERT_FAST_AUTOTUNE=0: the kernels ran their fixed configs")
[ "$DRY" = 1 ] && NOTES+=(--note "dry run on the CPU (tiny model, CPU sizes, one thread): it checks the script; no figure here is a GPU's")
"$PY" "$ROOT/bert_fast/bench/results.py" merge --out "$RESULTS/$NAME.json" --run-dir "$RUN_DIR" \
    --stages "$STAGES" --info "$RUN_DIR/info.json" --ops "$RUN_DIR/ops.json" --model ${MODEL_JSONS[@]+"${MODEL_JSONS[@]}"} \
    --pytest-log "$RUN_DIR/pytest.log" --pytest-xml "$RUN_DIR/pytest.xml" --timelines ${TIMELINES[@]+"${TIMELINES[@]}"} \
    --pytest-bench "$RUN_DIR/pytest-benchmark.json" --plot "$RUN_DIR/summary.png" --doctor "$RUN_DIR/doctor.json" \
    "${NOTES[@]}" || { echo "merge FAILED"; FAILED=1; }
# the README's Performance section and the docs' results pages from the results (the tarball
# carries them back); a dry run renders its own CPU results, in its copy
ALLOW_CPU=(); [ "$DRY" = 1 ] && ALLOW_CPU=(--allow-cpu)
"$PY" "$ROOT/benchmarks/report/make_readme_performance.py" --results-dir "$RESULTS" --readme "$ROOT/README.md" \
    ${ALLOW_CPU[@]+"${ALLOW_CPU[@]}"} || echo "README Performance section not regenerated"
"$PY" "$ROOT/benchmarks/report/make_docs_results.py" --root "$ROOT" || echo "docs results pages not regenerated"

copy_out "$NAME"
echo
echo "== stages (name, rc, seconds, status)"
cat "$STAGES"
echo "results: $RESULTS/$NAME.json"
echo "total: $(( $(date +%s) - START ))s"
echo "GPU check exit status $FAILED"
echo "$FAILED $NAME" > "$CHECK_DONE"
exit $FAILED
