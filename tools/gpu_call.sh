#!/usr/bin/env bash
# One device call that does as much as fits: the correctness runs side by side (they
# share the GPU, and compiles are CPU-bound on 16 cores), then the timing runs one at a
# time on a quiet GPU, each bounded by what is left of DEADLINE seconds. Logs collect in
# $WORK and are packed into $OUT/logs.tgz at the end (the device tool returns at most 8
# files); $OUT/progress.txt grows as steps finish, so a killed call still says how far
# it got.
# CSA_COMMIT: write the hash in as a literal from this machine; `git rev-parse` run on the
# device answers from the copy's stale git metadata, not the tree that runs.
#   source .device/env.sh && CSA_COMMIT=<hash> DEADLINE=560 bash tools/gpu_call.sh \
#       "par:info,tests_bounds,tests_fused,tests_rest,sanitize" "seq:host,bench,scale" \
#       "seq:ncu_1x8192:128:4:2"
# Steps:
#   info                 GPUs, torch, DSL, package
#   tests                the whole GPU suite; tests_bounds / tests_fused / tests_torch /
#                        tests_rest are its four shards (run them side by side; tests_rest
#                        alone outran 560 s beside five others on the H100: tests_rest_a and
#                        tests_rest_b split it),
#                        tests_fused_k a -k "$TESTS_K" subset
#   unpack               the carried tarballs: .megatron/megatron-lm-dev-*.tar.xz then the csa2
#                        overlay into $MEGATRON_LM_PATH (set it, e.g. /tmp/megatron-lm, for
#                        the whole call), .megatron/transformers-*.tar.xz into /tmp/hf
#   streaming            tests/test_uploads_gpu.py, test_streaming_gpu.py,
#                        test_streaming_ring_gpu.py and examples/streaming_generation.py
#   fresh_sanitize       compute-sanitizer memcheck over the prefill-into-empty-slots tests
#   streaming_bench      python -m csa_compressor bench --streaming; streaming_bench_base
#                        the same over $BASE_SRC's package
#   streaming_host       tools/streaming_host_probe.py (host time by piece, timelines);
#                        streaming_host_base the same over $BASE_SRC's package
#   decode_profile       tools/decode_profile.py: a captured decode step's kernels, r128 and r4
#   streaming_sync       tools/streaming_sync_probe.py: which host op of a prefill waits
#   streaming_sanitize   compute-sanitizer memcheck over examples/streaming_generation.py;
#                        streaming_inplace_sanitize over ratio 128's in-place decode tests
#   unpack_hf            .megatron/transformers-*.tar.xz alone into /tmp/hf (for hf, hf_bench)
#   hf                   tests/test_transformers_gpu.py with transformers 5.23 (/tmp/hf) first
#   hf_bench             tools/hf_bench.py (the adapter installed against not, training and generate)
#   bench_fp32r2         the fused pooling of fp32 8x4096 d512 ratio 2 coff 1 against its floor
#   csa2_bench           tools/csa2_bench.py: no APE against a zero APE, Megatron's CSA2Compressor step
#   fp32_wide            the fp32 GPU suites and csa2_bench with BWD_FP32_VEC_BYTES=8 (the 8-byte
#                        fp32 backward: its bits, then its time; needs MEGATRON_LM_PATH)
#   csa2                 tests/test_megatron_csa2_gpu.py (needs MEGATRON_LM_PATH with the overlay)
#   v41_tests            that, tests/test_module_v41_gpu.py, the no-APE and fp32-dscore GPU
#                        tests and test_fused_gpu -k float32; v41_module the module's alone
#   check                python -m csa_compressor check (the numerics gate)
#   pool_epilogue        tests/test_pool_epilogue_gpu.py (the pooling kernels with the epilogue)
#   pool_epilogue_probe  tools/pool_epilogue_probe.py: each direction inside vs by parts
#   sanitize             compute-sanitizer memcheck over tools/sanitize_probe.py
#   cache                tests/test_disk_cache_gpu.py with its cold and warm first-call times
#   fuzz                 tests/test_fuzz_gpu.py (hypothesis, 200 cases a property) under
#                        compute-sanitizer memcheck: the reliability figure
#   ddp                  examples/ddp_compressor.py under torchrun on two GPUs (NCCL,
#                        NVLink multicast off)
#   module_bench         python -m csa_compressor bench --module (the Compressor module's step)
#   module_profile       tools/module_profile.py: that step's kernels by name (torch.profiler)
#   bench_order          tools/bench_order_probe.py: the module bench's graphs timed in
#                        forward, reverse and sequential order, the SM clock of each
#   module_host          tools/module_host_profile.py: the module step's host time outside
#                        graphs against its wall time, and cProfile of it (d128 rotate)
#   launch_host          tools/launch_host_probe.py: host µs a call of the step's pieces
#                        (torch launches, the small kernels, dispatch, the ops, the module)
#                        launch_host_base: the same of $BASE_SRC's tree
#   host_pieces          tools/host_pieces_probe.py: host µs of a prefill's pieces, each alone
#   op_host              tools/op_host_profile.py: cProfile of the op, the kernel API and prefill;
#                        op_host_base the same of $BASE_SRC's tree
#   colsum_order         tools/torch_colsum_order_probe.py: torch's dim-0 fp32 sum (the
#                        norm weight's gradient) against softmax_order's model of its order
#   colsum_time          the same probe's timing mode: the column sum's µs a call in graphs
#                        against torch's; colsum_time_base the same of $BASE_SRC's tree
#   sbhd_bench           python -m csa_compressor bench --sbhd (SBHD in place vs transposed)
#   megatron_host        tools/megatron_host_probe.py: Megatron's d512 r128 SBHD and pre-grouped
#                        steps, eager and installed: host µs, syncs, cProfile (MEGATRON_LM_PATH)
#   grouped_tests        the grouped layout's GPU tests, Megatron's (its pre-grouped path) and
#                        the malformed-offsets ones
#   epilogue_tests       the epilogue node's and the pooling-with-epilogue kernels' GPU tests
#   megatron_bench       tools/megatron_bench.py: Megatron's Compressor step, eager vs installed
#                        vs installed with the fused epilogue and one projection GEMM
#                        (needs MEGATRON_LM_PATH); megatron_bench_f16 the same with the norm
#                        weight in bf16 as Float16Module leaves it, and the THD kernel lists;
#                        megatron_bench_ddp inside Megatron's DDP (its parameter buffers)
#                        megatron_bench_base the same over $BASE_SRC's package
#   eager                the numerics="eager" GPU tests, with the printed ulps of the module
#                        against Megatron's own eager Compressor (needs MEGATRON_LM_PATH)
#   megatron_epilogue    the install(epilogue=True) GPU tests with their printed ulps against
#                        Megatron's own epilogue (needs MEGATRON_LM_PATH)
#   bench, scale         python -m csa_compressor bench (default shapes; 2048x64 vs 1x131072)
#   bench_eager          the bench's eager, fused and fused_eager (numerics="eager") rows
#   bench_plan           the bench's fused rows beside fused_plan (a PoolPlan's runs, no guard)
#   bench_fused          the bench's fused rows alone; bench_base the same of the package
#                        tree in $BASE_SRC (another commit's src/, labelled $BASE_COMMIT):
#                        run them in turn for a before/after on one loan
#   host                 tools/perf_probe.py host (events, then perf_counter per layer)
#   floor                tools/perf_probe.py floor (1-3 empty kernels a call; near-empty packs)
#   parts                tools/perf_probe.py parts (fwd, bwd kernel, its row and zero-fill
#                        CTAs, dape sum each on its own) over $PARTS_SHAPES (comma-separated)
#                        or the five default shapes
#   reads                tools/perf_probe.py reads (a read-only stream, a torch copy and our
#                        forward over each shape's forward bytes, then three streaming launches
#                        and our step over a forward + backward step's: the ceilings under the
#                        method; SETS=1 in the environment: every call on the same inputs)
#   latency              tools/latency_probe.py (launch + k dependent loads against our kernels at 1x4)
#   sweep<N>             tools/perf_probe.py sweep "$SWEEP_<N>" over $SWEEP_SHAPES_<N>, else
#                        $SWEEP_SHAPES, else the 5 default shapes; SWEEP_DTYPE=float32 (default bfloat16)
#   ncu_<shape>          ncu of the forward, backward and dape reduction of one bench shape
#                        (the probe runs 4 steps, the first two are skipped)
#   ncustall_<shape>     the forward's and backward's stall reasons in full and their most
#                        stalled SASS lines; the backward's per-SASS-line counters as CSV
#                        into $OUT/ncu_source_bwd.csv
#   ncuinst_<shape>      the same kernels' executed-instruction counts by opcode and their
#                        hottest SASS lines (InstructionStats, SourceCounters): where a
#                        row's instructions go (docs/lab/ceilings.md, the issue floor)
# ONLY_ON=H200: run nothing unless the GPU's name holds that text (a call for an H200 may
# land on an H100, whose timings do not stand in for the H200's); the name goes to progress.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_call}
mkdir -p "$OUT"
if [ -n "${ONLY_ON:-}" ] && ! nvidia-smi -L | grep -q "$ONLY_ON"; then
    echo "not on $ONLY_ON: $(nvidia-smi -L | head -1); nothing run" | tee -a "$OUT/progress.txt"
    exit 0
