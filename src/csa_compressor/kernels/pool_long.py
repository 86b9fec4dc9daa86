"""Slot-parallel kernels for long windows (ratio 128): forward and backward.

One row per CTA at a time. A CTA is ``lanes`` column chunks x ``groups`` slot groups: the
thread (c, g) loads slots [g*spt, (g+1)*spt) of chunk c, so a row's whole window is read
at once by the CTA instead of one thread walking 128 slots. The max is order-free; the
sums that the reference does serially (softmax denominator, the output, the backward's
S) are written to shared memory per slot and summed in slot order by one thread per
column, so the results keep the fp32 reference's operation order exactly.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import config
from .common import (WindowSlots, advance_segment, divide_column, max_nan, mul_rn, row_window,
                     smem_footprint)
from .pool_bwd import PoolBackward


class _LongShape:
    def _setup(self, dtype, ratio, coff, head_dim, cta_threads, vec_bytes, slots_per_thread):
        self.dtype, self.ratio, self.coff, self.d = dtype, ratio, coff, head_dim
        self.vec = config.vector_elems(head_dim, dtype.width // 8, vec_bytes)
        self.cpr = head_dim // self.vec
        self.slots = coff * ratio
        self.chunk_slots = config.long_slots_per_thread(self.slots, slots_per_thread)
        self.groups = self.slots // self.chunk_slots
        self.lanes = max(1, min(self.cpr, cta_threads // self.groups))
        self.col_groups = math.ceil(self.cpr / self.lanes)
        self.cols = self.lanes * self.vec  # columns of one CTA
        # per-slot values, the group maxima, two per-column scalars
        self.smem_bytes = (self.slots + self.groups + 2) * self.cols * 4 + 64
        # Row searches here are CTA-wide (one row per CTA), zero-fill ones per slot group.
        self.specialise()

    @cute.jit
    def shared(self):
        return self.alloc_shared(cutlass.memory.SmemAllocator())

    @cute.jit
    def alloc_shared(self, smem):
        buf = smem.allocate_tensor(Float32, cute.make_layout((self.cols, self.slots)), 16)
        gmax = smem.allocate_tensor(Float32, cute.make_layout((self.cols, self.groups)), 16)
        stat = smem.allocate_tensor(Float32, cute.make_layout((self.cols, 2)), 16)
        return buf, gmax, stat

    STAGES = 2  # the current row and the next

    def add_staging(self, on: bool):
        """Stage rows through cp.async (stage_row / read_stage) where ``on`` and the vector
        allows it (4, 8 or 16 bytes), and count the stages' shared memory."""
        self.threads = self.lanes * self.groups
        self.staged = on and self.stageable()
        if self.staged:
            half = self.STAGES * self.chunk_slots * self.threads * self.vec * self.dtype.width // 8
            self.smem_bytes += smem_footprint(half, half)

    @cute.jit
    def alloc_stages(self, smem):
        layout = cute.make_layout((self.vec, self.threads, self.chunk_slots, self.STAGES))
        return (smem.allocate_tensor(self.dtype, layout, 16),
                smem.allocate_tensor(self.dtype, layout, 16))

    @cute.jit
    def stage_row(self, gKV, gSc, sS, sV, atom, c0, t0, has_prev, stage, thr, chunk):
        """Start the cp.async copies of the thread's slots of a window into ``stage``."""
        for kk in cutlass.range_constexpr(self.chunk_slots):
            tok, colc, _, valid = self.slot_coords(c0 + kk, t0, has_prev, chunk)
            if valid:
                self.copy_vec(atom, gSc[(None, (tok, colc))].iterator,
                              sS[(None, thr, kk, stage)].iterator)
                self.copy_vec(atom, gKV[(None, (tok, colc))].iterator,
                              sV[(None, thr, kk, stage)].iterator)

    @cute.jit
    def read_stage(self, gApe, sS, sV, sf, vf, c0, has_prev, stage, thr, chunk):
        """stage_row's copies as load_slots leaves them: score + ape and value in fp32,
        empty slots -inf / 0."""
        for kk in cutlass.range_constexpr(self.chunk_slots):
            _, colc, arow, valid = self.slot_coords(c0 + kk, Int32(0), has_prev, chunk)
            if valid:
                s32 = sS[(None, thr, kk, stage)].load().to(Float32)
                v32 = sV[(None, thr, kk, stage)].load().to(Float32)
                a32 = gApe[(None, (arow, colc))].load()
                for e in cutlass.range_constexpr(self.vec):
                    sf[kk, e] = s32[e] + a32[e]
                    vf[kk, e] = v32[e]
            else:
                for e in cutlass.range_constexpr(self.vec):
                    sf[kk, e] = -Float32.inf
                    vf[kk, e] = Float32(0.0)

    @cute.jit
    def softmax_den(self, sf, buf, gmax, stat, tid, g):
        """In place: sf <- e = exp(s - max); stat[:, 0] <- serial sum of e over the window."""
        vec, CH = self.vec, self.chunk_slots
        for e in cutlass.range_constexpr(vec):
            mx = sf[0, e]
            for k in cutlass.range_constexpr(1, CH):
                mx = max_nan(mx, sf[k, e])
            gmax[tid * vec + e, g] = mx
        cute.arch.barrier()
        for e in cutlass.range_constexpr(vec):
            mx = gmax[tid * vec + e, 0]
            for h in cutlass.range_constexpr(1, self.groups):
                mx = max_nan(mx, gmax[tid * vec + e, h])
            for k in cutlass.range_constexpr(CH):
                sf[k, e] = cute.math.exp(sf[k, e] - mx)
                buf[tid * vec + e, g * CH + k] = sf[k, e]
        cute.arch.barrier()
        self.serial_sum(buf, stat, tid, g, 0)

    @cute.jit
    def serial_sum(self, buf, stat, tid, g, slot: cutlass.Constexpr[int]):
        """stat[col, slot] <- buf[col, 0] + buf[col, 1] + ... in slot order; thread g of a
        chunk sums that chunk's column g (g < vec), then all threads meet at a barrier."""
        if g < self.vec:
            col = tid * self.vec + g
            acc = buf[col, 0]
            for k in cutlass.range(1, self.slots, 1, unroll=8):
                acc = acc + buf[col, k]
            stat[col, slot] = acc
        cute.arch.barrier()


