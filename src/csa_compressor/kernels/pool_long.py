"""Slot-parallel kernels for long windows (more than MAX_REG_SLOTS slots): forward and backward.

One row per CTA at a time. A CTA is ``lanes`` column chunks x ``groups`` slot groups: the
thread (c, g) loads slots [g*spt, (g+1)*spt) of chunk c, so a row's whole window is read
at once by the CTA instead of one thread walking 128 slots. The max is order-free; the
sums (softmax denominator, the output, the backward's S) are written to shared memory per
slot and summed by one thread per column, each in the order torch sums it
(softmax_order.py): the softmax's two as its CUDA softmax does, so that dkv and dscore are
torch's bit for bit, the output as its reduce kernel does, so that the forward is too.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..softmax_order import (SUM_ACCUMULATORS, ordered_sum, torch_softmax_lanes,
                             torch_sum_lanes_by_rows)
from .tuning import Tuning, current
from .ptx import max_nan, rounder
from .segments import Pack, advance_segment, row_window
from .softmax import divide_column, p_times_dp, pooled_product, softmax_grads
from .staging import Tiles, WindowSlots, smem_footprint
from .backward_grid import BackwardGrid


def bank_stride(cols: int, step: int, lanes: int) -> int:
    """A stride of at least ``cols`` words between slots (groups) of a shared buffer such
    that the slot groups of one warp (``lanes`` lanes each, ``step`` slots apart) start
    ``lanes`` banks apart; ``cols`` where a warp is one group or no stride fits."""
    if lanes >= 32:
        return cols
    return next((s for s in range(cols, cols + 32) if step * s % 32 == lanes), cols)


class SlotGroup:
    """A thread's place in a slot-parallel CTA: its column lane ``tid``, its slot group
    ``g``, whether its column chunk is in the row (``active``), and the CTA's shared row
    sums ``buf`` / ``stat``. Plain trace-time Python, as staging.Tiles."""

    __slots__ = ("tid", "g", "active", "buf", "stat")

    def __init__(self, tid, g, active, buf, stat):
        self.tid, self.g, self.active, self.buf, self.stat = tid, g, active, buf, stat


class LongWindow:
    """The slot-parallel geometry and the window sums shared by the long forward and backward."""

    def _setup(self, dtype, ratio, coff, head_dim, cta_threads, vec_bytes, slots_per_thread,
               pad: bool, row_stride: int, batch: int):
        self.dtype, self.ratio, self.coff, self.d = dtype, ratio, coff, head_dim
        self.set_rows(row_stride, batch)
        self.vec = self.t.vector_elems(head_dim, dtype.width // 8, vec_bytes)
        self.cpr = head_dim // self.vec
        self.slots = coff * ratio
        self.chunk_slots = self.t.long_slots_per_thread(self.slots, slots_per_thread)
        self.groups = self.slots // self.chunk_slots
        # The softmax's sums in torch's order for this window and row width.
        self.softmax_lanes = torch_softmax_lanes(self.slots, head_dim)
        # The forward's output sum in torch's order, which for packs of a few rows depends
        # on the row count: ((most_rows, lanes), ...), chosen at run time.
        self.output_lanes = tuple(torch_sum_lanes_by_rows(self.slots, head_dim))
        self.lanes = max(1, min(self.cpr, cta_threads // self.groups))
        self.threads = self.lanes * self.groups  # a CTA: (lanes, groups)
        self.col_groups = math.ceil(self.cpr / self.lanes)
        self.cols = self.lanes * self.vec  # columns of one CTA
        # Shared columns without bank conflicts (col(): consecutive lanes in consecutive
        # banks) and, with ``pad``, slot and group strides padded so the slot groups that
        # share a warp land in other banks (bank_stride). The forward takes neither where
        # two slot groups share a warp (coff 2: 16 lanes): there both took it from 80
        # registers to 86, 2 CTAs an SM instead of 3 (lab tuning-long.md, "Split shared columns").
        self.split = pad or self.lanes >= 32
        self.slot_stride = self.group_stride = self.cols
        if pad:
            self.slot_stride = bank_stride(self.cols, self.chunk_slots, self.lanes)
            self.group_stride = bank_stride(self.cols, 1, self.lanes)
        # per-slot values, the group maxima, two per-column scalars
        self.smem_bytes = (self.slots * self.slot_stride + self.groups * self.group_stride
                           + 2 * self.cols) * 4 + 64
        # Row searches here are CTA-wide (one row per CTA), zero-fill ones per slot group.
        self.specialise()

    @cute.jit
    def shared(self):
        return self.alloc_shared(cutlass.memory.SmemAllocator())

    @cute.jit
    def alloc_shared(self, smem):
        buf = smem.allocate_tensor(
            Float32, cute.make_layout((self.cols, self.slots), stride=(1, self.slot_stride)), 16)
        gmax = smem.allocate_tensor(
            Float32, cute.make_layout((self.cols, self.groups), stride=(1, self.group_stride)), 16)
        stat = smem.allocate_tensor(Float32, cute.make_layout((self.cols, 2)), 16)
        return buf, gmax, stat

    def col(self, tid, e):
        """The shared column of chunk lane ``tid``'s element ``e``: split, a warp's accesses
        to one slot, and the serial sums' (one warp a vector element), hit consecutive
        banks (tid * vec + e has 2-way conflicts with 2-element vectors)."""
        return e * self.lanes + tid if self.split else tid * self.vec + e

    @cute.jit
    def softmax_den(self, sf, buf, gmax, stat, tid, g):
        """In place: sf <- e = exp(s - max); stat[:, 0] <- serial sum of e over the window."""
        vec, CH = self.vec, self.chunk_slots
        for e in cutlass.range_constexpr(vec):
            mx = sf[0, e]
            for k in cutlass.range_constexpr(1, CH):
                mx = max_nan(mx, sf[k, e])
            gmax[self.col(tid, e), g] = mx
        cute.arch.barrier()
        for e in cutlass.range_constexpr(vec):
            mx = gmax[self.col(tid, e), 0]
            for h in cutlass.range_constexpr(1, self.groups):
                mx = max_nan(mx, gmax[self.col(tid, e), h])
            for k in cutlass.range_constexpr(CH):
                sf[k, e] = cute.math.exp(sf[k, e] - mx)
                buf[self.col(tid, e), g * CH + k] = sf[k, e]
        cute.arch.barrier()
        self.softmax_sum(buf, stat, tid, g, 0)

    @cute.jit
    def output_sum(self, buf, stat, tid, g, slot: cutlass.Constexpr[int], num_rows: Int32):
        """stat[col, slot] <- the sum of buf[col, :] over the window in the order torch's
        reduce kernel sums the products (output_lanes for ``num_rows`` rows); thread g of a
        chunk sums that chunk's column g (g < vec), then all threads meet at a barrier."""
        if g < self.vec:
            col = self.col(tid, g)
            if cutlass.const_expr(len(self.output_lanes) == 1):
                stat[col, slot] = ordered_sum(lambda k: buf[col, k], self.slots,
                                               self.output_lanes[0][1], self.t.LONG_SUM_AHEAD,
                                               SUM_ACCUMULATORS)
            else:
                fewest = 0
                for i in cutlass.range_constexpr(len(self.output_lanes)):
                    most, lanes = self.output_lanes[i]
                    most = 2 ** 31 - 1 if most is None else most
                    if (num_rows > fewest) & (num_rows <= most):
                        stat[col, slot] = ordered_sum(lambda k: buf[col, k], self.slots, lanes,
                                                       self.t.LONG_SUM_AHEAD, SUM_ACCUMULATORS)
                    fewest = most
        cute.arch.barrier()

    @cute.jit
    def softmax_sum(self, buf, stat, tid, g, slot: cutlass.Constexpr[int]):
        """output_sum's store of the sum in the order torch's softmax sums this window
        (softmax_lanes)."""
        if g < self.vec:
            col = self.col(tid, g)
            stat[col, slot] = ordered_sum(lambda k: buf[col, k], self.slots, self.softmax_lanes,
                                           self.t.LONG_SUM_AHEAD)
        cute.arch.barrier()


