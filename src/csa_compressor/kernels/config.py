"""Constants that shape the pooling kernels, in one place.

VEC_BYTES / BWD_VEC_BYTES: bytes one thread moves per tensor row and slot in the forward
  and backward. The vector shrinks (never below one element) until it divides head_dim.
  Forward at 3x8192/512 (H200, tools/perf_probe.py sweep at 8e6a9c5): 8 B 43.1 us, 16 B
  55.0, 4 B 53.2; at d=128 4 B is faster (FWD_MIN_CHUNKS_PER_ROW below). The
  backward holds three window-sized register arrays (scores, values, dape partials), so it
  uses narrower vectors and more threads.
MIN_CHUNKS_PER_ROW: shrink the vector further while a row would have fewer chunks than
  this, so that one row still fills a warp (d=64 bf16 -> 2-element vectors, 32 lanes).
FWD_MIN_CHUNKS_PER_ROW / FWD_MIN_VEC_BYTES: the forward shrinks its vector further while a
  row has fewer chunks than this, but not below 4 bytes (cp.async's smallest copy). Twice
  the threads for the same bytes paid at d=128 and not at d=512 (H200 sweep at 0fe2952,
  forward us, 8 B vs 4 B vectors: 1x8192/128 7.7 vs 6.7, 3x8192/128 15.0 vs 13.2, ragged
  7.2 vs 5.8, 2048x64 56.0 vs 52.3; 3x8192/512 36.3 vs 39.5): d=128 bf16 has 32 chunks of
  8 B and takes 4 B, d=512 has 128 and keeps 8 B. 2 B (not staged, 8 CTAs an SM) was
  slower everywhere but the ragged pack (3x8192/128 16.4, 3x8192/512 57.5). Again at
  9077b17 (perf-notes v25, forward us, 4 B twice / 8 B twice at d=128): 1x8192/128
  5.1-5.5 / 7.0-7.1, 3x8192/128 11.0 / 11.9-12.5, ragged 5.2 / 6.6-6.8, 2048x64
  44.6-44.7 / 47.3-47.4.
MAX_CTA_THREADS: column lanes of one CTA; wider rows are split into column groups (grid.y,
  or interleaved in a 1-D grid in the backward). One-warp forward CTAs (32 lanes, 32
  threads, 16 or 64 an SM: the Triton calibration rebuild's program shape) were slower at
  every ratio-4 shape, 32 lanes under 128-thread CTAs everywhere but 3x8192/128 (forward
  µs, default / 32x16 / 32x64 / 32 lanes of 128: 1x8192/128 5.3-5.5 / 7.1 / 6.9 / 6.1,
  3x8192/128 11.1-11.2 / 13.2 / 13.3 / 10.7, 3x8192/512 30.8-31.6 / 33.0 / 36.0 / 32.5;
  H200 sweep at 423959a, perf-notes v26).
MAX_REG_SLOTS: windows of at most this many slots live in registers and are read once
  (pool_fwd.py / pool_bwd.py); longer ones go to the slot-parallel kernels.
FWD_CTA_THREADS: forward CTAs stack row lanes on top of the column lanes up to this many
  threads. 128 beat 256 at 3x8192/512 in the register-resident forward (64.0 vs 83.9 us,
  equal at 1x8192/128; tools/perf_probe.py sweep, H200, 2026-11-29).
FWD_STAGES / FWD_SMEM_PER_CTA: rows a forward thread keeps in flight through cp.async
  (pool_fwd.py), fewer when a stage would push the CTA's shared memory past the budget
  (never fewer than 2, or nothing overlaps). 2 and 3 stages measured equal (43.0-43.4 us
  at 3x8192/512, also with 5 CTAs per SM; sweep at 8e6a9c5). Since then 2 is faster
  (H200 sweep at 5d264c3, forward us, 2 vs 3 stages: 3x8192/512 34.3 vs 36.4-37.0 over
  the sweep's other variants, 3x8192/128 12.3 vs 13.1-13.7, 2048x64 51.8 vs 52.3-52.8,
  1x8192/128 and the ragged pack equal). Why is not measured; one stage less is 16 KB
  less shared memory a CTA at d=512.
  Forwards of 4-byte vectors (d=128 bf16) were swept apart (then FWD_STAGES_NARROW, H200
  at f929db6, forward us, 2 / 3 / 4 stages): 3x8192/128 12.3-12.5 / 13.2 / 14.3,
  1x131072 47.9-48.4 / 48.5 / 51.3, 2048x64 51.9-52.7 / 52.4 / 55.2; 2 there too, so
  one constant serves both. Again at 9077b17 (perf-notes v25, forward us, 2 twice / 3
  twice): 3x8192/512 30.6-30.7 / 33.8, 1x8192/512 13.1 / 14.4-14.8, 3x8192/128 11.0 /
  12.9-13.1, 1x8192/128 5.1-5.5 / 6.0, 2048x64 44.6-44.7 / 49.9.
FWD_TARGET_CTAS_PER_SM / FWD_MAX_ROWS_PER_THREAD: each forward thread walks as many rows
  as make the grid one wave of this many CTAs per SM (what fits: 48 KB of staging and
  <= 128 registers a thread; fewer where the staging is larger), at most the cap. 2 CTAs
  (2 rows a thread at 1x8192/128) measured slower: forward 8.4 vs 7.6 us at 1x8192/128,
  73.4 vs 59.4 at 2048x64 (sweep at eada763). 8 at d=128 (one row a thread at 1x8192/128) measured
  the same as 4 (forward µs, 4 twice / 8 twice, H200 sweep at 40757c0, perf-notes v26):
  1x8192/128 5.1-5.5 / 5.5, 3x8192/128 10.9-11.0 / 10.9-11.0, ragged 5.2-5.3 / 5.2-5.3,
  2048x64 44.8-45.4 / 44.7-44.9.
SMEM_PER_SM / SMEM_RESERVED_PER_CTA: shared memory of an SM on sm_90 and sm_100 (228 KB)
  and what the driver reserves per CTA (1 KB, ncu "Driver Shared Memory Per Block").
BWD_TARGET_CTAS_PER_SM: row CTAs per SM the backward's grid is sized for (each walks
  several rows; fewer where shared memory fits fewer, see pool_bwd.py). 6 is what 80
  registers x 128 threads leave resident at d=512: with the column groups interleaved
  (pool_bwd.PoolBackward.grid) every row CTA then runs in one wave. H200 sweeps, fwd+bwd
  µs at 3x8192/512: 4 -> 121.8-123.5, 6 with interleaving 109.4, 4 with interleaving
  128.2 (39ce8aa); 8 without it 138.7 (eada763). 6 without interleaving was not run.
  1x8192/512 and d=128 unchanged (45.5-45.9, 19.9-20.1).
BWD_STAGES: rows a backward thread keeps in flight through cp.async (window + grad_out).
  3 measured best (H200, perf_probe sweep at eada763, fwd+bwd µs, 3 / 5 / 6 stages):
  1x8192/128 27.9 / 29.9 / 31.7, 3x8192/512 133.6 / 137.7 / 132.4, 2048x64 187 / 194 / 231.
  Again at 423959a (perf-notes v26, fwd+bwd µs, 3 twice / 2 / 4): 3x8192/512 97.6-99.4 /
  99.6 / 104.1, 1x8192/512 36.9 / 37.3 / 40.3, 1x8192/128 14.2 / 16.0 / 14.4.
  The backward's grid is sized for the CTAs whose shared memory fits an SM (pool_bwd.py).
Adopted from that sweep (were flags until measured, each bitwise equal to the code before
  in out/dkv/dscore on 11 packs; dape partials follow the grid): static slot offsets (one
  base pointer a row, constant offsets, common.WindowSlots.window_base), bf16 widened by
  shift or mask, the 32-ary warp segment search (common.find_segment_warp), the
  forward's cached row walk in the backward, and the smem-fitted backward grid. Forward /
  fwd+bwd µs, before -> with all of them: 3x8192/512 40.0/133.6 -> 36.7/125.1, 1x8192/128
  7.6/27.9 -> 7.6/25.5, 2048x64 59.4/187 -> 56.4/170.5. Measured and dropped: the APE
  values in backward registers (105 registers at d=128, 2 CTAs an SM instead of 3:
  1x8192/128 fwd+bwd 29.3 vs 27.9 us). SASS (tools/sass_probe.py, sm_90a, bf16 ratio 4
  coff 2 d 512): forward 2000 -> 1872, backward 1616 -> 1440 instructions.
BWD_CTA_THREADS: backward CTAs of register-resident windows stack row lanes on top of the
  column lanes up to this many threads; their dape partials meet in shared memory.
LONG_*: windows longer than MAX_REG_SLOTS (ratio 128) use the slot-parallel kernels
  (pool_long.py): a CTA holds one row at a time, its threads split the slots (at most
  LONG_SLOTS_PER_THREAD / LONG_BWD_SLOTS_PER_THREAD each) and the columns (vectors of
  LONG_VEC_BYTES / LONG_BWD_VEC_BYTES); the serial sums run over shared memory in slot
  order, so results stay bitwise equal to the fp32 reference. The one-thread-per-row
  design ran ratio 128 at 2-11% of the floor (61 us forward at 1x8192/128, H200,
  2026-11-29). The backward is compiled for LONG_BWD_CTAS_PER_SM resident CTAs (a
  register bound) and its grid sized for them.
  Chosen by occupancy (H200 sweep at 7deda87, 2026-11-29, perf-notes v21; ratio 128 coff
  1, fwd / fwd+bwd us): the forward had been 512 threads of 8-byte vectors, 97 registers,
  one CTA an SM; 256 threads of 4-byte vectors take 48 and run 5: 3x8192/512 59.4 -> 31.0,
  8x8192/512 146.1 -> 72.7, 1x8192/512 22.3 -> 13.7, 1x8192/128 11.1 -> 6.6. 4 slots a
  thread instead of 8 (more slot groups, fewer threads in the serial sums) was slower at
  every width (3x8192/512 forward 43.9-58.5). The backward had been 8 slots a thread, 167
  registers, one CTA an SM under a grid sized for 2; 4 slots a thread bounded at 3 CTAs (80
  registers, spill-free): backward alone (fwd+bwd minus fwd) 3x8192/512 81.8 -> 67.2,
  8x8192/512 192.1 -> 168.7, 1x8192/512 32.0 -> 29.8, but 1x8192/128 11.2 -> 12.5 (64
  rows: one a CTA either way, the smaller CTA is no faster alone). 8 slots with the grid
  sized for the one CTA that fits: 3x8192/512 76.7; 4 slots in 4-byte vectors at 5 CTAs:
  88.4; 128-thread CTAs at 8: 143.9. Bounds that spill (forward 6 CTAs: 56 B, backward 4:
  112 B) not swept.
  Measured and dropped at 53085d5 (H200 sweep, 2026-11-29, perf-notes v21): rows walked
  by a CTA with the next row's window staged by cp.async during the current row's work.
  Forward (64 registers, 51 KB of shared memory, 4 CTAs an SM; predicted 3x8192/512 20-24):
  one row a CTA 42.7-42.8, several rows a CTA sized for 4 / 3 / 2 CTAs an SM 46.2 / 50.9
  / 58.5, against 31.0 for the unstaged kernel above. Backward staged (92 registers, 2
  CTAs an SM; predicted -5 to -12): 79.9 alone at 3x8192/512 against 78.9 unstaged at 2
  CTAs and 70.9 unstaged at 3. More concurrent one-row CTAs beat fewer walking rows:
  the per-row chain of barriers and serial sums, not the loads, sets the pace.
  Then (H200 sweep at ae41bb2, twice each for the control): the forward at 16 slots a
  thread (8 slot groups of 32 lanes, 64 columns a CTA; 80 registers, 3 CTAs an SM):
  3x8192/512 31.2-31.3 -> 28.9, 8x8192/512 73.1-73.5 -> 67.8, 1x8192/128 6.5-6.6 -> 6.6;
  512 and 128 threads were slower (37.1, 41.2 at 3x8192/512). The backward in 4-byte
  vectors at 8 slots a thread held to 2 CTAs (96 registers; 16 slot groups of 16 lanes)
  against 8-byte vectors at 4 slots held to 3: backward alone 1x8192/128 12.2-12.4 -> 9.5,
  3x8192/512 68.1 -> 64.2, 8x8192/512 169.2-169.5 -> 159.9; 512 threads at 1 CTA: 92.1 at
  3x8192/512. Both adopted (ae41bb2's kernels with these constants). Measured at 57e582e
  and not taken (backward alone at 3x8192/512, against 64.3-64.6): 128-thread backward
  CTAs at 4 an SM 78.8, 512-thread ones at 1 69.4; 128-thread forward CTAs 30.3 against
  28.9-29.6 (ratio 128 coff 2 at 1x8192/512: 44.8 against 36.0-36.5).
DIV_FAST_MIN: smallest softmax numerator that takes the shared-reciprocal division
  (common.softmax_row, common.divide_column); with denominators in [1, 2^40] every intermediate of the fast path stays
  a normal number from there up, so it is exact (tests/test_division_cpu.py). Smaller ones
  take a true division.
REDUCE_COL_LANES / REDUCE_ROW_LANES / REDUCE_UNROLL: the dape partials' sum
  (dape_reduce.py): a CTA of 8 column lanes (16-byte vectors: 32 columns) by 64 row lanes,
  so a 1024-column partial (1x8192/128) spreads over 32 CTAs and a 4096-column one
  (3x8192/512) over 128, each thread summing P / 64 rows with 4 loads in flight. Chosen
  by that arithmetic; a sweep at 47849f5 (64 x 8, 32 x 16, 128 x 4, unroll 8) found no
  difference beyond noise (fwd+bwd 20.0-20.9 µs at 1x8192/128, 122.2-123.2 at 3x8192/512).
Adopted at v15 (H200 sweep at f929db6, 2026-11-29, tools/perf_probe.py sweep; forward /
  fwd+bwd us; were flags PDL_WAIT_FIRST, FWD_REG_BOUND, ZERO_SKIP_READ until measured,
  the whole GPU suite and memcheck passed with all three on):
  - programmatic dependent launches: the short-window forward and backward start with
    griddepcontrol.wait, so the launch and CTA start-up overlap the previous kernel's tail
    and nothing is read or written before it has completed and flushed. Off -> on:
    1x4/128 3.6/8.8 -> 3.2/8.2, 1x8192/128 6.5/18.1 -> 6.3/17.6, 3x8192/128 12.3/33.6 ->
    12.0/33.0, 3x8192/512 34.3/106.5 -> 34.3/105.9, 1x8192/65 9.8/22.5 -> 9.3/21.9
    (predicted -0.3 to -0.8 a kernel boundary at the small shapes, nothing at 3x8192/512).
  - the zero-fill shortcut (then pool_bwd.all_read; since v23 first_unread skipping all of
    them): a thread whose ZERO_TOKENS_PER_THREAD tokens all lie inside one segment's
    computed blocks skips its per-token walk.
    fwd+bwd 1x8192/128 18.1 -> 16.9, 3x8192/128 33.6 -> 32.5, 3x8192/512 106.5 -> 105.7,
    2048x64 and the ragged pack unchanged (predicted -1 to -2 at 3x8192/512, nothing where
    segments are short).
  - the register bound of narrow forwards (FWD_BOUND_CTAS_PER_SM below).
  All three together: 1x4 3.2/8.3, 1x8192/128 5.9/16.2, 3x8192/128 12.4/32.5, 3x8192/512
  34.4/105.1, ragged 5.1/12.2, 2048x64 50.2/149.1, 1x8192/65 5.4/17.3.
FWD_BOUND_CTAS_PER_SM: forwards with vectors of 4 bytes or less (d=128 bf16, odd
  head_dim) are compiled with a launch bound of this many CTAs an SM (sm_90: 8, 64
  registers instead of 79, no spills; sm_100: 7, see the table) and their grid sized for
  as many, so 1x8192/128 runs one row a thread in one wave. Off -> on (v15): 1x8192/128 forward 6.5 -> 6.2-6.3,
  2048x64 52.0-52.7 -> 49.6-49.8, 1x131072 47.9-48.4 -> 47.7, 1x8192/65 (unstaged 2-byte
  loads) 9.8 -> 5.6, but 3x8192/128 12.3-12.5 -> 12.8 (3 rows a thread instead of 6);
  predicted 1x8192/128 -0.5 to -1.0, others within +-1. The bound's registers with a grid
  sized for 4 or 6 CTAs an SM (sweep at b9a87b6, forward us, grid for 8 / 4 / 6):
  1x8192/128 5.5-5.9 / 6.3 / 6.3, 3x8192/128 12.4-12.6 / 12.4 / 12.4, 2048x64 49.2-49.4 /
  53.2 / 52.1, 1x131072 47.7-47.8 / 48.6 / 48.4, 1x8192/65 5.4-5.5 / 7.4 / 6.1: the
  bound's grid everywhere. At 3x8192/128 the bounded forward stays ~0.4 us behind the
  unbounded one with PDL (12.0 in the first sweep) whatever its grid: the register cap,
  not the grid, costs there; kept for the -2 to -4 us elsewhere.
One residual correction in the shared-reciprocal division (common.div_by_rcp; was the
  flag DIV_ONE_CORRECTION, adopted at v16): the compiler's own div.rn.f32 fast path,
  bitwise the same quotients as the two corrections before (tests/test_division_cpu.py).
  sm_90a SASS (tools/sass_probe.py): forward d=512 1760 -> 1696 instructions, d=128
  1176 -> 1144; backward d=512 1568 -> 1536, d=128 1672 -> 1640. Predicted 3x8192/512
  forward -1 to -2 us (ncu: that forward issues every ~1.2 cycles a scheduler), backward
  -0.5 to -1.5, d=128 within 0.3. H200 sweep at a8e5614, two runs each, fwd / fwd+bwd
  us, two corrections -> one: 3x8192/512 34.1-34.2 / 105.0-105.4 -> 32.6-32.9 /
  103.9-104.0; 1x8192/512 14.5 / 41.8-41.9 -> 14.0-14.1 / 41.0-41.3; 3x8192/128
  12.3-12.5 / 32.3-32.6 -> 11.9 / 31.3-31.4; 1x8192/128, the ragged pack and ratio 128
  unchanged. The forward as predicted; the backward gained nothing at d=512 and ~0.6 at
  3x8192/128. The GPU suite passed with it (173 passed) and memcheck printed 0 errors.
One fast-division check a row instead of one a column (common.softmax_row; was the flag
  DIV_ROW_CHECK, adopted at v17). H200 sweep at 6362bd6 (2026-11-29, perf-notes v17),
  fwd / fwd+bwd us, two runs of the code before against one with the flag: 3x8192/128
  12.0-12.1 / 31.6-31.8 -> 11.4 / 31.0, 1x8192/128 5.7-5.8 / 15.6-15.7 -> 5.6 / 15.3,
  1x8192/512 13.9-14.1 / 41.2-41.3 -> 13.9 / 40.8, 3x8192/512 32.4-32.9 / 104.1-104.3 ->
  32.6 / 103.6, the ragged pack and 1x4 unchanged, 2048x64 forward 47.0-47.1 -> 47.5.
  Predicted: 3x8192/512 forward -0.5 to -1.5, d=128 within 0.3: the win came at d=128.
Warp-cooperative staging copies (common.stage_window_warp; was the flag COOP_STAGING,
  adopted at v17): a slot's 32 vectors of one warp are one contiguous run in global and
  shared memory, so the lanes copy it in 16-byte cp.async pieces (4 slots an instruction
  with 4-byte vectors, 2 with 8-byte) and meet at two warp syncs a row. Forward wherever
  every warp holds one row with 16-byte aligned runs; backward only with one row lane
  (d=512) and on sm_90, held to the registers of its 6-CTA grid (80, spill-free on
  sm_90a; unbounded it took 86, and d=128's 3-CTA bound or sm_100a's spilled). Predicted:
  backward 3x8192/512 -3 to -6 us, 1x8192/512 -1 to -2, d=128 forwards -0.3 to -0.8, the
  d=512 forward -0.5 to -1. H200 sweep at 089f1c6 (2026-11-29, two runs each, fwd /
  fwd+bwd us, off -> on): 3x8192/512 32.2 / 102.9-103.2 -> 31.0-31.4 / 101.2-101.4,
  1x8192/512 13.5-13.6 / 40.6-40.9 -> 13.1-13.4 / 38.4-38.7, 3x8192/128 11.9-12.0 /
  31.4-31.5 -> 11.1 / 30.7-31.0, 2048x64 47.2 / 146.2-146.6 -> 44.7-44.8 / 143.0-143.2,
  1x8192/128 5.3-5.7 / 14.7-15.4 -> 5.6 / 15.2 and the ragged pack unchanged. The
  backward (fwd+bwd minus fwd) gained less than predicted at 3x8192/512 (-0.5 to -1) and
  as predicted at 1x8192/512 (-1.8 to -2).
  The GPU suite passed with it on (173 passed) and memcheck printed 0 errors.
Measured and dropped in the DIV_ROW_CHECK sweep (perf-notes v17):
  - WALK_REUSE, the compute step taking a row's window from the step that issued its
    copies (one packed register a stage) instead of walking the row again: within noise
    everywhere (3x8192/512 forward 32.7 against 32.4-32.9; predicted -0.5 to -1.5), and
    under the forward's register bound it made ptxas spill the APE registers.
  - FWD_ONE_ROW_DIRECT, a forward of one row a thread loading its window straight into
    registers (a runtime branch beside the staged loop): ragged forward 5.2 -> 5.0,
    1x8192/128 5.7-5.8 -> 5.6, but 3x8192/128 (staged, 3 rows a thread) 12.0-12.1 ->
    12.7: the second path in the same register-bound kernel cost the staged one. As a
    separate compiled kernel chosen on the host it might keep the -0.2.
SMEM_CARVEOUT: the preferred shared-memory carveout (percent of the unified L1/shared
  array) set on the forward, backward and dape kernels; -1 leaves it to the driver, which
  sizes it per kernel (so consecutive kernels of one step can ask for different splits).
  A sweep knob for the fixed-cost work: 100 makes the three kernels' splits equal at the
  cost of L1. Measured at f929db6 (perf-notes v15): within noise at every shape (e.g.
  1x8192/128 fwd+bwd 18.1 against 18.1-18.3 at -1), so it stays -1.
Measured and dropped at 7891c23 (H200 sweep, 2026-11-29, fwd+bwd us, perf-notes v18):
  - COOP_STORES, the backward's dkv and dscore written through the stage it had just read
    and stored in 16-byte warp-cooperative pieces (d=512 on sm_90): 3x8192/512 101.0
    against 101.2-101.9 without, 1x8192/512 38.6 against 38.3-38.4 (predicted -1 to -3
    and -0.5 to -1.5). The stores were not the limit the cooperative loads were.
  - DAPE_CLUSTER, the row CTAs launched in clusters of 4 (or 2) a column group, summing
    their dape partials over distributed shared memory and writing one a cluster (a
    quarter of the partials' bytes): 3x8192/512 117.9-118.0 (119.0 with 2) against
    101.2-101.9, 1x8192/512 41.3-41.6, 3x8192/128 34.7, 2048x64 167.1 against 143.5-144.0
    (predicted -0.5 to -2.5). The cluster launch itself costs far more than the partials'
    bytes; not profiled further.
Measured and dropped at 0fe2952 (H200 sweep, fwd+bwd us at 1x8192/128 / ragged / 3x8192/512):
  WARP_WALK_SHUFFLE, the segment search and the segment's bounds in one pass of loads
  (20.5 / 15.8 / 108.6 against 20.3 / 15.8 / 109.0 without; predicted -0.3 to -0.8). The
  dape sum's programmatic dependent launch (then DAPE_PDL) was adopted: dape_reduce.py.
ZERO_TOKENS_PER_THREAD: consecutive tokens each thread of a gradient zero-fill CTA walks
  (one segment search, then registers). 2 tokens a thread with a search each made 25k
  zero CTAs at 3x8192/512 (ncu: backward 104.5 us, DRAM 38%); 32 brought it to 88.7 us.
"""

