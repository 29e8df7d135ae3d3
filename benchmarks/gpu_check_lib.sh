# The machinery of benchmarks/gpu_check.sh (sourced by it): the stages, the copies into $OUT, the
# dry run's copy of the tree, --detach / --wait. What the check runs is in gpu_check.sh.

# module:package of what a lease carries as wheels in .whl/ (the GPU image lacks some, and has no
# index): the suite's workers, its per-test timeout, pybind11 for the build
WHEELS="xdist:pytest-xdist execnet:execnet pytest_timeout:pytest-timeout pybind11:pybind11"
LIB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# listed NAME "PATTERNS": NAME matches one of the glob patterns (read without expanding them)
listed() {
    local p pats
    read -ra pats <<< "$2"
    for p in ${pats[@]+"${pats[@]}"}; do [[ $1 == $p ]] && return 0; done
    return 1
}

skip_stage() {  # NAME WHY
    printf '%s\t%s\t%s\t%s\n' "$1" skipped 0 "skipped: $2" >> "$STAGES"
    echo "== [$1] SKIPPED: $2"
}

# run_stage NAME CAP_SECONDS LOG CMD...: CMD under timeout (min of its cap and what is left of the
# budget), its output teed to LOG, recorded in $STAGES; not asked for or out of time: skipped.
run_stage() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left limit t0 rc dt status
    if [ -n "${BERT_FAST_CHECK_ONLY:-}" ] && ! listed "$name" "$BERT_FAST_CHECK_ONLY"; then
        skip_stage "$name" "not in BERT_FAST_CHECK_ONLY"; return 0
    fi
    if listed "$name" "${BERT_FAST_CHECK_SKIP:-}"; then skip_stage "$name" "in BERT_FAST_CHECK_SKIP"; return 0; fi
    left=$(( BUDGET - ($(date +%s) - START) - RESERVE ))
    if (( left < 20 )); then skip_stage "$name" "time budget exhausted"; return 0; fi
    limit=$(( cap < left ? cap : left ))
    # the host's load at the start: a figure taken beside leftover work shows it here
    echo "== [$name] (limit ${limit}s, load $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)): $*"
    t0=$(date +%s)
    # every process of a stage carries BERT_FAST_CHECK_STAGE (end_leftovers finds them by it)
    timeout --signal=INT --kill-after=30 "$limit" env BERT_FAST_CHECK_STAGE="$NAME" "$@" < /dev/null 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    dt=$(( $(date +%s) - t0 ))
    if (( rc == 0 )); then status=ok
    elif (( rc == 124 )); then status="timeout after ${limit}s"; FAILED=1
    else status=failed; FAILED=1
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$status" >> "$STAGES"
    echo "== [$name] $status (rc=$rc, ${dt}s)"
}