fi
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 CSA_COMMIT=${CSA_COMMIT:-unknown}
END=$((SECONDS + ${DEADLINE:-560}))

# ncu over the forward, backward and dape sum of the profile probe's third and fourth steps.
NCU="ncu --clock-control none -k regex:'Pool|Dape|reduce_kernel' --launch-skip 6 --launch-count 3"

cmd_of() {
    case $1 in
        info) echo "nvidia-smi -L; python3 -m csa_compressor info" ;;
        tests_bounds) echo "python3 -m pytest -q -m gpu tests/test_bounds_gpu.py -rs --durations=10" ;;
        tests_fused) echo "python3 -m pytest -q -m gpu tests/test_fused_gpu.py -rs --durations=10" ;;
        tests_torch) echo "python3 -m pytest -q -m gpu tests/test_torch_region_gpu.py -rs --durations=10" ;;
        tests_rest) echo "python3 -m pytest -q -m gpu tests --ignore=tests/test_bounds_gpu.py --ignore=tests/test_fused_gpu.py --ignore=tests/test_torch_region_gpu.py --ignore=tests/test_fuzz_gpu.py --ignore=tests/test_streaming_gpu.py --ignore=tests/test_streaming_ring_gpu.py --ignore=tests/test_transformers_gpu.py --ignore=tests/test_megatron_csa2_gpu.py -rs --durations=10" ;;
        tests_rest_a) echo "python3 -m pytest -q -m gpu tests/test_megatron_gpu.py tests/test_megatron_numerics_gpu.py tests/test_megatron_epilogue_gpu.py tests/test_epilogue_gpu.py tests/test_pool_epilogue_gpu.py tests/test_integration_gpu.py tests/test_eager_numerics_gpu.py tests/test_grouped_gpu.py tests/test_disk_cache_gpu.py tests/test_uploads_gpu.py -rs --durations=10" ;;
        tests_rest_b) echo "python3 -m pytest -q -m gpu tests/test_rope_angles_gpu.py tests/test_column_sum_gpu.py tests/test_malformed_gpu.py tests/test_dape_reduce_gpu.py tests/test_offsets_gpu.py tests/test_sbhd_gpu.py tests/test_no_ape_gpu.py tests/test_packed_gpu.py tests/test_fp32_dscore_gpu.py tests/test_pool_plan_gpu.py tests/test_readme_cpu.py tests/test_ddp_cpu.py -rs --durations=10" ;;
        unpack) echo "mkdir -p \${MEGATRON_LM_PATH:?} /tmp/hf; for t in .megatron/megatron-lm-dev-*.tar.xz .megatron/megatron-csa2-*.tar.xz; do tar -C \$MEGATRON_LM_PATH -xJf \$t || exit 1; done; for t in .megatron/transformers-*.tar.xz; do tar -C /tmp/hf -xJf \$t || exit 1; done" ;;
        streaming) echo "python3 -m pytest -q -m gpu tests/test_uploads_gpu.py tests/test_streaming_gpu.py tests/test_streaming_ring_gpu.py -rs --durations=10 && python3 examples/streaming_generation.py" ;;
        streaming_ring) echo "python3 -m pytest -q -m gpu tests/test_streaming_ring_gpu.py -rs --durations=10" ;;
        streaming_ring_sanitize) echo "compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu tests/test_streaming_ring_gpu.py -k 'gather or poisons or zero_ape' -p no:cacheprovider" ;;
        streaming_bench) echo "python3 -m csa_compressor bench --streaming" ;;
        streaming_bench_base) echo "PYTHONPATH=${BASE_SRC:?}:\$PYTHONPATH python3 -m csa_compressor bench --streaming" ;;
        streaming_host) echo "python3 tools/streaming_host_probe.py && python3 tools/streaming_host_probe.py 64" ;;
        decode_profile) echo "python3 tools/decode_profile.py" ;;
        streaming_sync) echo "python3 tools/streaming_sync_probe.py" ;;
        streaming_host_base) echo "PYTHONPATH=${BASE_SRC:?}:\$PYTHONPATH python3 tools/streaming_host_probe.py" ;;
        streaming_inplace_sanitize) echo "compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu tests/test_streaming_gpu.py -k 'aligned_rings or (captured and 128)' -p no:cacheprovider && compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu tests/test_streaming_ring_gpu.py -k in_place -p no:cacheprovider" ;;
        unpack_hf) echo "mkdir -p /tmp/hf && for t in .megatron/transformers-*.tar.xz; do tar -C /tmp/hf -xJf \$t || exit 1; done" ;;
        fresh_sanitize) echo "compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu tests/test_streaming_ring_gpu.py -k 'empty_slots or prefill_offsets' -p no:cacheprovider" ;;
        streaming_sanitize) echo "compute-sanitizer --tool memcheck --report-api-errors no python3 examples/streaming_generation.py" ;;
        hf) echo "PYTHONPATH=/tmp/hf:\$PYTHONPATH python3 -m pytest -q -m gpu tests/test_transformers_gpu.py -rs" ;;
        hf_bench) echo "PYTHONPATH=/tmp/hf:\$PYTHONPATH python3 tools/hf_bench.py" ;;
        bench_fp32r2) echo "python3 -m csa_compressor bench --impls fused --dtype fp32 --shapes 8x4096:512:2:1 --out $WORK/bench_fp32r2" ;;
        csa2_bench) echo "python3 tools/csa2_bench.py" ;;
        fp32_wide) echo "$(cmd_of fp32_wide_tests) && $(cmd_of fp32_wide_bench)" ;;
        fp32_wide_tests) echo "export CSA_CONFIG=BWD_FP32_VEC_BYTES=8 && python3 -m pytest -q -m gpu tests/test_megatron_csa2_gpu.py tests/test_no_ape_gpu.py tests/test_fp32_dscore_gpu.py -rs && python3 -m pytest -q -m gpu tests/test_fused_gpu.py -k float32 -rs" ;;
        v41_tests) echo "python3 -m pytest -q -m gpu tests/test_megatron_csa2_gpu.py tests/test_module_v41_gpu.py tests/test_no_ape_gpu.py tests/test_fp32_dscore_gpu.py -rs && python3 -m pytest -q -m gpu tests/test_fused_gpu.py -k float32 -rs" ;;
        fp32_wide_bench) echo "CSA_CONFIG=BWD_FP32_VEC_BYTES=8 python3 tools/csa2_bench.py && python3 tools/csa2_bench.py" ;;
        megatron_host) echo "python3 tools/megatron_host_probe.py d512r128 sbhd && python3 tools/megatron_host_probe.py d512r128 grouped" ;;
        grouped_tests) echo "python3 -m pytest -q -m gpu tests/test_grouped_gpu.py tests/test_megatron_gpu.py tests/test_malformed_gpu.py -rs" ;;
        epilogue_tests) echo "python3 -m pytest -q -m gpu tests/test_epilogue_gpu.py tests/test_pool_epilogue_gpu.py -rs" ;;
        csa2) echo "python3 -m pytest -q -m gpu tests/test_megatron_csa2_gpu.py -rs" ;;
        v41_module) echo "python3 -m pytest -q -m gpu tests/test_module_v41_gpu.py -rs" ;;
        check) echo "python3 -m csa_compressor check" ;;
        pool_epilogue) echo "python3 -m pytest -q -m gpu tests/test_pool_epilogue_gpu.py -rs --durations=10" ;;
        pool_epilogue_probe) echo "python3 tools/pool_epilogue_probe.py" ;;
        tests_fused_k) echo "python3 -m pytest -q -m gpu tests/test_fused_gpu.py -k \"${TESTS_K:?}\" -rs" ;;
        tests) echo "python3 -m pytest -q -m gpu tests -rs --durations=15" ;;
        sanitize) echo "compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_probe.py" ;;
        cache) echo "python3 -m pytest -q -m gpu -s tests/test_disk_cache_gpu.py" ;;
        fuzz) echo "compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -m gpu tests/test_fuzz_gpu.py -p no:cacheprovider" ;;
        bench) echo "python3 -m csa_compressor bench --out $WORK/bench" ;;
        bench_eager) echo "python3 -m csa_compressor bench --impls eager,fused,fused_eager --out $WORK/bench_eager" ;;
        megatron_bench) echo "python3 tools/megatron_bench.py" ;;
        megatron_bench_base) echo "PYTHONPATH=${BASE_SRC:?}:\$PYTHONPATH python3 tools/megatron_bench.py" ;;
        megatron_bench_f16) echo "python3 tools/megatron_bench.py --float16-module --kernels" ;;
        megatron_bench_ddp) echo "python3 tools/megatron_bench.py --ddp --kernels" ;;
        vs_megatron) echo "python3 tools/module_vs_megatron.py" ;;
        eager) echo "python3 -m pytest -q -s -m gpu tests/test_eager_numerics_gpu.py tests/test_megatron_numerics_gpu.py -k eager -p no:cacheprovider" ;;
        megatron_epilogue) echo "python3 -m pytest -q -s -m gpu tests/test_megatron_epilogue_gpu.py -k fused_epilogue -p no:cacheprovider" ;;
        module_bench*) echo "python3 -m csa_compressor bench --module" ;;
        base_module_bench*) echo "PYTHONPATH=${BASE_SRC:?}:\$PYTHONPATH python3 -m csa_compressor bench --module" ;;
        module_profile) echo "python3 tools/module_profile.py" ;;
        bench_order) echo "python3 tools/bench_order_probe.py" ;;
        module_host) echo "python3 tools/module_host_profile.py d128r4rot 20" ;;
        launch_host) echo "python3 tools/launch_host_probe.py" ;;
        op_host) echo "python3 tools/op_host_profile.py" ;;
        host_pieces) echo "python3 tools/host_pieces_probe.py" ;;
        op_host_base) echo "PYTHONPATH=${BASE_SRC:?}:\$PYTHONPATH python3 tools/op_host_profile.py" ;;
        launch_host_base) echo "PYTHONPATH=${BASE_SRC:?}:\$PYTHONPATH python3 tools/launch_host_probe.py" ;;
        colsum_order) echo "python3 tools/torch_colsum_order_probe.py" ;;
        colsum_time) echo "python3 tools/torch_colsum_order_probe.py time" ;;
        colsum_time_base) echo "PYTHONPATH=${BASE_SRC:?}:\$PYTHONPATH python3 tools/torch_colsum_order_probe.py time" ;;
        sbhd_bench) echo "python3 -m csa_compressor bench --sbhd" ;;
        bench_plan) echo "python3 -m csa_compressor bench --impls fused,fused_plan --out $WORK/bench_plan" ;;
        bench_fused*) echo "python3 -m csa_compressor bench --impls fused --out $WORK/$1" ;;
        bench_base*) echo "PYTHONPATH=${BASE_SRC:?}:\$PYTHONPATH CSA_COMMIT=${BASE_COMMIT:?} python3 -m csa_compressor bench --impls fused --out $WORK/$1" ;;
        scale) echo "python3 -m csa_compressor bench --impls eager,fused --shapes 2048x64:128:4:2,1x131072:128:4:2,1x8192:65:3:2 --out $WORK/scale" ;;
        ddp) echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; for r in 4 128; do python3 -m torch.distributed.run --standalone --nproc-per-node 2 examples/ddp_compressor.py --device cuda --ratio \$r || exit 1; done" ;;
        host) echo "python3 tools/perf_probe.py host" ;;
        floor) echo "python3 tools/perf_probe.py floor" ;;
        parts) echo "python3 tools/perf_probe.py parts ${PARTS_SHAPES:-}" ;;
        latency) echo "python3 tools/latency_probe.py" ;;
        reads) echo "python3 tools/perf_probe.py reads" ;;
        ncuinst_*) echo "$NCU --section InstructionStats --section SourceCounters python3 tools/profile_probe.py ${1#ncuinst_}" ;;
        ncustall_*) echo "ncu --clock-control none -k regex:'PoolForward|PoolBackward' --launch-skip 4 --launch-count 2 --section WarpStateStats --section SourceCounters --print-details all python3 tools/profile_probe.py ${1#ncustall_}; ncu --clock-control none -k regex:'PoolBackward' --launch-skip 2 --launch-count 1 --section SourceCounters --page source --print-source sass --csv python3 tools/profile_probe.py ${1#ncustall_} > \$OUT/ncu_source_bwd.csv" ;;
        ncu_*) echo "$NCU --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis python3 tools/profile_probe.py ${1#ncu_}" ;;
        sweep*) local n=${1#sweep} v="SWEEP_SHAPES_${1#sweep}"
                echo "python3 tools/perf_probe.py sweep \"\${SWEEP_$n:?}\" \"${!v:-${SWEEP_SHAPES:-1x8192:128:4:2,3x8192:128:4:2,3x8192:512:4:2,1023+2048+509+3+0+77:128:4:2,2048x64:128:4:2}}\"" ;;
        *) echo "echo unknown step $1; false" ;;
    esac
}

step() {
    local name=$1 t0=$SECONDS left=$((END - SECONDS))
    if [ $left -le 5 ]; then echo "$name skipped (deadline)" >>"$OUT/progress.txt"; return; fi
    local c; c=$(cmd_of "$name")
    echo "== $name: $c" >"$WORK/$name.log"
    timeout $left bash -c "$c" >>"$WORK/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - t0))s" >>"$OUT/progress.txt"
}

for group in "$@"; do
    mode=${group%%:*}; IFS=, read -ra names <<<"${group#*:}"
    if [ "$mode" = par ]; then
        for n in "${names[@]}"; do step "$n" & done; wait
    else
        for n in "${names[@]}"; do step "$n"; done
    fi
done
tar czf "$OUT/logs.tgz" -C "$WORK" .
cat "$OUT/progress.txt"
for f in "$WORK"/*.log; do echo "######## $(basename "$f")"; tail -n 25 "$f"; done
