"""The backward's grid, shared by the register-resident and the slot-parallel backward:
row CTAs (the kernel's own work) then zero-fill CTAs for every column group, and the
zero-fill walk that writes exact zeros to the elements no computed row reads, so gradient
buffers may start uninitialised."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .segments import Pack, advance_segment


class BackwardGrid:
    """Needs the kernel's dtype, ratio, coff, cpr, vec, lanes, row_lanes, col_groups,
    smem_bytes, carveout, min_ctas, tuning ``t``, ``search`` and a ``kernel`` taking
    (tensors..., num_rows, num_tokens, rows_per_cta, num_row_ctas)."""

    interleave = False  # column groups interleaved in a 1-D grid (see grid())
    has_large_variant = False  # a second compiled variant for large packs
    large_guesses = False  # ... which copies its first row at a guess

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mGrad: cute.Tensor, mDKV: cute.Tensor, mDScore: cute.Tensor,
                 mWork: cute.Tensor, rows_per_cta: Int32, num_row_ctas: Int32, num_zero_ctas: Int32,
                 stream):
        tiler = (1, self.vec)
        self.kernel(
            cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
            cute.zipped_divide(mApe, tiler), mCu, mCuc, cute.zipped_divide(mGrad, tiler),
            cute.zipped_divide(mDKV, tiler), cute.zipped_divide(mDScore, tiler),
            cute.zipped_divide(mWork, tiler), mGrad.shape[0], mKV.shape[0], rows_per_cta,
            num_row_ctas,
        ).launch(grid=self.grid(num_row_ctas + num_zero_ctas),
                 block=[self.lanes, self.row_lanes, 1], smem=self.smem_bytes, stream=stream,
                 use_pdl=True, preferred_smem_carveout=self.carveout,
                 min_blocks_per_mp=self.min_ctas)

    def grid(self, ctas):
        """``ctas`` row and zero CTAs for each column group. Where there are several groups
        (d=512 bf16: 2), they are the fastest-varying index of a 1-D grid, so every row CTA
        of every group is dispatched before any zero CTA. With the groups on grid.y, group
        1's row CTAs queued behind group 0's zero CTAs (docs/lab/ceilings.md has the
        measurement)."""
        if self.interleave:
            return [ctas * self.col_groups, 1, self.grid_z()]
        return [ctas, self.col_groups, self.grid_z()]

    @cute.jit
    def cta_coords(self):
        """(row or zero CTA index, column group) of this CTA; see grid()."""
        bx, by, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.interleave):
            by = bx % self.col_groups
            bx = bx // self.col_groups
        return bx, by

    @cute.jit
    def segment_span(self, pk: Pack, s):
        """(first token, end token, blocks, first row) of segment ``s``; past the last
        segment an endless span with no blocks (nothing there is read)."""
        start, end, nb, rowb = Int32(0), Int32(2**31 - 1), Int32(0), Int32(0)
        if s < pk.num_seqs:
            start = pk.cu[s]
            end = pk.cu[s + 1]
            nb = (end - start) // self.ratio
            rowb = pk.cuc[s]
        return start, end, nb, rowb

    @cute.jit
    def zero_unread(self, pk: Pack, gDKV, gDSc, t0, chunk):
        """Zeros for the elements of tokens t0 .. t0 + ZERO_TOKENS_PER_THREAD - 1 that no
        computed row reads. One segment search, then the segment's span stays in registers
        until a token crosses its end (a search per token made this pass a chain of
        dependent loads and ~40% of the backward at 3x8192/512)."""
        cpr = self.cpr
        zero = cute.make_rmem_tensor((self.vec,), self.dtype)
        zero.fill(0.0)
        zero_s = cute.make_rmem_tensor((self.vec,), gDSc.element_type)  # fp32 where asked
        zero_s.fill(0.0)
        own_col = chunk + (cpr if cutlass.const_expr(self.coff == 2) else 0)
        s = self.search(pk.cu, cutlass.min(t0, pk.num_tokens), pk.num_seqs)
        start, end, nb, rowb = self.segment_span(pk, s)
        # The walk starts at the segment's first unread block (lab tuning-long.md, "Zero-fill walks
        # from the first unread block"); a thread whose tokens are all read (almost every
        # zero CTA in a pack of full sequences) walks none.
        j0 = self.first_unread(t0, self.t.ZERO_TOKENS_PER_THREAD, start, end, nb, rowb,
                               pk.num_rows)
        self.zero_tokens(pk, gDKV, gDSc, t0, chunk, (zero, zero_s), own_col, s, (start, end, nb, rowb),
                         j0)

    @cute.jit
    def first_unread(self, t0, Z: int, start, end, nb, rowb, num_rows):
        """How many of tokens t0 .. t0 + Z - 1 zero_tokens may skip:
        those of segment [start, end) before its first block that is not read with its
        successor (coff 2) or not read (coff 1), where it would store nothing
        (tests/test_zero_fill_cpu.py). Only for spans whose arithmetic cannot overflow
        int32 (0 <= start <= end, so end - start and start + k * ratio <= end stay in range);
        0 otherwise, and the walk covers every token as before."""
        k = cutlass.min(nb, num_rows - rowb) - int(self.coff == 2)
        j0 = Int32(0)
        if (start >= 0) & (end >= start) & (t0 >= start) & (k > 0):
            j0 = cutlass.min(cutlass.max(start + k * self.ratio - t0, Int32(0)), Int32(Z))
        return j0

    @cute.jit
    def block_read(self, blk, row, nb, num_rows):
        """Block ``blk`` of a segment of ``nb`` blocks is a computed row's (``row``) current
        block. A token's own columns are read iff its block is; with coff 2 its first d
        columns iff the next block is (as that row's previous block)."""
        return (blk < nb) & (row < num_rows)

    @cute.jit
    def zero_tokens(self, pk: Pack, gDKV, gDSc, t0, chunk, zeros, own_col, s, span, j0):
        """zero_unread's walk over its tokens from t0 + j0, from segment ``s``'s ``span``
        (segment_span's); ``zeros``: a zero vector of dkv's and of dscore's type."""
        ratio, num_rows = self.ratio, pk.num_rows
        zero, zero_s = zeros
        start, end, nb, rowb = span
        for j in cutlass.range(j0, self.t.ZERO_TOKENS_PER_THREAD):
            t = t0 + j
            if t < pk.num_tokens:
                if t >= end:
                    s = advance_segment(pk.cu, s, t, pk.num_seqs)
                    start, end, nb, rowb = self.segment_span(pk, s)
                blk = (t - start) // ratio
                row = rowb + blk
                own_read = self.block_read(blk, row, nb, num_rows)
                if ~own_read:
                    gDKV[(None, (t, own_col))].store(zero.load())
                    gDSc[(None, (t, own_col))].store(zero_s.load())
                if cutlass.const_expr(self.coff == 2):
                    prev_read = self.block_read(blk + 1, row + 1, nb, num_rows)
                    if ~prev_read:
                        gDKV[(None, (t, chunk))].store(zero.load())
                        gDSc[(None, (t, chunk))].store(zero_s.load())