# end_leftovers: kill what this run's stages left running, found by the variable run_stage gives
# them (11-28: a stage's timeout stops pytest and the doctor, but xdist workers or doctor children
# caught mid-CUDA-call can outlive them and share the GPU and CPUs with the figures that follow)
end_leftovers() {
    local env pid left=()
    for env in /proc/[0-9]*/environ; do
        pid=${env#/proc/}; pid=${pid%/environ}
        { tr '\0' '\n' < "$env"; } 2>/dev/null | grep -qx "BERT_FAST_CHECK_STAGE=$NAME" && left+=("$pid")
    done
    (( ${#left[@]} )) && { echo "killing leftovers of the stages: ${left[*]}"; kill -KILL "${left[@]}" 2>/dev/null; }
    return 0
}

# use_wheels: the tree's own code first on the path (an image's venv may hold another checkout's
# editable install), then what the image lacks of WHEELS, installed from .whl/ into .whl/site
use_wheels() {
    local w need=()
    export PYTHONPATH="$LIB_ROOT:$LIB_ROOT/.whl/site${PYTHONPATH:+:$PYTHONPATH}"
    for w in $WHEELS; do "$PY" -c "import ${w%%:*}" 2>/dev/null || need+=("${w#*:}"); done
    if (( ${#need[@]} )) && ls "$LIB_ROOT"/.whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --find-links "$LIB_ROOT/.whl" --target "$LIB_ROOT/.whl/site" \
            "${need[@]}" || echo "note: could not install ${need[*]} from .whl/"
    fi
}

# copy_out NAME: the results of run NAME into $OUT (a json, one tarball, the README). A lease
# returns files of up to 16 MiB: over 15, the tarball is made again without the traces and logs.
copy_out() {
    local name=$1 tgz
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT"
    tgz="$OUT/$name.tar.gz"
    cp "$LIB_ROOT/benchmarks/results/$name.json" "$OUT/" 2>/dev/null
    pack "$name" "$tgz"
    if (( $(stat -c %s "$tgz") > 15 * 1024 * 1024 )); then
        pack "$name" "$tgz" --exclude='*.trace.json.gz' --exclude='*.log'
        echo "note: the tarball was over 15 MiB: made again without the traces and logs"
    fi
    cp "$LIB_ROOT/README.md" "$OUT/README.md" 2>/dev/null
    echo "copied results to $OUT: $name.json $name.tar.gz README.md"
}

pack() {  # NAME TARBALL [TAR OPTIONS]: the run's files, the README and what the run regenerated
    local name=$1 tgz=$2
    shift 2
    tar -czf "$tgz" "$@" -C "$LIB_ROOT" "benchmarks/results/$name.json" "benchmarks/results/$name" \
        README.md docs/results bert_fast/data/linear_dispatch.json 2>/dev/null
}

# dry_run SCRIPT ARGS...: SCRIPT on this CPU in a temporary copy of the tree (the files git does not
# ignore, as a lease copies them, plus what the calls carry: the built extension and .whl/, whose
# wheels are fetched first), each plan in turn; the copy imports its own code, kernels/ included.
dry_run() {
    local script=$1 copy plan rc=0
    shift
    if [ "${BERT_FAST_CHECK_FETCH:-1}" = 1 ] && ! ls "$LIB_ROOT"/.whl/pybind11-*.whl >/dev/null 2>&1; then
        # shellcheck disable=SC2046
        "$PY" -m pip download -q --no-deps -d "$LIB_ROOT/.whl" $(for w in $WHEELS; do echo "${w#*:}"; done) \
            || echo "note: no wheels fetched into .whl/"
    fi
    copy=$(mktemp -d "${BERT_FAST_CHECK_DRY_DIR:-${TMPDIR:-/tmp}}/gpu_check_dry.XXXXXX") || return 1
    (cd "$LIB_ROOT" && git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf -) \
        2>/dev/null | tar -xf - -C "$copy" || return 1
    cp -a "$LIB_ROOT"/bert_fast/_C*.so* "$copy/bert_fast/" 2>/dev/null
    [ -d "$LIB_ROOT/.whl" ] && cp -a "$LIB_ROOT/.whl" "$copy/"
    [ -e "$copy/bert_fast/kernels" ] || ln -s ../kernels "$copy/bert_fast/kernels"
    export BERT_FAST_CHECK_COMMIT="${BERT_FAST_CHECK_COMMIT:-$(git -C "$LIB_ROOT" rev-parse --short=12 HEAD 2>/dev/null)}"
    export OUT="${OUT:-$copy/out}" BERT_FAST_CHECK_IN_COPY=1
    for plan in ${BERT_FAST_CHECK_PLAN:-lease measure}; do
        BERT_FAST_CHECK_PLAN=$plan bash "$copy/benchmarks/${script##*/}" "$@" || rc=1
    done
    echo "dry run done (exit status $rc): the copy $copy, files in $OUT"
    return $rc
}

# detach SCRIPT ARGS...: SCRIPT in its own session (setsid nohup), log in $CHECK_LOG; returns at once.
detach() {
    local script=$1
    shift
    if [ -f "$CHECK_LOG.pid" ] && kill -0 "$(cat "$CHECK_LOG.pid")" 2>/dev/null; then
        echo "a GPU check is already running (pid $(cat "$CHECK_LOG.pid")); log: $CHECK_LOG"
        return 0
    fi
    rm -f "$CHECK_DONE"
    # OUT of this call is emptied before the next one: the detached run must not copy there.
    env -u OUT BERT_FAST_CHECK_DETACHED=1 setsid nohup bash "$script" "$@" > "$CHECK_LOG" 2>&1 < /dev/null &
    echo $! > "$CHECK_LOG.pid"
    echo "GPU check started detached (pid $!), log: $CHECK_LOG"
    echo "next: bash benchmarks/gpu_check.sh --wait 540   (call again at once while it runs)"
}

# wait_detached SECONDS: until the detached check ends (0, its results copied into $OUT) or
# SECONDS pass (3); 1 when it died without finishing.
wait_detached() {
    local limit=${1:-540} t0 rc name
    t0=$(date +%s)
    while [ ! -f "$CHECK_DONE" ] && (( $(date +%s) - t0 < limit )); do
        if [ -f "$CHECK_LOG.pid" ] && ! kill -0 "$(cat "$CHECK_LOG.pid")" 2>/dev/null; then
            sleep 3     # (the run writes its own pid first thing; setsid may have forked)
            if [ ! -f "$CHECK_DONE" ] && ! kill -0 "$(cat "$CHECK_LOG.pid")" 2>/dev/null; then
                echo "the detached GPU check died without finishing"; tail -40 "$CHECK_LOG"; return 1
            fi
        fi
        sleep 5
    done
    tail -40 "$CHECK_LOG" 2>/dev/null
    if [ -f "$CHECK_DONE" ]; then
        read -r rc name < "$CHECK_DONE"
        echo "GPU check finished: exit status $rc, results $name"
        copy_out "$name"
        return 0
    fi
    echo "GPU check still running after ${limit}s wait: call --wait again"
    return 3
}
