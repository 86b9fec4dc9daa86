"""Constants that shape the pooling kernels, in one place.

VEC_BYTES / BWD_VEC_BYTES: bytes one thread moves per tensor row and slot in the forward
  and backward. The vector shrinks (never below one element) until it divides head_dim.
  Forward at 3x8192/512 (H200, tools/perf_probe.py sweep at 8e6a9c5): 8 B 43.1 us, 16 B
  55.0, 4 B 53.2; at 1x8192/128 4 B was faster (7.1 vs 8.5 us), not yet used. The
  backward holds three window-sized register arrays (scores, values, dape partials), so it
  uses narrower vectors and more threads.
MIN_CHUNKS_PER_ROW: shrink the vector further while a row would have fewer chunks than
  this, so that one row still fills a warp (d=128 bf16 -> 4-element vectors, 32 lanes).
MAX_CTA_THREADS: column lanes of one CTA; wider rows are split over grid.y.
MAX_REG_SLOTS: windows of at most this many slots live in registers and are read once
  (pool_fwd.py / pool_bwd.py); longer ones go to the slot-parallel kernels.
FWD_CTA_THREADS: forward CTAs stack row lanes on top of the column lanes up to this many
  threads. 128 beat 256 at 3x8192/512 in the register-resident forward (64.0 vs 83.9 us,
  equal at 1x8192/128; tools/perf_probe.py sweep, H200, 2026-11-29).
FWD_STAGES / FWD_SMEM_PER_CTA: rows a forward thread keeps in flight through cp.async
  (pool_fwd.py), fewer when a stage would push the CTA's shared memory past the budget
  (never fewer than 2, or nothing overlaps). 2 and 3 stages measured equal (43.0-43.4 us
  at 3x8192/512, also with 5 CTAs per SM; sweep at 8e6a9c5).
FWD_TARGET_CTAS_PER_SM / FWD_MAX_ROWS_PER_THREAD: each forward thread walks as many rows
  as make the grid one wave of this many CTAs per SM (what fits: 48 KB of staging and
  <= 128 registers a thread; fewer where the staging is larger), at most the cap.
SMEM_PER_SM / SMEM_RESERVED_PER_CTA: shared memory of an SM on sm_90 and sm_100 (228 KB)
  and what the driver reserves per CTA (1 KB, ncu "Driver Shared Memory Per Block").
BWD_TARGET_CTAS_PER_SM: the backward carries per-CTA dape partials, so its row CTAs walk
  several rows each to keep the partials (and their reduction) small.
BWD_STAGES: rows a backward thread keeps in flight through cp.async (window + grad_out);
  3 by analogy with the forward, not swept. A backward thread does half the forward's
  columns a row (4-byte vectors), so 2 rows ahead is about half the forward's lead time
  on the same memory latency: sweep 5 and 6.
BWD_FIT_SMEM: candidate, off until measured: size the backward grid for the CTAs whose
  shared memory fits an SM, as the forward does since f1b9dcf. At d=128 (256-thread CTAs,
  68.6 KB of staging and reduction buffers) only 3 fit, so a grid sized for
  BWD_TARGET_CTAS_PER_SM = 4 runs 1.3 waves (1x8192/128: 512 row CTAs for 396 slots).
BWD_CACHED_WALK / BWD_APE_REGS: candidates, off until a GPU run measures them: the
  forward's v9 changes for the backward (row walks that keep their segment's span in
  registers; the APE values of the thread's slots loaded once into registers). In the
  forward together they took 3x8192/512 from 43.2 to 39.7 us. Same op order, so results
  must be bitwise those of the default. ptxas (sm_90a, bf16 ratio 4 coff 2): 80 registers
  a thread by default, 96 (d=512) / 105 (d=128) with both, which at d=128 (256-thread
  CTAs) fits 2 CTAs per SM instead of 3: measure each on its own.
WARP_SEGMENT_SEARCH: candidate, off until measured: where every warp is 32 active column
  lanes of one row lane (common.WindowSlots.warp_uniform), the first segment search of a
  walk runs as a 32-ary warp search (common.find_segment_warp): ceil(log32 B) + 1
  dependent loads at most instead of log2 B. Aimed at latency-bound small packs and packs
  of many sequences (2048x64: 3 dependent loads instead of 11 before the first copy).
STATIC_SLOT_OFFSETS / BF16_BIT_WIDEN: candidates, off until measured: fewer instructions
  for the same memory operations (the ratio-4 forward is issue-limited: ~1,000 warp
  instructions a warp-row at 62% issue efficiency, ncu at 8e6a9c5). STATIC_SLOT_OFFSETS:
  one base pointer a row for the window's copies and the backward's stores, each slot at a
  constant offset, instead of a 64-bit address per copy. BF16_BIT_WIDEN: bf16 -> fp32 as
  a shift or a mask of the 32-bit word (one instruction an element, not three a pair).
  SASS (tools/sass_probe.py, sm_90a, bf16 ratio 4 coff 2 d 512), whole kernel: forward
  2000 -> 1904 / 1968 / 1872 (one, the other, both), of which about 32 + 32 in the row
  loop; backward 1616 -> 1456 / 1600 / 1440.
BWD_CTA_THREADS: backward CTAs of register-resident windows stack row lanes on top of the
  column lanes up to this many threads; their dape partials meet in shared memory.
LONG_SLOTS_PER_THREAD / LONG_CTA_THREADS / LONG_VEC_BYTES / LONG_BWD_CTAS_PER_SM: windows
  longer than MAX_REG_SLOTS (ratio 128) use the slot-parallel kernels (pool_long.py): a
  CTA holds one row at a time, its threads split the slots (this many each) and the
  columns; the serial sums run over shared memory in slot order, so results stay bitwise
  equal to the fp32 reference. The one-thread-per-row design ran ratio 128 at 2-11% of
  the floor (61 us forward at 1x8192/128, H200, 2026-11-29).
DIV_FAST_MIN: smallest softmax numerator that takes the shared-reciprocal division
  (common.divide_column); with denominators in [1, 2^40] every intermediate of the fast path stays
  a normal number from there up, so it is exact (tests/test_division_cpu.py). Smaller ones
  take a true division.
ZERO_TOKENS_PER_THREAD: consecutive tokens each thread of a gradient zero-fill CTA walks
  (one segment search, then registers). 2 tokens a thread with a search each made 25k
  zero CTAs at 3x8192/512 (ncu: backward 104.5 us, DRAM 38%); 32 brought it to 88.7 us.
"""

