#!/usr/bin/env bash
# Verify and measure the checkout on a GPU machine in as few device calls as possible (a
# cold start costs a minute of a 30-minute budget). Every step logs to its own file and
# the run goes on past a failing step; a summary with each step's status and the tail of
# its log ends the output, and everything is packed into $OUT/session.tgz (the device tool
# returns at most 8 files, 2 folders down).
#
#   source .device/env.sh && CSA_COMMIT=<hash> bash tools/gpu_session.sh [STEP ...]
#
# Steps (default: check):
#   info      package, torch, DSL and GPUs
#   tests     python -m pytest -q -m gpu tests (the two-GPU tests run where 2 GPUs are seen)
#   sanitize  compute-sanitizer memcheck over tools/sanitize_probe.py (every kernel family,
#             corrupt offsets too)
#   sanitize_candidates  the same with every kernel candidate of config.py switched on
#   bench     python -m csa_compressor bench (default shapes, eager / compile / fused)
#   scale     fused and eager on 2048x64 vs 1x131072 and the other EXTRA shapes
#   host      tools/perf_probe.py host (wall clock of each layer of a call, outside graphs)
#   sweep     tools/perf_probe.py sweep "$SWEEP" (A/B of kernel-shaping constants in one run)
#   check     info tests sanitize          (about 5 minutes)
#   measure   bench scale host             (about 5 minutes)
# A device call has 10 minutes: run `check` and `measure` as two calls.

set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}
WORK=$(mktemp -d)
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
    echo "== $name: $*" | tee "$WORK/$name.log"
    "$@" >>"$WORK/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" >>"$WORK/summary.txt"
    echo "== $name rc=$rc $((SECONDS - t0))s"
}

for s in "${expanded[@]}"; do
    case $s in
        info) run_step info bash -c 'nvidia-smi -L; python3 -m csa_compressor info' ;;
        tests) run_step tests python3 -m pytest -q -m gpu tests -rs ;;
        sanitize) run_step sanitize compute-sanitizer --tool memcheck --report-api-errors no \
            python3 tools/sanitize_probe.py ;;
        sanitize_candidates) run_step sanitize_candidates env \
            CSA_CONFIG=BWD_CACHED_WALK=1,BWD_APE_REGS=1,WARP_SEGMENT_SEARCH=1,STATIC_SLOT_OFFSETS=1,BF16_BIT_WIDEN=1 \
            compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_probe.py ;;
        bench) run_step bench python3 -m csa_compressor bench --out "$WORK/bench" ;;
        scale) run_step scale python3 -m csa_compressor bench --impls eager,fused \
            --shapes 2048x64:128:4:2,1x131072:128:4:2,1x8192:65:3:2 --out "$WORK/scale" ;;
        host) run_step host python3 tools/perf_probe.py host ;;
        sweep) run_step sweep python3 tools/perf_probe.py sweep "${SWEEP:?set SWEEP, e.g. BWD_CACHED_WALK=0;BWD_CACHED_WALK=1}" \
            "${SWEEP_SHAPES:-1x8192:128:4:2,3x8192:128:4:2,3x8192:512:4:2,1023+2048+509+3+0+77:128:4:2,2048x64:128:4:2}" ;;
        *) echo "unknown step $s" >>"$WORK/summary.txt" ;;
    esac
done

mkdir -p "$OUT"
tar czf "$OUT/session.tgz" -C "$WORK" .
echo
echo "######## summary (commit $CSA_COMMIT)"
cat "$WORK/summary.txt"
for s in "${expanded[@]}"; do
    [ -f "$WORK/$s.log" ] || continue
    echo "######## $s (tail)"
    tail -n 25 "$WORK/$s.log"
done