VEC_BYTES = 8
BWD_VEC_BYTES = 4
MIN_CHUNKS_PER_ROW = 32
FWD_MIN_CHUNKS_PER_ROW = 64
FWD_MIN_VEC_BYTES = 4
MAX_CTA_THREADS = 128
MAX_REG_SLOTS = 16
FWD_CTA_THREADS = 128
FWD_STAGES = 2
FWD_SMEM_PER_CTA = 48 * 1024
FWD_TARGET_CTAS_PER_SM = 4
FWD_MAX_ROWS_PER_THREAD = 64
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
BWD_TARGET_CTAS_PER_SM = 6
# GRID_FITS_REGISTERS: the one-wave grids of the short-window kernels (pool_fwd
# rows_per_thread, launch.backward_schedule) are sized for the CTAs an SM their shared
# memory and the targets above allow, capped at what the compiled kernel's registers
# leave resident (compile.cubin_registers reads ptxas' count from the cubin;
# common.WindowSlots.fit_registers). tools/spill_survey.py at 983e9ea+ (bf16, ratios 1-8,
# coff 1-2, d 64/128/512) found 18 of 120 sm_90a kernels (23 of 96 on sm_100a) sized for
# more CTAs than their registers hold, so their grids ran 1.2-2 waves: the d=64/128
# backwards at ratios 1-6 but 4 coff 2 (e.g. ratio 4 coff 1: 56 registers x 256 threads, 4
# CTAs resident against a grid for 6) and the d=512 forwards at ratios 5-8 coff 2 (168-254
# registers, 2-3 resident against 3-4). The production kernels (ratio 4 coff 2, ratio 128)
# fit already (tests/test_compile_cpu.py) and keep their grids. Predicted (H200): at
# 3x8192/128 the backwards -5 to -15%, the 3x8192/512 ratio 6 coff 2 forward -5 to -20%,
# ratio 4 coff 2 unchanged. Measured (sweep at c3f4165, 2026-11-30, perf-notes v27, fwd /
# fwd+bwd µs, off twice / on twice): 3x8192/512 ratio 8 coff 2 38.7-38.8 / 111.1-111.5 ->
# 34.6-35.5 / 109.4-110.0, ratio 6 coff 2 34.6-34.8 / 100.8-101.1 -> 33.6-33.7 /
# 99.6-99.8, 1x8192/512 ratio 6 coff 2 16.0-16.1 / 40.1-40.5 -> 16.0-16.1 / 39.0-39.1,
# 1x8192/128 ratio 6 coff 1 5.2 / 12.0 -> 5.0-5.1 / 11.7-11.9, ratio 4 coff 1 (1x8192 and
# the ragged pack) and ratio 4 coff 2 within noise. The forwards as predicted (ratio 6 at
# the low end), the d=128 backwards at 2,048 rows and fewer gained little (the 3x8192
# packs take the large-pack variants, which their bound already fits). Adopted; 0 is a
# sweep knob.
GRID_FITS_REGISTERS = 1
# Register file of an SM on sm_90 and sm_100: 64K 32-bit registers in 4 partitions (one a
# scheduler), given to warps in units of 256. ctas_fitting_registers counts whole warps a
# partition, which is never more than the whole-SM count, so a grid it sizes is one wave.
REGS_PER_SM = 65536
REG_PARTITIONS = 4
REG_ALLOC_UNIT = 256
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32
# The backward of large packs (launch.backward_kernel; pool_bwd ``large``): where the
# backward stacks row lanes (d=128 bf16: 4 of 64 threads) and runs 3 to
# BWD_LARGE_MAX_DEFAULT_CTAS CTAs an SM, packs of at least BWD_LARGE_PACK_ROWS rows use a
# second compiled variant with the warp-cooperative window copies, held to one or two CTAs
# an SM fewer (pool_bwd.large_pack_ctas; ratio 4 coff 2 at d=128: 2 CTAs, 128 registers).
# H200 sweeps at 4e1170c (perf-notes v19, fwd+bwd us, default / large): 3x8192/128 (6,144
# rows) 30.7-31.0 / 29.5-29.8, 8x8192/128 71.4 / 69.2-69.5, 1x131072/128 136.2-136.8 /
# 133.1-133.4, but 1x8192/128 (2,048 rows) 14.7-15.3 / 15.7-15.9 and 2048x64/128 (32,768
# rows in 64-token sequences) 143.3-143.4 / 144.0-144.2; ragged (915 rows) the same. The
# threshold sits between 2,048 and 6,144 rows. Two CTAs from 4-6 lost: at 8c7ee81, where
# every stacked kernel had it, 1x131072 fwd+bwd at d=128 ratio 1 coff 1 went 121.5 ->
# 131.5, ratio 2 coff 2 136.5 -> 148.9, ratio 3 coff 2 140.7 -> 147.9, ratio 4 coff 1 72.6
# -> 76.3 (4-6 CTAs -> 2), while d=64 ratio 4 coff 2 (3 -> 2) went 70.1 -> 68.3. One fewer
# than 4 (4 -> 3, BWD_LARGE_MAX_DEFAULT_CTAS 3 -> 4; d=128 ratio 3 coff 2, 76 registers
# spill-free) was the candidate LARGE_ONE_LESS, predicted -1 to -3 at 1x131072; measured
# at ec3f8c9 (sweep, fwd+bwd us, off / on, twice each): ratio 3 coff 2 1x131072
# 140.6-141.2 / 130.6, 3x8192 31.9 / 29.8-29.9, 1x8192 (below the threshold) 17.2-17.3 /
# 17.3-17.5; ratio 4 coff 2 and ratio 1 coff 1 unchanged (132.8-133.1, 122.1-123.0). One
# fewer than 5-6 (6 -> 5, 5 -> 4) where the window fits (BWD_LARGE_MAX_SLOTS;
# BWD_LARGE_MAX_DEFAULT_CTAS 4 -> 6) was the candidate LARGE_FROM_6, predicted -3 to -8 at
# 1x131072; measured at 93dea79 (sweep, fwd+bwd us, off / on, twice each), 1x131072 d=128:
# ratio 1 coff 1 121.6-122.1 / 108.8-108.9, ratio 2 coff 1 81.6-82.5 / 79.7, ratio 3 coff
# 1 77.4-77.8 / 73.5-73.9, ratio 5 coff 1 74.5-74.8 / 67.6-67.7, ratio 1 coff 2
# 172.4-172.6 / 162.8-163.6; d=64 ratio 1 coff 1 65.4-65.7 / 59.5; 3x8192/128 ratio 1 coff
# 1 28.5-28.6 / 27.1-27.3; 1x8192/128 ratio 4 coff 2 (unchanged kernel) 15.2-15.3 / 15.3.
# The threshold: a sweep at 3f2540c (4,096 / 2,048 / never, fwd+bwd us, twice each) found
# 2,048-row packs 0.3 slower with the variant (1x8192/128 15.6-15.8 against 15.3-15.5),
# 3,072 rows 0.4-0.5 faster (1x12288/128 18.9-19.0 / 19.3-19.5), 4,096 rows within noise
# (2x8192/128), 5,461 rows 0.7 faster (2x8192/128 ratio 3 coff 2): 4,096 stays, a
# threshold anywhere in 2,048-4,096 moving nothing beyond noise. Two fewer (6 -> 4) for
# the 4-slot windows that spill at 5 (pool_bwd.large_pack_ctas) was the candidate
# LARGE_TWO_LESS, predicted -1 to -4; measured at d7a615e (fwd+bwd us, off / on, twice
# each): 1x131072/128 ratio 4 coff 1 71.7-72.3 / 67.7-67.8, ratio 2 coff 2 135.8-136.0 /
# 135.2-135.5, 3x8192/128 ratio 2 coff 2 31.8-32.0 / 29.8-30.1, 1x131072/64 ratio 4 coff 1
# 38.8-39.0 / 36.1-36.3. Variants measured and not taken: 128-thread CTAs (2 row lanes)
# with the copies at 4 or 5 CTAs an SM (2048x64 137.4-139.5, but ragged 13.7-14.1 against
# 12.5-12.7 and 3x8192/128 no better), and 128-thread CTAs without them (slower everywhere
# at d=128).
# BWD_LARGE_GUESS_PACK_ROWS: the threshold for the large-pack variants that copy their
# first row at a guess (pool_bwd: held to 3 CTAs an SM or fewer; config.py "Adopted at
# v24"), which made them faster; launch.backward_kernel takes the smaller of the two.
# 2,048, adopted at v25. H200 sweep at 89d073b (2026-11-30, perf-notes v24, fwd+bwd µs,
# 4,096 / 2,048, twice each): 1x8192/128 ratio 4 coff 2 (2,048 rows) 14.6-15.0 /
# 14.2-14.3, ratio 3 coff 2 (2,730 rows) 16.2-16.3 / 14.7-14.8, 1x12288/128 (3,072 rows)
# 18.0-18.2 / 17.2-17.3; again at 982105f (perf-notes v25, two runs of 4,096 around one of
# 2,048): 1x8192/128 14.4-15.1 / 14.4, ratio 3 coff 2 16.3-16.4 / 14.9, 3x8192/512 (not a
# large-pack variant) 99.2-99.3 / 98.6, the rest within noise. Its first commit (f9c11e4)
# read an attribute the long backward lacked and the GPU bench failed at ratio 128;
# tests/test_schedule_cpu.py now covers the pick, the long backward included. Below 2,048
# rows not measured; the third variant the rule covers (ratio 6 coff 1, 4 -> 3 CTAs) not
# measured at either threshold.
BWD_LARGE_PACK_ROWS = 4096
BWD_LARGE_GUESS_PACK_ROWS = 2048
BWD_LARGE_MAX_DEFAULT_CTAS = 6
# The most window slots (ratio * coff) a large-pack backward compiles spill-free at this
# many CTAs an SM (256 threads; ptxas sm_90a at 3f2540c, bf16 d=128 and d=64): at 5, 48
# registers for 3 slots, while 4 slots (ratio 4 coff 1, ratio 2 coff 2) spilled 108 and 24
# B; at 4, 64 registers for 5 slots (ratio 5 coff 1), while 6 slots take 74-76 (ratio 3
# coff 2 and ratio 6 coff 1, which run 3); at 3 and 2, every window of up to 8 slots
# (tests/test_compile_cpu.py compiles the largest of each).
BWD_LARGE_MAX_SLOTS = {2: 16, 3: 16, 4: 5, 5: 3}
BWD_CTA_THREADS = 256
BWD_STAGES = 3
ZERO_TOKENS_PER_THREAD = 32
REDUCE_COL_LANES = 8
REDUCE_ROW_LANES = 64
REDUCE_UNROLL = 4
# By compute capability major: what one wave of one row a thread needs at 1x8192/128
# (1,024 CTAs: 132 SMs x 8 on the H200, 148 x 7 on a B200) and still compiles spill-free.
# ptxas at 5d264c3+: sm_90a 79 registers unbounded, 64 at 8 (no spills); sm_100a 72
# unbounded, 72 at 7, 64 with 32 B of spills at 8.
FWD_BOUND_CTAS_PER_SM = {9: 8, 10: 7}
# FWD_BOUND_MAX_ELEMS: the largest window (slots x vector elements a thread: 2 for bf16
# and fp16, 1 for fp32 and odd head_dim) a narrow forward is held to FWD_BOUND_CTAS_PER_SM
# for. ptxas (bf16, d=64 and d=128, at b22ca99) spilled under the
# bound for every window of 10 or more slots (ratios 5-8 coff 2: 72-216 B on sm_90a,
# 32-232 B on sm_100a); unbounded they take 96-128 registers, spill-free, and their grid
# is sized for FWD_TARGET_CTAS_PER_SM. H200 sweep at 22a19a6 (2026-11-29, two runs each,
# fwd / fwd+bwd us, every window held -> bf16 windows up to 8 slots, that is 16
# elements; was the sweep knob FWD_BOUND_MAX_SLOTS 16 -> 8): 1x8192/128 ratio 8 coff 2
# 9.7-9.9 / 19.6-19.9 -> 7.1-7.2 / 17.2, 3x8192/128 ratio 8 coff 2 18.5-18.6 / 42.4-42.5
# -> 12.3-12.4 / 33.4-33.5, 3x8192/128 ratio 6 coff 2 18.0-18.1 / 40.7 -> 11.1-11.5 /
# 31.4-31.6, 1x8192/64 ratio 5 coff 2 6.5-6.7 / 14.4-14.7 -> 5.5-5.6 / 13.4-13.5; the GPU
# suite (230 passed) and memcheck (0 errors) ran with it. Still spilling under the bound:
# ratio 6 coff 1 on sm_90a (24 B) and ratio 8 coff 1 on sm_100a (48 B), not measured.
# One-element windows stay held up to 16 slots (fp32 ratio 8 coff 2: 80 registers
# spill-free under the bound), as before the sweep.
FWD_BOUND_MAX_ELEMS = 16
# FWD_MAX_WINDOW_ELEMS (0: off): the forward halves its vector while a window holds more
# than this many elements a thread (forward_vector_elems). At d=512 bf16 the 8-byte
# vectors of ratio 5-8 coff 2 windows (40-64 elements) take 168-254 registers, 2-3 CTAs an
# SM; in 4-byte vectors 96-125, 4 CTAs (ptxas sm_90a, spill-free). Predicted (H200,
# forward µs at 3x8192/512, with 32): ratio 6-8 coff 2 -5 to -15% against their
# register-fitted grids, ratio 5 coff 2 within +-5%, ratio 4 coff 2 (32 elements, kept)
# unchanged. Measured (sweep at 0fda3f0, 2026-11-30, perf-notes v27, forward / fwd+bwd µs,
# off twice / 32 twice): ratio 5 30.6-31.0 / 99.4-99.8 -> 33.3-33.5 / 97.6-98.1, ratio 6
# 33.2-33.8 / 97.2-98.9 -> 32.0-32.5 / 96.9-97.4, ratio 7 34.5-34.6 / 99.6-100.5 ->
# 32.3-32.9 / 99.9-100.3, ratio 8 34.5-35.1 / 109.4 -> 32.7-32.9 / 107.5-108.0, 1x8192/512
# ratio 8 16.5-16.7 / 42.2-42.5 -> 14.0-14.1 / 41.2-41.7, ratio 4 within noise. Ratios 6-8
# as predicted (at the low end at 3x8192), ratio 5's forward 8% slower: 40 keeps it (and
# every window of 40 elements or fewer) in 8-byte vectors. The GPU suite passed with 32
# (234 passed, 3 skipped) and memcheck printed 0 errors. The rule reaches d=256 too (ratios
# 6-8 coff 2, 48-64 elements); measured there at 5fb3484 (forward / fwd+bwd µs, off twice / 40
# twice): 3x8192/256 ratio 6 20.1-20.7 / 58.3-59.2 -> 17.6 / 55.8-56.0, ratio 8 22.1-22.5
# / 58.3-58.9 -> 18.6-18.8 / 56.1, 1x8192/256 ratio 8 12.7 / 26.6 -> 9.4 / 23.1.
FWD_MAX_WINDOW_ELEMS = 40
# FWD_BOUND_SPILLS: (ratio, coff, vector elements) windows that ptxas spilled under the
# narrow forward's bound on that architecture (tools/spill_survey.py; bf16 at d=64 and
# d=128, 2-element vectors):
# sm_90a ratio 6 coff 1, 24 B; sm_100a ratio 8 coff 1, 48 B. They compile unbounded
# (sm_90a: 69 registers, sm_100a: 79, spill-free) with the grid of FWD_TARGET_CTAS_PER_SM.
# H200 sweep at c3f4165 (2026-11-30, perf-notes v27, fwd / fwd+bwd µs, bound twice /
# unbound twice, ratio 6 coff 1 d=128): 3x8192 8.4-8.5 / 18.9-19.0 -> 7.1 / 17.2-17.3,
# ragged 3.0-3.1 / 8.8-8.9 -> 2.7 / 8.6, 1x8192 4.6-5.0 / 11.1-11.8 -> 4.6-4.7 / 11.3.
# sm_100a's entry is the same fix, compiled here only (no Blackwell to measure).
FWD_BOUND_SPILLS = {9: ((6, 1, 2),), 10: ((8, 1, 2),)}
SMEM_CARVEOUT = -1
# WHATIF_MATH: a measurement knob, never a default (tests/test_compile_cpu.py checks it is
# 0): the short-window kernels' softmax (common.whatif_softmax) with approximate math (1)
# or none (2), so a sweep can tell what SPEC §5's numerics (accurate exponential, true
# division) cost against the kernels' memory traffic. Outputs are wrong under it.
# Measured at 9d68d42 (H200, perf-notes v23), fwd / fwd+bwd µs, SPEC math -> approximate ->
# none: 3x8192/512 30.5-31.2 / 101.0-101.1 -> 29.2-29.6 / 97.8-98.4 -> 28.3 / 95.9;
# 1x8192/128 5.3-5.6 / 14.7-15.2 -> 4.7-5.1 / 13.3-13.7 -> 4.7 / 13.6. Even with no math
# the short-window kernels miss issue 3's targets: their memory path is what is left.
WHATIF_MATH = 0
# WHATIF_BWD_APE: a measurement knob, never a default (tests/test_compile_cpu.py): 1 gives
# the staged short-window backward zeros for its APE values, with no loads, so a sweep can
# tell what the per-row APE loads cost it. ncu puts 41% of the 3x8192/512 backward's stall
# samples on them (v26), yet moving them (BWD_APE_AFTER_WALKS), keeping the windows out of
# L1 (BWD_COPY_CG) and shared memory (BWD_APE_SMEM, v23) all lost. A guess to test: the
# loads of row i queue behind the copies of rows i+1 and i+2 issued before them, so a row
# waits for its latest copies, not its own (which would also explain why more stages never
# paid). Prediction, if so: 3x8192/512 backward -5 to -10 µs with the loads gone; if the
# step moves less than ~1 µs, the APE stall is where a memory-bound warp waits, not a cost
# of its own. Outputs are wrong under it.
WHATIF_BWD_APE = 0
# Measured and dropped at 906794e (H200 sweep, 2026-11-30, perf-notes v23; fwd / fwd+bwd
# µs, two runs of the code before: 3x8192/512 31.2 / 101.3-101.7, 1x8192/512 13.0-13.4 /
# 38.1-38.9, 3x8192/128 11.0-11.1 / 29.1-29.4, 1x8192/128 5.2-5.5 / 14.5-15.2, 2048x64
# 44.9-45.3 / 134.6-135.7). Fewer registers in the forward, so more of it resident:
# - FWD_LATE_VALUES, a window's values read from the stage at their products, not
#   beside the scores (d=512: 128 -> 96 registers, same 4 CTAs an SM): 3x8192/512 32.5 /
#   101.1; held to 5 CTAs an SM: 34.0 / 103.0 (predicted 29-30.5).
# - with FWD_APE_LOADS as well, the APE vectors loaded every row instead of held (71
#   registers), held to 6 CTAs an SM: 3x8192/512 40.0-40.3, 1x8192/512 17.2, 2048x64 48.0;
#   and the d=128 forward held to 12 CTAs (40 registers; one row a thread at 3x8192/128):
#   3x8192/128 12.6 against 11.0, 1x8192/128 6.6, 2048x64 54.8.
# Reading the values late cost 1.3 at the same occupancy (presumably their shared loads,
# now in the product chain); each step to more resident CTAs lost more, as more backward
# warps did at v17: too few warps is not what holds the forward (not profiled further).
# Measured and dropped at 519277d (same sweep method, two runs each, off / on): BWD_APE_SMEM,
# each backward thread's APE vectors in shared memory (loaded once; 8 KB more a CTA at
# d=512, still 6 CTAs an SM) instead of loaded from global memory every row. ncu at 9d68d42
# has the 3x8192/512 backward waiting on L1TEX loads 5.5 of its 9.8 cycles between a
# warp's instructions; predicted -4 to -8 µs there. Measured fwd+bwd 3x8192/512
# 100.9-101.3 / 102.6-102.9, 1x8192/512 38.4-38.8 / 40.4, the rest within noise (the
# suite, memcheck and bench passed with it on). ncu's source counters at 4616ab2 still put
# half the backward's stall samples on the per-row APE loads: why the variant lost is open.
# Adopted at v24 (H200 sweep at 532daab, 2026-11-30, perf-notes v24; the GPU suite passed
# with both candidates on, 230 passed, and memcheck printed 0 errors). Fwd / fwd+bwd µs, two
# runs each, off -> on:
# - the short-window backward issues a row's APE loads before waiting for the row's
#   staged window (pool_bwd.py; was the flag BWD_APE_EARLY), so their latency overlaps the
#   wait (ncu at 4616ab2 had half the backward's stall samples at 3x8192/512 on the adds
#   that consume them). Same loads, values and op order: bitwise the same gradients.
#   79 registers at d=512 bf16 under the 6-CTA bound, spill-free on sm_90a and sm_100a.
#   3x8192/512 31.4-31.8 / 101.5-101.8 -> 31.0-31.5 / 99.0-99.6, 1x8192/512 13.3-13.4 /
#   38.6-38.8 -> 12.9-13.2 / 36.8-36.9, 3x8192/128 11.2-11.3 / 29.6-29.7 -> 11.3-11.5 /
#   27.9-28.0, 2048x64 44.8-45.3 / 135.1-136.0 -> 44.9 / 133.0, 1x8192/128 (5.3-5.6 /
#   14.7-15.4 -> 5.5-5.6 / 15.1-15.6) and the ragged pack (12.4-12.6 -> 12.5) within
#   noise. Predicted 3x8192/512 backward -3 to -8 (got ~-2), 1x8192/512 -1 to -3 (-1.9),
#   d=128 -0.5 to -1.5 (-1.7). Held for the whole walk instead (loaded once, as the
#   forward does) ptxas spilled 8 B at d=512 and took 107 registers at d=128, so the
#   loads stay per row.
# Measured and dropped in the same sweep: STAGED_READ_ALL, with coff 2 every staged slot
#   read back and the previous block's slots set to -inf / 0 in one branch where a row has
#   none (the forward's main path 24 moves a row shorter in sm_90a SASS). Predicted
#   3x8192/512 forward -0.3 to -0.8; measured 32.1 against 31.4-31.8 (32.0 with the APE
#   loads above), 3x8192/128 11.0 against 11.2-11.3, the rest within noise: nothing.
# Measured and dropped at cfbd5d8 (H200 sweep, 2026-11-30, perf-notes v24; the GPU suite
#   passed with both on, 230 passed, memcheck 0 errors): FWD_L2_AHEAD / BWD_L2_AHEAD, the
#   short-window kernels asking L2 (prefetch.global.L2, one 128-byte line a lane, a warp
#   naming its share of a window and grad_out) for the rows K past their cp.async stages,
#   sm_90 only, held to their grid's CTAs (spill-free). Predicted 1x8192/512 forward 13.3
#   -> 12-12.8, 3x8192/512 fwd+bwd 99.5 -> 94-97. Fwd / fwd+bwd µs, off (two runs) / K=1
#   (two runs) / K=2 / K=4: 3x8192/512 31.0-31.5 / 98.5-98.6 -> 34.4-34.5 / 102.2-102.5
#   -> 36.8 / 114.3 -> 44.4 / 125.2; 1x8192/512 13.1-13.2 / 37.0-37.1 -> 14.6-15.2 /
#   39.6-39.9 -> 16.3 / 41.0; 3x8192/128 10.9-11.0 / 28.0-28.2 -> 12.8-12.9 / 30.0;
#   1x8192/128 5.2-5.5 / 14.6-15.0 -> 5.7 / 15.4-15.5 -> 5.7-5.8 / 17.5-17.8 -> 5.8 /
#   17.7; 2048x64 44.7-45.1 / 130.9-131.7 -> 48.3-48.8 / 135.8-136.2 -> 50.4 / 140.3-140.5
#   -> 52.7 / 143.1. Slower everywhere, more so the further
#   ahead: asking DRAM earlier for rows the stages then copy does not add useful bytes in
#   flight here (not profiled; the prefetches' line requests share the LSU path with
#   the copies, and further ahead the prefetched lines outlive their L2 residency).
#   The code is cfbd5d8's (common.WindowSlots.prefetch_window).
# Adopted at v24 for the backward, dropped for the forward (H200 sweep at 04a0978,
#   2026-11-30, perf-notes v24; the GPU suite passed with it on, 230 passed, memcheck 0
#   errors): the first row's window copied before the row walk at the window the row has
#   where every segment before it is whole blocks from token 0 (first token row * ratio:
#   every row of 1x8192 and 3x8192, the first segment of any pack), checked after the walk
#   and copied again where it differs (common.WindowSlots.stage_guess / fix_guess; was the
#   flag GUESS_FIRST_WINDOW), so the copies' latency overlaps the walk's dependent offset
#   loads. Same values: bitwise the same results. In the backward only with the
#   cooperative copies (d=512, the d=128 large-pack variant): the d=128 default backward
#   took 88 registers with it (2 CTAs an SM) and spilled 8 B held to 3.
#   Predicted fwd / fwd+bwd µs: 1x8192/128 5.3-5.5 / 14.6-15.0 -> 4.7-5.1 / 13.6-14.4,
#   1x8192/512 -0.2 .. -0.6 / -0.4 .. -1.2, 3x8192 within -0.3, ragged within +-0.5.
#   Measured, two runs each, off -> on: 1x8192/512 13.1 / 37.1-37.2 -> 12.8-13.1 /
#   36.0-36.1; 3x8192/128 10.8-11.3 / 28.1 -> 11.5-11.6 / 27.0; 3x8192/512 31.7-32.0 /
#   98.9-99.1 -> 31.2-31.6 / 98.7-98.8; 1x8192/128 5.6 / 15.0 -> 6.2 / 15.8; 2048x64
#   45.2-45.3 / 131.4-132.0 -> 46.5-46.7 / 131.4-131.7; ragged 5.2-5.3 / 12.6-12.7 ->
#   5.3-5.4 / 12.6; one-row pack 1x4 3.0-3.3 / 7.7-8.0 -> 3.1 / 7.9. So the cooperative
#   backwards gained (fwd+bwd minus fwd: 1x8192/512 -0.8 .. -1.1, 3x8192/128 -1.3 ..
#   -1.9), the d=128 forward lost 0.3-1.3 at every pack where it ran (not profiled; its
#   guess is right at 1x8192/128 and 2048x64, so there is no second copy, and a guess at
#   the cause: its walk and APE loads queue behind the window's copies, under a
#   64-register bound), and the d=512 forward
#   moved within noise. Adopted where it gained: the cooperative backwards.
# Measured and dropped at 982105f (H200 sweep, 2026-11-30, perf-notes v25; the GPU suite
#   passed with it on, 230 passed, memcheck 0 errors, no hang): FWD_BULK_RING, the
#   wide-vector short-window forward (d=512 bf16) staged by cp.async.bulk into a ring of 3
#   rows a row lane behind full/empty mbarriers, each row lane's first warp issuing
#   (pool_fwd_ring.py, with a CPU replay of its protocol, tests/test_ring_protocol_cpu.py,
#   both at 982105f). Predicted forward 3x8192/512 31.1 -> 28.5-30.5, 1x8192/512 13.1 ->
#   11.5-12.8. Measured, forward µs, off (two runs) / on (two runs): 3x8192/512 31.4-31.6 /
#   34.1-34.3, 1x8192/512 13.1-13.4 / 13.7-13.8; d=128 (not a ring) within noise. With
#   WHATIF_MATH=2 (no softmax) the ring's forward was 28.8 at 3x8192/512 and 11.5 at
#   1x8192/512, against the staged forward's 28.3 and 10.9 (v23): its memory path is no
#   better than the per-thread cp.async stages, and with the math on it lost 2.7 more
#   (not profiled; a guess: the issuing warp is also a computing one, so each refill
#   waits for the slowest warp of the row lane to release the stage, and it walks every
#   row twice).
# Measured and dropped at faf40a5 (H200 sweep, 2026-11-30, perf-notes v26; the GPU suite
#   passed with it on, 230 passed, memcheck 0 errors): BWD_APE_AFTER_WALKS, the staged
#   backward's per-row APE loads issued after the row walks (the issue-ahead row's and the
#   current row's) instead of before them, still before the stage's wait. ncu source
#   counters at 4afde98 put 41% of the 3x8192/512 backward's warp-state samples (2,665 of
#   6,508, long scoreboard) on the first integer instruction after the issue-ahead walk's
#   join, whose hot-path operands are registers set rows before: the wait there is for the
#   APE loads issued just before (one scoreboard for both). The SASS with the flag put the
#   APE loads after both joins, beside the stage's wait (79 registers, spill-free).
#   Predicted fwd+bwd 3x8192/512 98-99 -> 90-95. Measured (fwd+bwd µs, off twice / on
#   twice): 3x8192/512 97.2-98.9 / 99.9-100.4, 1x8192/512 36.8-37.2 / 37.7-37.9,
#   3x8192/128 27.5-27.6 / 28.3-28.4, 2048x64 129.9-130.2 / 132.2-132.7, 1x8192/128 and
#   ragged within noise. Why it lost was not profiled; a guess: the row's arithmetic needs
#   the APE values right after the stage's wait, so their latency stays exposed either
#   way, and loads issued later finish later.
# Measured and dropped at 9c518b0 (H200, 2026-11-30, perf-notes v26; with both on,
#   tests_bounds 47 passed, a 45-test subset of tests_fused passed and memcheck printed 0
#   errors): BWD_COPY_CG / FWD_COPY_CG, the cooperative 16-byte window copies as
#   cp.async.cg (L1 bypassed) instead of .ca, so that the backward's per-row APE reloads
#   would hit L1 (ncu at 9077b17: L1 hit rate 30%). Predicted fwd+bwd 3x8192/512 98-99 ->
#   92-96. Measured (fwd+bwd µs, off twice / backward's on / both on): 3x8192/512
#   98.2-98.8 / 99.5 / 99.0, 1x8192/512 36.7-37.2 / 36.9 / 36.9, 3x8192/128 27.8-27.9 /
#   27.5 / 27.6, 2048x64 129.9-130.9 / 129.5 / 130.9, 1x8192/128 and ragged within noise;
#   forward within noise. Nothing: the APE loads' latency is not L1 misses' (or L1 kept
#   them anyway); not profiled with the flags on.
# Unmeasured candidates, as the "K=V" settings that switch each on. A GPU session runs the
# suite with all of them on (CSA_CONFIG, tests/conftest.py) and sweeps each one; each
# carries its prediction (H200, µs, written before any measurement).
CANDIDATES = ()
# Adopted at v22 (H200 sweep at 38065f6, 2026-11-29, perf-notes v22; were the candidates
# LONG_SMEM_SPLIT, LONG_PDL, ZERO_FROM_TAIL; the GPU suite passed with all three on, 230
# passed, and memcheck printed 0 errors). Fwd / fwd+bwd us, two runs of the code before
# against each flag alone, then all three:
#   ratio 128 3x8192/512: 28.9-29.2 / 90.4-90.6; split 26.3 / 85.9; PDL 28.7 / 88.4;
#     zero walks 29.1 / 90.9; all 26.1 / 84.8
#   ratio 128 1x8192/128: 6.8 / 16.4-16.6; split 6.4 / 16.0; PDL 6.3 / 15.1; all 6.0 / 14.5
#   ratio 128 coff 2 1x8192/512: 36.0-36.3 / 99.7-99.9; split 42.2 / 103.2; PDL 35.6 /
#     97.3; all 41.7 / 100.4 (see the forward's padding below)
#   2048x64: 45.0-45.4 / 144.0-145.0; zero walks 44.8 / 134.5; all 44.7 / 134.0
#   1x131072, 1x8192/128 and the ragged pack at ratio 4: within noise for each.
# - The long kernels' shared columns (pool_long._LongShape.col): thread (chunk lane t,
#   element e) had column t * vec + e, so with 2-element vectors a warp's stores of one
#   slot and the serial sums' loads (one warp a vector element) hit every other bank
#   (2-way conflicts); now e * lanes + t. ncu at a794e5d (3x8192/512 ratio 128 forward):
#   L1/shared pipe 66%, barrier stalls 31%. Where a warp holds two slot groups (16 lanes
#   each: the backward, and the forward at coff 2) they still meet in the same banks
#   unless the slot stride is padded (pool_long.bank_stride): the backward pads (coff 1
#   stride 34; registers unchanged under its 2-CTA bound). The forward at coff 2 keeps the
#   old columns: split and padded (stride 33) it took 86 registers instead of 80, 2 CTAs
#   an SM instead of 3, and measured 42.2 against 36.0-36.3 above (held to 3 CTAs it
#   spilled 16 B; split without the padding it still took 86, ptxas sm_90a). Same sums in
#   the same order: bitwise the same results. Predicted 3x8192/512 forward -2 to -5
#   (measured -2.8), backward alone -2 to -6 (-1.9).
# - The long forward and backward as programmatic dependents (griddepcontrol.wait first;
#   the backward lets its dape sum be scheduled early), as the short-window kernels since
#   v15. Predicted ratio 128 1x8192/128 fwd+bwd -0.3 to -1.0 (measured -1.4), 3x8192/512
#   within noise (-2.1).
# - Zero-fill walks from the first unread block (pool_bwd.first_unread): a zero-fill
#   thread that has to walk starts at the first block of its segment that is not read
#   (coff 1) or not read with its successor (coff 2); the tokens before it would store
#   nothing (tests/test_zero_fill_cpu.py). With coff 2 every segment's last block leaves
#   its first d columns unread, so in 2048x64 half the zero threads walked all 32 of their
#   tokens for 4 tokens' zeros. Predicted 2048x64 fwd+bwd -3 to -8 (measured -10).
#   With the split columns the forward's shape constants were swept again (H200 at
#   f93ab05, ratio 128, fwd / fwd+bwd us, 3x8192/512 and 1x8192/128): the defaults 25.5-26.0
#   / 83.8-85.3 and 5.9-6.3 / 14.4-14.8; LONG_SLOTS_PER_THREAD=8 31.1 / 90.1 and 6.2 /
#   14.7; LONG_CTA_THREADS=512 37.0 / 98.0 and 7.5 / 15.7; 128 30.0 / 89.0 and 6.4 / 15.1.
#   The defaults stay.
#   The seeded segment search (SEARCH_SEED, measured at 748cd3e: 2048x64 fwd+bwd
#   144.2-144.6 against 143.0-144.3, predicted -2 to -4) was dropped: the walks, not the
#   searches, were that pack's gap.
# The dape sum's wide layout (dape_reduce.py; was the candidate DAPE_WIDE): partials of at
# least REDUCE_WIDE_MIN_CHUNKS column vectors (ratio 128: C = 128 * d) and at most
# REDUCE_WIDE_MAX_ROWS rows are summed in CTAs of REDUCE_WIDE_COL_LANES column lanes by
# REDUCE_WIDE_ROW_LANES row lanes instead of 8 x 64; launch.dape_sum picks the layout on
# the host from the partials' rows. ncu at a794e5d (perf-notes v21): at 3x8192/512 ratio
# 128 the 8 x 64 sum took 7.9 us for 4 MB, 2,048 CTAs over 16 partial rows, 48 of each
# CTA's 64 row lanes idle. Predicted (H200, fwd+bwd us): ratio 128 3x8192/512 -2 to -3,
# 1x8192/128 -0.5 to -1.5. H200 sweep at 748cd3e (2026-11-29, two runs each, fwd+bwd us,
# 8 x 64 -> 64 x 8 for every C of 4,096 vectors or more): ratio 128 3x8192/512 (16 rows
# of 65,536) 93.3-93.6 -> 90.4-90.5; ratio 128 1x8192/128 (64 rows of 16,384)
# 16.3 -> 16.9; the ratio 4 shapes (C <= 1,024 vectors) unchanged. So the layout follows
# the rows: wide at 16 rows, the default at 64; REDUCE_WIDE_MAX_ROWS = 32 splits the two
# measured points (rows in between not measured).
REDUCE_WIDE_MIN_CHUNKS = 4096
REDUCE_WIDE_MAX_ROWS = 32
REDUCE_WIDE_COL_LANES = 64
REDUCE_WIDE_ROW_LANES = 8
# A sweep knob, not a candidate (it does not compile spill-free, so it cannot be adopted
# as it is): compile the short-window backward for this many resident CTAs an SM (a
# register bound) and size its grid for them. ncu at 33c6121 (3x8192/512): 80 registers,
# 6 CTAs of 128 threads an SM, 5.2 warps a scheduler, 46% of cycles with no eligible
# warp, 0.54 issued a cycle: latency-bound at low occupancy. ptxas, bf16 d=512: 8 -> 64
# registers and 8 B of spills (sm_90a and sm_100a); 7 -> 72 registers and 168 B of
# spills on sm_90a, 70 and none on sm_100a. Predicted with 8: 3x8192/512 backward -3 to
# -6 us, 1x8192/512 -1 to -2; d=128 (3 CTAs an SM, held by shared memory) unchanged.
# Measured (H200 sweep at dda586f, fwd+bwd us, 0 / 8 / 7): 3x8192/512 103.3 / 110.8-110.9
# / 122.2, 1x8192/512 40.6 / 43.1-43.3 / 48.9, d=128 unchanged. ncu with 8: 6.9 warps a
# scheduler (from 5.2), still 0.53 issued a cycle, DRAM 59% (from 64%), 53k local-memory
# requests: more resident warps do not help; the memory pipeline, not latency hiding,
# is the limit (which COOP_STAGING then confirmed). Off.
BWD_BOUND_CTAS_PER_SM = 0
# BWD_COOP_MAX_CTAS: the cooperative backward (d=512 on sm_90) is held to the CTAs its
# grid is sized for (pool_bwd), but by coff, a window of more than E elements a thread
# (slots x vector elements) to at most C CTAs, for each (E, C) listed. Held to what
# shared memory fits, ptxas sm_90a spilled (tools/spill_survey.py, bf16 d=512, 2-element
# vectors): ratio 6 coff 2 8 B and ratio 7 coff 2 312 B at 5 CTAs (96 registers; 126 at
# 4), ratio 9 coff 1 228 B and ratio 10 coff 1 152 B at 6 (80; 95-96 at 5), ratio 11
# coff 1 160 B and ratio 12 coff 1 12 B at 5; coff 1 windows need more registers than
# coff 2 ones of as many elements (ratio 5 coff 2, 20 elements: 80 at 6, spill-free).
# H200 sweep at c3f4165 (2026-11-30, perf-notes v27, as BWD_BOUND_CTAS_PER_SM=4, fwd+bwd
# µs, 5 twice / 4 twice): 3x8192/512 ratio 7 coff 2 127.3-127.5 -> 101.2-101.7,
# 1x8192/512 ratio 7 coff 2 52.7-53.2 -> 40.0, 3x8192/512 ratio 6 coff 2 100.3-100.8 ->
# 98.4-98.5; at 1161318 (BWD_BOUND_CTAS_PER_SM=6 twice, the spilling 6, against the default
# 5 twice): 3x8192/512 ratio 9 coff 1 65.4-66.0 -> 50.7-51.2, 1x8192/512 ratio 10 coff 1
# 27.6-27.8 -> 23.2-23.4.
BWD_COOP_MAX_CTAS = {1: ((20, 4), (16, 5)), 2: ((20, 4),)}
DIV_FAST_MIN = 2.0 ** -64
LONG_SLOTS_PER_THREAD = 16
LONG_CTA_THREADS = 256
LONG_VEC_BYTES = 4
# 512-thread CTAs cap ptxas at 128 registers: the long backward spilled 104 B there.
LONG_BWD_CTA_THREADS = 256
LONG_BWD_SLOTS_PER_THREAD = 16
LONG_BWD_VEC_BYTES = 4
LONG_BWD_CTAS_PER_SM = 2
# LONG_WIDE_MIN_SLOTS: the slots a thread of the long kernels follow the window. Windows of
# at least this many slots take LONG_SLOTS_PER_THREAD (forward) / LONG_BWD_SLOTS_PER_THREAD
# (backward, where that leaves a row at least LONG_BWD_MIN_COL_GROUPS CTAs: d=512, not
# d=128); shorter ones, and the backward's rows of few columns, LONG_NARROW_SLOTS_PER_THREAD.
# The backward with 8 slots a thread is held to LONG_BWD_NARROW_CTAS_PER_SM (80 registers,
# its values in shared memory), with 16 to LONG_BWD_CTAS_PER_SM (127 registers; held to 3
# it spilled 384 B), as is the register path (odd head_dim). H200 sweep at 9bc4640
# (2026-11-30, perf-notes v28; fwd / fwd+bwd µs, defaults twice -> variant once; written
# after the sweep, no prediction was set down for these):
# - backward 16 slots held to 2: ratio 128 3x8192/512 24.1-24.4 / 72.6-73.3 -> 24.2 / 70.2
#   (backward alone 48.5-48.9 -> 46.0), coff 2 1x8192/512 32.0-32.2 / 83.3-84.1 -> 32.2 /
#   74.4 (51.3-51.9 -> 42.2), 1x8192/128 5.5-5.6 / 14.3-14.4 -> 5.6 / 15.7 (8.8 -> 10.1:
#   two CTAs a row instead of four, 128 row CTAs for 132 SMs), ratio 16 coff 2 3x8192/128
#   16.0-16.2 / 38.9-39.3 -> 16.1 / 47.3 (22.9-23.1 -> 31.2: two slot groups);
# - forward 8 slots: ratio 16 coff 2 3x8192/128 16.0-16.2 -> 14.0, ratio 128 3x8192/512
#   24.1-24.4 -> 28.4, coff 2 1x8192/512 32.0-32.2 -> 35.8;
# - slower, not taken: the forward's 128-thread CTAs (3x8192/512 25.7), the backward's 4
#   slots held to 4 or 5 CTAs (backward alone 3x8192/512 69.9 and 72.4) and 128-thread CTAs
#   held to 6 (56.1).
# The rule keeps each measured winner and the 1x8192/128 and ratio-16 backwards as they were.
LONG_WIDE_MIN_SLOTS = 64
LONG_NARROW_SLOTS_PER_THREAD = 8
LONG_BWD_MIN_COL_GROUPS = 4
LONG_BWD_NARROW_CTAS_PER_SM = 3
# LONG_SUM_AHEAD: the long kernels' serial sums (pool_long._LongShape.serial_sum: the
# softmax denominator, the forward's output and the backward's S, each 128 dependent adds
# over shared memory by 2 of a CTA's warps while the others wait at a barrier) unrolled,
# each load written this many slots before its add. The loop before (unroll 8) loaded a
# batch of 8, then added it (SASS, sm_90a), so every 8 adds waited a shared-memory
# latency first; ncu at a794e5d put 31% of the forward's stall cycles on CTA barriers.
# ptxas schedules the unrolled loads itself (8 and 16 give the same SASS); same adds, same
# order, bitwise the same results. Predicted (H200, ratio 128 coff 1, fwd / fwd+bwd µs):
# 3x8192/512 25.9 / 84.9 -> 24-25 / 80-83, 1x8192/128 6.1 / 14.7 -> 5.8-6.1 / 14.0-14.6.
# Measured (H200 sweep at 0d9e231, 2026-11-30, perf-notes v28; loop twice -> unrolled):
# 3x8192/512 25.5-26.3 / 83.7-85.3 -> 24.6 / 79.1, 1x8192/128 5.9-6.0 / 14.5-14.6 -> 5.5 /
# 13.6, coff 2 1x8192/512 35.6-36.1 / 93.5-93.7 -> 32.5 / 83.9, ratio 16 coff 2 3x8192/128
# 16.4-16.7 / 42.6-42.8 -> 16.1 / 41.7. Adopted.
LONG_SUM_AHEAD = 8
# The long backward's values in shared memory (pool_long.LongPoolBackward, was the
# candidate LONG_BWD_SHARED_VALUES): cp.async copies the window's values into shared memory
# and reads them back at the products, and p*dp lives only in the shared buffer its serial
# sum reads, so a thread no longer holds the window's values (and then p*dp) in registers
# across the softmax. ptxas (bf16 ratio 128 coff 1 d=512): 95-96 registers at 2 CTAs an SM
# -> 80 held to 3, spill-free on sm_90a and sm_100a (held to 4: 40-48 B of spills).
# Predicted (backward alone = fwd+bwd - fwd, µs): 3x8192/512 ~59 -> 48-54, 1x8192/128 ~8.6
# -> 8-8.6. Measured (sweep at 0d9e231; backward alone, loop sums, off twice -> on):
# 3x8192/512 58.2-59.0 -> 51.1, ratio 16 coff 2 3x8192/128 26.1-26.2 -> 23.2, coff 2
# 1x8192/512 57.6-57.9 -> 56.1, 1x8192/128 8.6 -> 9.2 (64 rows, one a CTA either way: the
# round trip through shared memory costs a lone row). With the unrolled sums: 3x8192/512
# 54.5 -> 52.0, 1x8192/128 8.1 -> 8.9. Adopted for every vector cp.async can copy: the
# large packs gain 2.5-8 µs a step, the 1x8192/128 step loses 0.6-0.8. These figures are
# at 8 slots a thread; LONG_WIDE_MIN_SLOTS has the wide windows' 16.
# Measured and dropped at 0d9e231 (same sweep): LONG_FWD_SHARED_VALUES, the same for the
# long forward (64 registers unbounded instead of 80, so 4 CTAs an SM by registers and by
# its 52 KB of shared memory, carveout set for them). Predicted 3x8192/512 forward 25.9 ->
# 21-23; measured 25.5-26.3 -> 30.0, 1x8192/128 5.9-6.0 -> 6.8; only coff 2 1x8192/512
# gained (35.6-36.1 -> 33.6). Not profiled; 0d9e231 has the code.