class LongPoolForward(LongWindow, WindowSlots):
    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, tuning: Tuning | None = None,
                 row_stride: int = 0, batch: int = 0, numerics: str = "fp32"):
        self.t = tuning or current()
        self.rnd = rounder(dtype, numerics)
        most = self.t.LONG_SLOTS_PER_THREAD
        if coff * ratio < self.t.LONG_WIDE_MIN_SLOTS:
            most = self.t.LONG_NARROW_SLOTS_PER_THREAD  # lab tuning-long.md, "LONG_WIDE_MIN_SLOTS"
        self._setup(dtype, ratio, coff, head_dim, self.t.LONG_CTA_THREADS, self.t.LONG_VEC_BYTES,
                    most, pad=False, row_stride=row_stride, batch=batch)
        # Unbounded: 80 registers at d=512 bf16, 3 CTAs an SM (self.t.LONG_*). Its values in
        # shared memory took it to 64 and ran slower (lab tuning-long.md,
        # "LONG_FWD_SHARED_VALUES").
        self.hold_to(0)

    def rows_per_thread(self, num_rows: int, sms: int, ctas_per_sm: int | None = None,
                        tuning: Tuning | None = None) -> int:
        return 1

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mOut: cute.Tensor, rows_per_thread: Int32, stream):
        # rows_per_thread: the short-window forward's launch argument; a CTA here is one row.
        tiler = (1, self.vec)
        self.kernel(cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
                    cute.zipped_divide(mApe, tiler), mCu, mCuc, mOut, mKV.shape[0]).launch(
            grid=[mOut.shape[0], self.col_groups, self.grid_z()], block=[self.lanes, self.groups, 1],
            smem=self.smem_bytes, stream=stream, use_pdl=True,
            preferred_smem_carveout=self.carveout, min_blocks_per_mp=self.min_ctas)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, mOut: cute.Tensor, num_tokens: Int32):
        # A programmatic dependent as pool_fwd (lab tuning-long.md, "Programmatic
        # dependents"): nothing is read or written before the
        # previous kernel completed.
        cute.arch.griddepcontrol_wait()
        self.pool_row(gKV, gSc, gApe, mCu, mCuc, mOut, num_tokens)

    @cute.jit
    def pool_row(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mOut: cute.Tensor, num_tokens: Int32):
        """The CTA's work: its columns of row block_idx.x."""
        (gKV, gSc), (mOut,), _ = self.batch_tensors((gKV, gSc), (mOut,))
        tid, g, _ = cute.arch.thread_idx()
        row, by, _ = cute.arch.block_idx()
        vec, CH = self.vec, self.chunk_slots
        num_seqs = mCuc.shape[0] - 1
        chunk = by * self.lanes + tid
        active = chunk < self.cpr
        buf, gmax, stat = self.shared()
        sf = cute.make_rmem_tensor((CH, vec), Float32)
        vf = cute.make_rmem_tensor((CH, vec), Float32)
        s = self.search(mCuc, row, num_seqs)
        t0, has_prev, real, ok = row_window(mCu, mCuc, s, row, num_seqs, num_tokens, self.ratio,
                                            self.coff)
        if ok:  # uniform over the CTA: barriers inside are reached by every thread
            for kk in cutlass.range_constexpr(CH):
                for e in cutlass.range_constexpr(vec):
                    sf[kk, e] = -Float32.inf
                    vf[kk, e] = Float32(0.0)
            if active:
                self.load_slots(Tiles(gKV, gSc, gApe, chunk), sf, vf, g * CH, t0, has_prev)
            self.softmax_den(sf, buf, gmax, stat, tid, g)
            for e in cutlass.range_constexpr(vec):
                divide_column(sf, e, CH, stat[self.col(tid, e), 0])
                for k in cutlass.range_constexpr(CH):
                    buf[self.col(tid, e), g * CH + k] = pooled_product(vf[k, e], sf[k, e], self.rnd)
            cute.arch.barrier()
            self.output_sum(buf, stat, tid, g, 1, mOut.shape[0])
            if active & (g < vec):
                mOut[row, chunk * vec + g] = stat[self.col(tid, g), 1].to(self.dtype)
        else:
            if active & (g < vec):
                mOut[row, chunk * vec + g] = Float32(0.0).to(self.dtype)