class LongPoolForward(_LongShape, WindowSlots):
    """A CTA walks ``rows_per_cta`` consecutive rows (a launch argument, sized on the host
    for config.LONG_FWD_CTAS_PER_SM CTAs an SM; 0 there: one row a CTA). The next row's
    window travels into shared memory by cp.async while the current row's softmax runs,
    so its load latency overlaps the current row's barriers and serial sums. Each thread
    copies and reads back only its own vectors: cp.async.wait_group is all the
    synchronisation the staging needs. (Loaded into registers instead, the next window
    took the forward from 48 registers to 102.) Vectors under 4 bytes (odd head_dim)
    cannot use cp.async and load when their row is computed."""

    def __init__(self, dtype, ratio: int, coff: int, head_dim: int):
        self._setup(dtype, ratio, coff, head_dim, config.LONG_CTA_THREADS, config.LONG_VEC_BYTES,
                    config.LONG_SLOTS_PER_THREAD)
        self.add_staging(True)
        self.hold_to(0)  # unbounded (48 registers at d=512 bf16); bounds that fit more spilled

    def rows_per_thread(self, num_rows: int, sms: int) -> int:
        """Rows a CTA walks (launch_forward's name for the argument)."""
        if not config.LONG_FWD_CTAS_PER_SM:
            return 1
        ctas = max(1, sms * config.LONG_FWD_CTAS_PER_SM // self.col_groups)
        return max(1, -(-num_rows // ctas))

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mOut: cute.Tensor, rows_per_cta: Int32, stream):
        tiler = (1, self.vec)
        grid_x = (mOut.shape[0] + rows_per_cta - 1) // rows_per_cta
        self.kernel(cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
                    cute.zipped_divide(mApe, tiler), mCu, mCuc, mOut, mKV.shape[0],
                    rows_per_cta).launch(
            grid=[grid_x, self.col_groups, 1], block=[self.lanes, self.groups, 1],
            smem=self.smem_bytes, stream=stream, preferred_smem_carveout=self.carveout,
            min_blocks_per_mp=self.min_ctas)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, mOut: cute.Tensor, num_tokens: Int32, rows_per_cta: Int32):
        tid, g, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        vec, CH = self.vec, self.chunk_slots
        num_seqs = mCuc.shape[0] - 1
        num_rows = mOut.shape[0]
        chunk = by * self.lanes + tid
        active = chunk < self.cpr
        thr = g * self.lanes + tid
        smem = cutlass.memory.SmemAllocator()
        buf, gmax, stat = self.alloc_shared(smem)
        sf = cute.make_rmem_tensor((CH, vec), Float32)
        vf = cute.make_rmem_tensor((CH, vec), Float32)
        row0 = bx * rows_per_cta
        s = self.search(mCuc, row0, num_seqs)
        t0, has_prev, real, ok = row_window(mCu, mCuc, s, row0, num_seqs, num_tokens, self.ratio,
                                            self.coff)
        if cutlass.const_expr(self.staged):
            sS, sV = self.alloc_stages(smem)
            atom = self.copy_atom()
            if ok & active:
                self.stage_row(gKV, gSc, sS, sV, atom, g * CH, t0, has_prev, 0, thr, chunk)
            cute.arch.cp_async_commit_group()
        for r in cutlass.range(rows_per_cta):
            row = row0 + r
            if row < num_rows:  # uniform over the CTA, as is everything row-wise below
                row_t0, row_prev, row_ok = t0, has_prev, ok
                # The next row's window into the other stage.
                nxt = row + 1
                s = advance_segment(mCuc, s, nxt, num_seqs)
                t0, has_prev, real, ok = row_window(mCu, mCuc, s, nxt, num_seqs, num_tokens,
                                                    self.ratio, self.coff)
                if cutlass.const_expr(self.staged):
                    if (r + 1 < rows_per_cta) & (nxt < num_rows) & ok & active:
                        self.stage_row(gKV, gSc, sS, sV, atom, g * CH, t0, has_prev, (r + 1) % 2,
                                       thr, chunk)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)  # this row's copies have landed
                for kk in cutlass.range_constexpr(CH):
                    for e in cutlass.range_constexpr(vec):
                        sf[kk, e] = -Float32.inf
                        vf[kk, e] = Float32(0.0)
                if row_ok & active:
                    if cutlass.const_expr(self.staged):
                        self.read_stage(gApe, sS, sV, sf, vf, g * CH, row_prev, r % 2, thr, chunk)
                    else:
                        self.load_slots(gKV, gSc, gApe, sf, vf, g * CH, row_t0, row_prev, chunk)
                if row_ok:  # barriers inside are reached by every thread
                    self.softmax_den(sf, buf, gmax, stat, tid, g)
                    for e in cutlass.range_constexpr(vec):
                        divide_column(sf, e, CH, stat[tid * vec + e, 0])
                        for k in cutlass.range_constexpr(CH):
                            buf[tid * vec + e, g * CH + k] = mul_rn(vf[k, e], sf[k, e])
                    cute.arch.barrier()
                    self.serial_sum(buf, stat, tid, g, 1)
                    if active & (g < vec):
                        mOut[row, chunk * vec + g] = stat[tid * vec + g, 1].to(self.dtype)
                    # No barrier before the next row: each of its shared-memory writes
                    # (gmax, buf, stat[:, 0], stat[:, 1], in that order) comes after a
                    # barrier that follows this row's last read of the same buffer.
                else:
                    if active & (g < vec):
                        mOut[row, chunk * vec + g] = Float32(0.0).to(self.dtype)


