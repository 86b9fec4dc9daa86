"""Row geometry on the device: which segment a row or token lies in (segment searches),
a row's window (first token, whether its previous block exists, whether it fits the
tokens), and the row walks that carry a segment's bounds from row to row."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class Pack:
    """A launch's pack on the device: the offsets ``cu`` (tokens) and ``cuc`` (rows), the
    row count (output rows: padding rows included), token count and segment count. Plain
    trace-time Python, as flash-attention's SeqlenInfo: one argument where the row walks
    and window checks took five."""

    __slots__ = ("cu", "cuc", "num_rows", "num_tokens", "num_seqs")

    def __init__(self, cu, cuc, num_rows, num_tokens, num_seqs):
        self.cu, self.cuc = cu, cuc
        self.num_rows, self.num_tokens, self.num_seqs = num_rows, num_tokens, num_seqs


@cute.jit
def find_segment(cu: cute.Tensor, x: Int32, num_seqs: Int32) -> Int32:
    """Largest s in [0, B] with cu[s] <= x (upper bound - 1) over the non-decreasing offsets;
    returns B when x is at or beyond cu[B]. log2(B) cached loads."""
    lo = Int32(0)
    n = num_seqs
    while n > 0:
        half = n // 2
        if cu[lo + half + 1] <= x:
            lo = lo + half + 1
            n = n - half - 1
        else:
            n = half
    return lo


@cute.jit
def find_segment_warp(cu: cute.Tensor, x: Int32, num_seqs: Int32) -> Int32:
    """find_segment with the 32 lanes of a warp probing together: every lane must be active
    and search the same ``x``. Each round the lanes probe 32 evenly spaced offsets of the
    interval left and one ballot narrows it to one gap: ceil(log32(B)) + 1 dependent loads
    at most instead of log2(B) (B = 6: 1 instead of 3; B = 2048: 3 instead of 11). The
    upper bound for non-decreasing offsets; in [0, B] and terminating for any offsets
    (tests/test_segment_search_cpu.py replays it)."""
    lo = Int32(0)
    hi = num_seqs
    lane = cute.arch.lane_idx()
    while hi > lo:
        step = (hi - lo + 31) // 32
        p = lo + 1 + lane * step
        hit = (p <= hi) & (cu[cutlass.min(p, hi)] <= x)  # the clamped load is in [1, B]
        k = cute.arch.popc(cute.arch.vote_ballot_sync(hit))
        # Probes 0..k-1 hit, probe k (if in range) missed: the answer lies in
        # [lo + 1 + (k-1)*step, lo + k*step] (or [lo, lo] when k = 0).
        new_lo = lo
        if k > 0:
            new_lo = lo + 1 + (k - 1) * step
        hi = cutlass.min(hi, lo + k * step)
        lo = new_lo
    return lo


@cute.jit
def in_bounds(t0: Int32, has_prev, num_tokens: Int32, ratio: cutlass.Constexpr[int],
              coff: cutlass.Constexpr[int]):
    """The window of first token ``t0`` lies in [0, T). Written so that nothing overflows:
    offsets are not read on the host, so t0 can be anything an int32 holds, and
    ``t0 + ratio <= T`` wrapped to a negative for t0 near 2^31 and let such a window
    through (out-of-bounds reads and writes)."""
    ok = (t0 >= 0) & (t0 <= num_tokens - ratio)
    if cutlass.const_expr(coff == 2):
        ok = ok & ((~has_prev) | (t0 >= ratio))
    return ok


@cute.jit
def row_window(cu: cute.Tensor, cuc: cute.Tensor, s: Int32, row: Int32, num_seqs: Int32,
               num_tokens: Int32, ratio: cutlass.Constexpr[int], coff: cutlass.Constexpr[int]):
    """Geometry of output row ``row`` of segment ``s`` (``s == B``: past the true rows):
    (first token t0, has previous block, real row, in bounds).

    Padding rows (at or beyond cu_seqlens_comp[B]) are a first block at token 0. ``ok`` is
    False where the window would leave [0, T) (offsets inconsistent with each other, or
    T < ratio for a padding row): such a row is written as zeros and reads nothing.
    """
    real = s < num_seqs
    t0 = Int32(0)
    i = Int32(0)
    if real:
        i = row - cuc[s]
        t0 = cu[s] + i * ratio
    has_prev = i > 0
    ok = in_bounds(t0, has_prev, num_tokens, ratio, coff)
    return t0, has_prev, real, ok


@cute.jit
def advance_segment(cu: cute.Tensor, s: Int32, x: Int32, num_seqs: Int32) -> Int32:
    """Walk ``s`` forward to the segment holding ``x`` (x non-decreasing between calls):
    consecutive rows or tokens of one CTA pay one binary search, then O(1) steps."""
    while (s < num_seqs) & (cu[cutlass.min(s + 1, num_seqs)] <= x):
        s = s + 1
    return s


@cute.jit
def segment_rows(cu: cute.Tensor, cuc: cute.Tensor, s: Int32, num_seqs: Int32):
    """(first row, end row, first token) of segment ``s``; past the last segment an endless
    span (padding rows)."""
    r0, r1, tok = Int32(0), Int32(2**31 - 1), Int32(0)
    if s < num_seqs:
        r0 = cuc[s]
        r1 = cuc[s + 1]
        tok = cu[s]
    return r0, r1, tok


@cute.jit
def walk_rows(cu: cute.Tensor, cuc: cute.Tensor, walk, row: Int32, num_seqs: Int32):
    """Advance a cached row walk ``(s, first row, end row, first token)`` to ``row``
    (non-decreasing between calls). Offsets load only when ``row`` leaves the cached
    segment, so consecutive rows pay no dependent L1 loads (ncu: these and the APE loads
    made the forward's top stall, long scoreboard)."""
    s, r0, r1, tok = walk
    if row >= r1:
        s = advance_segment(cuc, s, row, num_seqs)
        r0, r1, tok = segment_rows(cu, cuc, s, num_seqs)
    return s, r0, r1, tok


@cute.jit
def start_walk(cu: cute.Tensor, cuc: cute.Tensor, row: Int32, num_seqs: Int32,
               warp: cutlass.Constexpr[bool] = False):
    """A cached row walk at ``row``; ``warp``: the whole warp starts at the same row (see
    find_segment_warp)."""
    if cutlass.const_expr(warp):
        s = find_segment_warp(cuc, row, num_seqs)
    else:
        s = find_segment(cuc, row, num_seqs)
    r0, r1, tok = segment_rows(cu, cuc, s, num_seqs)
    return s, r0, r1, tok


@cute.jit
def walk_window(walk, row: Int32, num_seqs: Int32, num_tokens: Int32,
                ratio: cutlass.Constexpr[int], coff: cutlass.Constexpr[int]):
    """row_window from a cached walk: (first token, has previous block, in bounds)."""
    s, r0, _, tok = walk
    t0 = Int32(0)
    i = Int32(0)
    if s < num_seqs:
        i = row - r0
        t0 = tok + i * ratio
    has_prev = i > 0
    ok = in_bounds(t0, has_prev, num_tokens, ratio, coff)
    return t0, has_prev, ok