class LongPoolBackward(LongWindow, BackwardGrid, WindowSlots):
    """Row CTAs walk ``rows_per_cta`` rows one at a time; each thread keeps the dape
    contributions of its own slots and columns in registers over those rows and stores
    them as the CTA's partial (every partial entry has exactly one owner thread). The grid
    and its zero-fill CTAs are BackwardGrid's, as in the short-window backward."""

    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, tuning: Tuning | None = None,
                 row_stride: int = 0, batch: int = 0, numerics: str = "fp32"):
        self.t = tuning or current()
        self.rnd = rounder(dtype, numerics)
        # Wide windows take LONG_BWD_SLOTS_PER_THREAD slots a thread where that leaves a row
        # LONG_BWD_MIN_COL_GROUPS CTAs or more, else the narrow count.
        for most in (self.t.LONG_BWD_SLOTS_PER_THREAD, self.t.LONG_NARROW_SLOTS_PER_THREAD):
            self._setup(dtype, ratio, coff, head_dim, self.t.LONG_BWD_CTA_THREADS,
                              self.t.LONG_BWD_VEC_BYTES, most, pad=True, row_stride=row_stride,
                              batch=batch)
            if (self.slots >= self.t.LONG_WIDE_MIN_SLOTS
                    and self.col_groups >= self.t.LONG_BWD_MIN_COL_GROUPS):
                break
        self.row_lanes = self.groups  # zero-fill CTAs: a token range per slot-group lane
        self.min_rows_per_cta = 1
        # The window's values go to shared memory by cp.async and p*dp lives only in the
        # serial sum's buffer (gradients_shared_values): with the narrow slot count that
        # frees the registers of a third CTA an SM (self.t.LONG_BWD_NARROW_CTAS_PER_SM);
        # the wide count takes two (LONG_BWD_CTAS_PER_SM), as do vectors cp.async cannot
        # copy (odd head_dim), whose values stay in registers. BackwardGrid.__call__
        # launches it with a register bound of that many CTAs and a grid sized for them.
        self.shared_values = self.stageable()
        if self.shared_values:
            self.smem_bytes += self.values_bytes()
        narrow = self.shared_values and self.chunk_slots <= self.t.LONG_NARROW_SLOTS_PER_THREAD
        self.hold_to(self.t.LONG_BWD_NARROW_CTAS_PER_SM if narrow else self.t.LONG_BWD_CTAS_PER_SM)

    # __call__ is BackwardGrid's: its block is (lanes, row_lanes) = (lanes, groups) here.

    def values_bytes(self) -> int:
        return smem_footprint(self.chunk_slots * self.threads * self.vec * self.dtype.width // 8)

    @cute.jit
    def load_scores_copy_values(self, tt: Tiles, sf, c0, t0, has_prev):
        """load_slots with the values sent to this thread's part of ``tt.sV`` by cp.async
        with ``tt.atom`` (one commit group; read back by staged_vector after
        cp.async.wait_group)."""
        for kk in cutlass.range_constexpr(self.chunk_slots):
            tok, colc, arow, valid = self.slot_coords(c0 + kk, t0, has_prev, tt.chunk)
            if valid:
                self.copy_vec(tt.atom, tt.kv[(None, (tok, colc))].iterator,
                              tt.sV[(None, tt.thr, kk, 0)].iterator)
                s32 = tt.score[(None, (tok, colc))].load().to(Float32)
                a32 = self.ape_vec(tt, arow, colc)
                for e in cutlass.range_constexpr(self.vec):
                    sf[kk, e] = s32[e] + a32[e]
        cute.arch.cp_async_commit_group()

    @cute.jit
    def gradients_shared_values(self, tt: Tiles, sg: "SlotGroup", gDKV, gDSc, sf, gv, dacc, t0,
                                has_prev):
        """A row's gradients with its window's values in shared memory (lab tuning-long.md, "The
        long backward's values in shared memory"): each slot's values read at its
        products, p*dp kept only in ``buf`` (where the serial sum reads it), dscore and dkv
        computed and stored a slot at a time. gradients_register_values' operations in its
        order."""
        vec, CH = self.vec, self.chunk_slots
        buf, stat, tid, g, chunk, active = sg.buf, sg.stat, sg.tid, sg.g, tt.chunk, sg.active
        for e in cutlass.range_constexpr(vec):
            divide_column(sf, e, CH, stat[self.col(tid, e), 0])
        cute.arch.cp_async_wait_group(0)
        vv = cute.make_rmem_tensor((vec,), Float32)
        for k in cutlass.range_constexpr(CH):
            _, _, _, valid = self.slot_coords(g * CH + k, t0, has_prev, chunk)
            for e in cutlass.range_constexpr(vec):
                vv[e] = Float32(0.0)  # an empty slot's value (load_slots')
            if active & valid:
                v32 = self.staged_vector(tt.sV, k, 0, tt.thr)
                for e in cutlass.range_constexpr(vec):
                    vv[e] = v32[e]
            for e in cutlass.range_constexpr(vec):
                buf[self.col(tid, e), g * CH + k] = p_times_dp(sf[k, e], gv[e], vv[e], self.rnd)
        cute.arch.barrier()
        self.softmax_sum(buf, stat, tid, g, 1)
        S = [stat[self.col(tid, e), 1] for e in range(vec)]
        dsc = cute.make_rmem_tensor((vec,), Float32)
        dkv = cute.make_rmem_tensor((vec,), Float32)
        if active:
            for kk in cutlass.range_constexpr(CH):
                tok, colc, _, valid = self.slot_coords(g * CH + kk, t0, has_prev, chunk)
                if valid:
                    for e in cutlass.range_constexpr(vec):
                        dsc[e], dkv[e] = softmax_grads(sf[kk, e], buf[self.col(tid, e), g * CH + kk],
                                                       S[e], gv[e], self.rnd)
                        if cutlass.const_expr(self.has_ape):
                            dacc[kk, e] = dacc[kk, e] + dsc[e]
                    gDSc[(None, (tok, colc))].store(dsc.load().to(gDSc.element_type))
                    gDKV[(None, (tok, colc))].store(dkv.load().to(self.dtype))

    @cute.jit
    def gradients_register_values(self, tt: Tiles, sg: "SlotGroup", gDKV, gDSc, sf, vf, gv, dacc,
                                  t0, has_prev):
        """gradients_shared_values for vectors cp.async cannot copy (odd head_dim): the
        window's values, then p*dp, held in registers ``vf``."""
        vec, CH = self.vec, self.chunk_slots
        buf, stat, tid, g, chunk, active = sg.buf, sg.stat, sg.tid, sg.g, tt.chunk, sg.active
        for e in cutlass.range_constexpr(vec):
            divide_column(sf, e, CH, stat[self.col(tid, e), 0])
            for k in cutlass.range_constexpr(CH):
                p = sf[k, e]
                pdp = p_times_dp(p, gv[e], vf[k, e], self.rnd)
                sf[k, e] = p
                vf[k, e] = pdp
                buf[self.col(tid, e), g * CH + k] = pdp
        cute.arch.barrier()
        self.softmax_sum(buf, stat, tid, g, 1)
        for e in cutlass.range_constexpr(vec):
            S = stat[self.col(tid, e), 1]
            for k in cutlass.range_constexpr(CH):
                sf[k, e], vf[k, e] = softmax_grads(sf[k, e], vf[k, e], S, gv[e], self.rnd)
        if active:
            for kk in cutlass.range_constexpr(CH):
                tok, colc, _, valid = self.slot_coords(g * CH + kk, t0, has_prev, chunk)
                if valid:
                    gDSc[(None, (tok, colc))].store(sf[kk, None].load().to(gDSc.element_type))
                    gDKV[(None, (tok, colc))].store(vf[kk, None].load().to(self.dtype))
                    if cutlass.const_expr(self.has_ape):
                        for e in cutlass.range_constexpr(vec):
                            dacc[kk, e] = dacc[kk, e] + sf[kk, e]

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gGrad: cute.Tensor, gDKV: cute.Tensor, gDSc: cute.Tensor,
               gWork: cute.Tensor, num_rows: Int32, num_tokens: Int32, rows_per_cta: Int32,
               num_row_ctas: Int32):
        # As pool_bwd: the dape sum may be scheduled early, and nothing is read or written
        # before the previous kernel completed.
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        self.pool_rows(gKV, gSc, gApe, mCu, mCuc, gGrad, gDKV, gDSc, gWork, num_rows, num_tokens,
                       rows_per_cta, num_row_ctas)

    @cute.jit
    def pool_rows(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
                  mCuc: cute.Tensor, gGrad: cute.Tensor, gDKV: cute.Tensor, gDSc: cute.Tensor,
                  gWork: cute.Tensor, num_rows: Int32, num_tokens: Int32, rows_per_cta: Int32,
                  num_row_ctas: Int32):
        """The CTA's work: its rows' window gradients and dape partial, or its zero fill."""
        (gKV, gSc, gDKV, gDSc), (gGrad,), gWork = self.batch_tensors(
            (gKV, gSc, gDKV, gDSc), (gGrad,), gWork, num_row_ctas * self.ratio)
        tid, g, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        vec, CH, ratio = self.vec, self.chunk_slots, self.ratio
        num_seqs = mCuc.shape[0] - 1
        chunk = by * self.lanes + tid
        active = chunk < self.cpr
        if bx < num_row_ctas:
            smem = cutlass.memory.SmemAllocator()
            buf, gmax, stat = self.alloc_shared(smem)
            sf, vf, gv, dacc = self.backward_registers()
            tt = Tiles(gKV, gSc, gApe, chunk)
            sg = SlotGroup(tid, g, active, buf, stat)
            if cutlass.const_expr(self.shared_values):
                sV = smem.allocate_tensor(self.dtype,
                                          cute.make_layout((vec, self.threads, CH, 1)), 16)
                thr = g * self.lanes + tid
                tt.sV, tt.thr, tt.atom = sV, thr, self.copy_atom()
            row0 = bx * rows_per_cta
            s = self.search(mCuc, row0, num_seqs)
            for r in cutlass.range(rows_per_cta):
                row = row0 + r
                s = advance_segment(mCuc, s, row, num_seqs)
                t0, has_prev, real, ok = row_window(mCu, mCuc, s, row, num_seqs, num_tokens,
                                                    ratio, self.coff)
                if (row < num_rows) & real & ok:  # uniform over the CTA
                    for e in cutlass.range_constexpr(vec):
                        gv[e] = Float32(0.0)
                        for kk in cutlass.range_constexpr(CH):
                            sf[kk, e] = -Float32.inf
                            vf[kk, e] = Float32(0.0)
                    if active:
                        gv.store(gGrad[(None, (row, chunk))].load().to(Float32))
                        if cutlass.const_expr(self.shared_values):
                            self.load_scores_copy_values(tt, sf, g * CH, t0, has_prev)
                        else:
                            self.load_slots(tt, sf, vf, g * CH, t0, has_prev)
                    self.softmax_den(sf, buf, gmax, stat, tid, g)
                    if cutlass.const_expr(self.shared_values):
                        self.gradients_shared_values(tt, sg, gDKV, gDSc, sf, gv, dacc, t0,
                                                     has_prev)
                    else:
                        self.gradients_register_values(tt, sg, gDKV, gDSc, sf, vf, gv, dacc, t0,
                                                       has_prev)
                    # stat and buf are rewritten by the next row
                    cute.arch.barrier()
            if cutlass.const_expr(self.has_ape):  # else no dape: the partials stay unwritten
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
                t = ((bx - num_row_ctas) * self.groups + g) * self.t.ZERO_TOKENS_PER_THREAD
                self.zero_unread(Pack(mCu, mCuc, num_rows, num_tokens, num_seqs), gDKV, gDSc, t,
                                 chunk)
