#!/usr/bin/env bash
# Verify and measure the checkout on a GPU machine in as few device calls as possible (a
# cold start costs a minute of a 30-minute budget). Each step writes $OUT/<step>.log as it
# runs (so a call killed at its time limit still returns what finished), bench output goes
# to $OUT/<step>.tgz, and $OUT/summary.txt collects each step's status and time. The run
# goes on past a failing step and ends with the summary and the tail of every log. The
# device tool returns at most 8 files: keep to about 4 steps a call.
#
#   source .device/env.sh && CSA_COMMIT=<hash> bash tools/gpu_session.sh [STEP ...]
#
# Steps (default: check):
#   info      package, torch, DSL and GPUs
#   tests     python -m pytest -q -m gpu tests (the two-GPU tests run where 2 GPUs are seen)
#   sanitize  compute-sanitizer memcheck over tools/sanitize_probe.py (every kernel family,
#             corrupt offsets too)
#   bench     python -m csa_compressor bench (default shapes, eager / compile / fused)
#   scale     fused and eager on 2048x64 vs 1x131072 and the other EXTRA shapes
#   host      tools/perf_probe.py host (wall clock of each layer of a call, outside graphs)
#   sweep     tools/perf_probe.py sweep "$SWEEP" (A/B of kernel-shaping constants in one run)
#   check     info tests sanitize
#   measure   bench scale host
# STEP_TIMEOUT (seconds, default 570) bounds each step.

set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
WORK=$(mktemp -d)  # bench output directories, packed into $OUT/<step>.tgz
export PYTHONUNBUFFERED=1
export CSA_COMMIT=${CSA_COMMIT:-unknown}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(check)
expanded=()
for s in "${steps[@]}"; do
    case $s in
        check) expanded+=(info tests sanitize) ;;
        measure) expanded+=(bench scale host) ;;
        *) expanded+=("$s") ;;
    esac
done

run_step() {
    local name=$1
    shift
    local t0=$SECONDS
    echo "== $name: $*" | tee "$OUT/$name.log"
    timeout "${STEP_TIMEOUT:-570}" "$@" >>"$OUT/$name.log" 2>&1
    local rc=$?
    if [ -d "$WORK/$name" ]; then
        tar czf "$OUT/$name.tgz" -C "$WORK" "$name"
    fi
    echo "$name rc=$rc $((SECONDS - t0))s" >>"$OUT/summary.txt"
    echo "== $name rc=$rc $((SECONDS - t0))s"
}

for s in "${expanded[@]}"; do
    case $s in
        info) run_step info bash -c 'nvidia-smi -L; python3 -m csa_compressor info' ;;
        tests) run_step tests python3 -m pytest -q -m gpu tests -rs --durations=15 ;;
        sanitize) run_step sanitize compute-sanitizer --tool memcheck --report-api-errors no \
            python3 tools/sanitize_probe.py ;;
        bench) run_step bench python3 -m csa_compressor bench --out "$WORK/bench" ;;
        scale) run_step scale python3 -m csa_compressor bench --impls eager,fused \
            --shapes 2048x64:128:4:2,1x131072:128:4:2,1x8192:65:3:2 --out "$WORK/scale" ;;
        host) run_step host python3 tools/perf_probe.py host ;;
        sweep) run_step sweep python3 tools/perf_probe.py sweep "${SWEEP:?set SWEEP, e.g. BWD_CACHED_WALK=0;BWD_CACHED_WALK=1}" \
            "${SWEEP_SHAPES:-1x8192:128:4:2,3x8192:128:4:2,3x8192:512:4:2,1023+2048+509+3+0+77:128:4:2,2048x64:128:4:2}" ;;
        *) echo "unknown step $s" >>"$OUT/summary.txt" ;;
    esac
done

echo
echo "######## summary (commit $CSA_COMMIT)"
cat "$OUT/summary.txt"
for s in "${expanded[@]}"; do
    [ -f "$OUT/$s.log" ] || continue
    echo "######## $s (tail)"
    tail -n 25 "$OUT/$s.log"
done
