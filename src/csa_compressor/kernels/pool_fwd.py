"""Fused forward of the gated pooling: one launch, fp32 math, one final rounding.

Thread mapping: a CTA owns ``lanes`` consecutive column chunks (``vec`` elements each) of
``rows_per_cta`` consecutive output rows; a thread walks those rows for its chunk. Each
slot of a row's window is one vector load of ``score`` and one of ``kv`` per thread, so
a warp reads 32 contiguous vectors of one token row: fully coalesced.

Op order is the fp32 reference's (SPEC §5): serial max, ``exp(s - m)``, serial sum, true
division, products rounded on their own (``mul.rn``) before a serial sum.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import config
from .common import find_segment, mul_rn, row_window, softmax_numerators


class PoolForward:
    def __init__(self, dtype, ratio: int, coff: int, head_dim: int):
        self.dtype = dtype
        self.ratio = ratio
        self.coff = coff
        self.d = head_dim
        self.vec = config.vector_elems(head_dim, dtype.width // 8)
        self.cpr = head_dim // self.vec  # column chunks per output row
        self.slots = coff * ratio
        assert self.slots <= config.MAX_REG_SLOTS, "long windows use pool_long.LongPoolForward"
        self.chunk_slots = self.slots  # the whole window lives in registers, read once
        self.lanes = min(self.cpr, config.MAX_CTA_THREADS)
        self.col_groups = math.ceil(self.cpr / self.lanes)
        self.row_lanes = max(1, config.FWD_CTA_THREADS // self.lanes)
        self.rows_per_cta = self.row_lanes * config.FWD_ROWS_PER_THREAD

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mOut: cute.Tensor, stream):
        tiler = (1, self.vec)
        gKV = cute.zipped_divide(mKV, tiler)
        gSc = cute.zipped_divide(mScore, tiler)
        gApe = cute.zipped_divide(mApe, tiler)
        gOut = cute.zipped_divide(mOut, tiler)
        num_rows = mOut.shape[0]
        grid_x = (num_rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(gKV, gSc, gApe, mCu, mCuc, gOut, num_rows, mKV.shape[0]).launch(
            grid=[grid_x, self.col_groups, 1], block=[self.lanes, self.row_lanes, 1], stream=stream)

    @cute.jit
    def load_slots(self, gKV, gSc, gApe, sf, vf, c0, t0, has_prev, chunk):
        """Slots c0 .. c0+chunk_slots-1 of the window into fp32 registers ``sf`` (score+ape)
        and ``vf`` (value); empty slots get -inf / 0 and read nothing. Same geometry as
        common.WindowSlots.load_slots; kept apart because merging reorders the forward's
        converts (PTX changes) and needs a GPU run to validate."""
        ratio, cpr, vec = self.ratio, self.cpr, self.vec
        for kk in cutlass.range_constexpr(self.chunk_slots):
            k = c0 + kk
            if cutlass.const_expr(self.coff == 2):
                own = k >= ratio
                tok = t0 - ratio + k
                colc = chunk + (Int32(cpr) if own else Int32(0))
                arow = k - (Int32(ratio) if own else Int32(0))
                valid = own | has_prev
            else:
                tok = t0 + k
                colc = chunk
                arow = k
                valid = True
            if valid:
                s_raw = gSc[(None, (tok, colc))].load()
                a_raw = gApe[(None, (arow, colc))].load()
                v_raw = gKV[(None, (tok, colc))].load()
                s32 = s_raw.to(Float32)
                v32 = v_raw.to(Float32)
                for e in cutlass.range_constexpr(vec):
                    sf[kk, e] = s32[e] + a_raw[e]
                    vf[kk, e] = v32[e]
            else:
                for e in cutlass.range_constexpr(vec):
                    sf[kk, e] = -Float32.inf
                    vf[kk, e] = Float32(0.0)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gOut: cute.Tensor, num_rows: Int32, num_tokens: Int32):
        tid, ty, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        vec, CH = self.vec, self.chunk_slots
        num_seqs = mCuc.shape[0] - 1
        chunk = by * self.lanes + tid
        sf = cute.make_rmem_tensor((CH, vec), Float32)
        vf = cute.make_rmem_tensor((CH, vec), Float32)
        acc = cute.make_rmem_tensor((vec,), Float32)
        res = cute.make_rmem_tensor((vec,), self.dtype)
        if chunk < self.cpr:
            for r in cutlass.range_constexpr(config.FWD_ROWS_PER_THREAD):
                row = bx * self.rows_per_cta + r * self.row_lanes + ty
                if row < num_rows:
                    s = find_segment(mCuc, row, num_seqs)
                    t0, has_prev, real, ok = row_window(mCu, mCuc, s, row, num_seqs, num_tokens,
                                                        self.ratio, self.coff)
                    for e in cutlass.range_constexpr(vec):
                        acc[e] = Float32(0.0)
                    if ok:
                        self.load_slots(gKV, gSc, gApe, sf, vf, Int32(0), t0, has_prev, chunk)
                        for e in cutlass.range_constexpr(vec):
                            dn = softmax_numerators(sf, e, CH)
                            a = mul_rn(vf[0, e], sf[0, e] / dn)
                            for k in cutlass.range_constexpr(1, CH):
                                a = a + mul_rn(vf[k, e], sf[k, e] / dn)
                            acc[e] = a
                    res.store(acc.load().to(self.dtype))
                    gOut[(None, (row, chunk))].store(res.load())