VEC_BYTES = 8
BWD_VEC_BYTES = 4
MIN_CHUNKS_PER_ROW = 32
MAX_CTA_THREADS = 128
MAX_REG_SLOTS = 16
FWD_CTA_THREADS = 128
FWD_STAGES = 3
FWD_SMEM_PER_CTA = 48 * 1024
FWD_TARGET_CTAS_PER_SM = 4
FWD_MAX_ROWS_PER_THREAD = 64
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
BWD_TARGET_CTAS_PER_SM = 4
BWD_CTA_THREADS = 256
BWD_STAGES = 3
BWD_CACHED_WALK = 0
BWD_APE_REGS = 0
WARP_SEGMENT_SEARCH = 0
STATIC_SLOT_OFFSETS = 0
BF16_BIT_WIDEN = 0
BWD_FIT_SMEM = 0
ZERO_TOKENS_PER_THREAD = 32
DIV_FAST_MIN = 2.0 ** -64
LONG_SLOTS_PER_THREAD = 8
LONG_CTA_THREADS = 512
# 512-thread CTAs cap ptxas at 128 registers: the long backward spilled 104 B there.
LONG_BWD_CTA_THREADS = 256
LONG_VEC_BYTES = 8
LONG_BWD_CTAS_PER_SM = 2
# The flags above that switch an unmeasured candidate on (tests/test_candidates_gpu.py).
CANDIDATES = ("BWD_CACHED_WALK", "BWD_APE_REGS", "WARP_SEGMENT_SEARCH", "STATIC_SLOT_OFFSETS",
              "BF16_BIT_WIDEN", "BWD_FIT_SMEM")


def parse_overrides(spec: str) -> dict:
    """``"K=V,K=V"`` (the probes' and sweeps' notation) as {name: int}; unknown names raise."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, val = item.split("=")
        if key not in globals() or not key.isupper():
            raise KeyError(f"config has no constant {key!r}")
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


def long_window(num_slots: int) -> bool:
    return num_slots > MAX_REG_SLOTS


def long_slots_per_thread(num_slots: int) -> int:
    return max(c for c in range(1, LONG_SLOTS_PER_THREAD + 1) if num_slots % c == 0)