class LongPoolBackward(PoolBackward):
    """Row CTAs walk ``rows_per_cta`` rows one at a time; each thread keeps the dape
    contributions of its own slots and columns in registers over those rows and stores
    them as the CTA's partial (every partial entry has exactly one owner thread). Zero
    CTAs are the short-window backward's."""

    def __init__(self, dtype, ratio: int, coff: int, head_dim: int):
        _LongShape._setup(self, dtype, ratio, coff, head_dim, config.LONG_BWD_CTA_THREADS,
                          config.LONG_BWD_VEC_BYTES, config.LONG_BWD_SLOTS_PER_THREAD)
        self.row_lanes = self.groups  # zero-fill CTAs: a token range per slot-group lane
        self.min_rows_per_cta = 1
        self.add_staging(bool(config.LONG_BWD_STAGED))
        # PoolBackward.__call__'s launch: a register bound of that many CTAs, the grid sized
        # for them (config.LONG_BWD_CTAS_PER_SM; staged, LONG_BWD_STAGED_CTAS_PER_SM).
        self.hold_to(config.LONG_BWD_STAGED_CTAS_PER_SM if self.staged
                     else config.LONG_BWD_CTAS_PER_SM)

    pdl = False  # its kernel() has no griddepcontrol.wait
    STAGES = _LongShape.STAGES
    shared = _LongShape.shared
    alloc_shared = _LongShape.alloc_shared
    add_staging = _LongShape.add_staging
    alloc_stages = _LongShape.alloc_stages
    stage_row = _LongShape.stage_row
    read_stage = _LongShape.read_stage
    softmax_den = _LongShape.softmax_den
    serial_sum = _LongShape.serial_sum
    # __call__ is PoolBackward's: its block is (lanes, row_lanes) = (lanes, groups) here.

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gGrad: cute.Tensor, gDKV: cute.Tensor, gDSc: cute.Tensor,
               gWork: cute.Tensor, num_rows: Int32, num_tokens: Int32, rows_per_cta: Int32,
               num_row_ctas: Int32):
        tid, g, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        vec, CH, ratio = self.vec, self.chunk_slots, self.ratio
        num_seqs = mCuc.shape[0] - 1
        chunk = by * self.lanes + tid
        active = chunk < self.cpr
        if bx < num_row_ctas:
            thr = g * self.lanes + tid
            smem = cutlass.memory.SmemAllocator()
            buf, gmax, stat = self.alloc_shared(smem)
            sf, vf, gv, dacc = self.backward_registers()
            row0 = bx * rows_per_cta
            s = self.search(mCuc, row0, num_seqs)
            if cutlass.const_expr(self.staged):
                # As in the forward: the next row's window is copied while this one computes.
                t0, has_prev, real, ok = row_window(mCu, mCuc, s, row0, num_seqs, num_tokens,
                                                    ratio, self.coff)
                sS, sV = self.alloc_stages(smem)
                atom = self.copy_atom()
                if (row0 < num_rows) & real & ok & active:
                    self.stage_row(gKV, gSc, sS, sV, atom, g * CH, t0, has_prev, 0, thr, chunk)
                cute.arch.cp_async_commit_group()
            for r in cutlass.range(rows_per_cta):
                row = row0 + r
                if cutlass.const_expr(self.staged):
                    row_t0, row_prev, row_live = t0, has_prev, (row < num_rows) & real & ok
                    nxt = row + 1
                    s = advance_segment(mCuc, s, nxt, num_seqs)
                    t0, has_prev, real, ok = row_window(mCu, mCuc, s, nxt, num_seqs, num_tokens,
                                                        ratio, self.coff)
                    if (r + 1 < rows_per_cta) & (nxt < num_rows) & real & ok & active:
                        self.stage_row(gKV, gSc, sS, sV, atom, g * CH, t0, has_prev, (r + 1) % 2,
                                       thr, chunk)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)  # this row's copies have landed
                else:
                    s = advance_segment(mCuc, s, row, num_seqs)
                    row_t0, row_prev, row_real, row_ok = row_window(mCu, mCuc, s, row, num_seqs,
                                                                    num_tokens, ratio, self.coff)
                    row_live = (row < num_rows) & row_real & row_ok
                if row_live:  # uniform over the CTA
                    for e in cutlass.range_constexpr(vec):
                        gv[e] = Float32(0.0)
                        for kk in cutlass.range_constexpr(CH):
                            sf[kk, e] = -Float32.inf
                            vf[kk, e] = Float32(0.0)
                    if active:
                        gv.store(gGrad[(None, (row, chunk))].load().to(Float32))
                        if cutlass.const_expr(self.staged):
                            self.read_stage(gApe, sS, sV, sf, vf, g * CH, row_prev, r % 2, thr,
                                            chunk)
                        else:
                            self.load_slots(gKV, gSc, gApe, sf, vf, g * CH, row_t0, row_prev,
                                            chunk)
                    self.softmax_den(sf, buf, gmax, stat, tid, g)
                    for e in cutlass.range_constexpr(vec):
                        divide_column(sf, e, CH, stat[tid * vec + e, 0])
                        for k in cutlass.range_constexpr(CH):
                            p = sf[k, e]
                            pdp = mul_rn(p, mul_rn(gv[e], vf[k, e]))
                            sf[k, e] = p
                            vf[k, e] = pdp
                            buf[tid * vec + e, g * CH + k] = pdp
                    cute.arch.barrier()
                    self.serial_sum(buf, stat, tid, g, 1)
                    for e in cutlass.range_constexpr(vec):
                        S = stat[tid * vec + e, 1]
                        for k in cutlass.range_constexpr(CH):
                            p = sf[k, e]
                            sf[k, e] = vf[k, e] - mul_rn(p, S)  # dscore
                            vf[k, e] = mul_rn(gv[e], p)  # dkv
                    if active:
                        for kk in cutlass.range_constexpr(CH):
                            tok, colc, arow, valid = self.slot_coords(g * CH + kk, row_t0, row_prev,
                                                                      chunk)
                            if valid:
                                gDSc[(None, (tok, colc))].store(sf[kk, None].load().to(self.dtype))
                                gDKV[(None, (tok, colc))].store(vf[kk, None].load().to(self.dtype))
                                for e in cutlass.range_constexpr(vec):
                                    dacc[kk, e] = dacc[kk, e] + sf[kk, e]
                    # stat and buf are rewritten by the next row
                    cute.arch.barrier()
            if active:
                for kk in cutlass.range_constexpr(CH):
                    # Empty-slot contributions are zero, so the partial of every owned entry
                    # is just the register sum (has_prev=True: all slots own an entry).
                    _, colc, arow, _ = self.slot_coords(g * CH + kk, Int32(0), True, chunk)
                    gWork[(None, (bx * ratio + arow, colc))].store(dacc[kk, None].load())
        else:
            if active:
                # Same token split as the short-window zero CTAs (backward_schedule counts
                # row_lanes = groups lanes of ZERO_TOKENS_PER_THREAD tokens each).
                t = ((bx - num_row_ctas) * self.groups + g) * config.ZERO_TOKENS_PER_THREAD
                self.zero_unread(gDKV, gDSc, mCu, mCuc, t, chunk, num_rows, num_tokens, num_seqs)