def parse_overrides(spec: str) -> dict:
    """``"K=V,K=V"`` (the probes' and sweeps' notation) as {name: int}; unknown names raise."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, val = item.split("=")
        if key not in globals() or not key.isupper():
            raise KeyError(f"config has no constant {key!r}")
        if isinstance(globals()[key], dict):
            raise KeyError(f"config constant {key!r} is a table, not a sweep knob")
        out[key] = int(val)
    return out


def override(spec: str) -> None:
    """Set the constants of ``spec`` (see parse_overrides) for this process."""
    globals().update(parse_overrides(spec))


def vector_elems(head_dim: int, elem_bytes: int, vec_bytes: int | None = None) -> int:
    # Read at call time (not as a default argument) so a probe can override VEC_BYTES.
    vec = max(1, (VEC_BYTES if vec_bytes is None else vec_bytes) // elem_bytes)
    while vec > 1 and (head_dim % vec or head_dim // vec < MIN_CHUNKS_PER_ROW):
        vec //= 2
    return vec


def forward_vector_elems(head_dim: int, elem_bytes: int, slots: int = 0) -> int:
    """vector_elems, then halved while a row has fewer than FWD_MIN_CHUNKS_PER_ROW chunks,
    or a window of ``slots`` slots holds more than FWD_MAX_WINDOW_ELEMS elements a thread
    (where that knob is set), and the half is still FWD_MIN_VEC_BYTES or more."""
    vec = vector_elems(head_dim, elem_bytes)

    def wide(v):
        return (head_dim // v < FWD_MIN_CHUNKS_PER_ROW
                or bool(FWD_MAX_WINDOW_ELEMS) and slots * v > FWD_MAX_WINDOW_ELEMS)

    while wide(vec) and vec % 2 == 0 and (vec // 2) * elem_bytes >= FWD_MIN_VEC_BYTES:
        vec //= 2
    return vec


def ctas_fitting_registers(regs: int, threads: int) -> int:
    """CTAs of ``threads`` threads at ``regs`` registers a thread that one SM holds by its
    registers and threads (each register partition holds whole warps)."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    warps_by_regs = REGS_PER_SM // REG_PARTITIONS // per_warp * REG_PARTITIONS
    return min(min(warps_by_regs, MAX_THREADS_PER_SM // 32) // warps, MAX_CTAS_PER_SM)


def smem_carveout() -> int | None:
    return None if SMEM_CARVEOUT < 0 else SMEM_CARVEOUT


def long_window(num_slots: int) -> bool:
    return num_slots > MAX_REG_SLOTS


def long_slots_per_thread(num_slots: int, most: int) -> int:
    return max(c for c in range(1, most + 1) if num_slots % c == 0)


def dape_vector(cols: int) -> int:
    """Columns of one load in the dape sum: 16-byte loads where C allows."""
    return next(v for v in (4, 2, 1) if cols % v == 0)


def dape_has_wide(cols: int) -> bool:
    """Whether partials of ``cols`` columns have the wide layout as well (REDUCE_WIDE_*)."""
    return cols // dape_vector(cols) >= REDUCE_WIDE_MIN_CHUNKS
