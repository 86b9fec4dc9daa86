"""Fused forward of the gated pooling: one launch, fp32 math, one final rounding.

Thread mapping: a CTA owns ``lanes`` consecutive column chunks (``vec`` elements each) and
``row_lanes`` row lanes; each thread walks ``rows_per_thread`` rows (a launch argument)
for its chunk, ``row_lanes`` apart. Each slot of a row's window is one vector of
``score`` and one of ``kv`` per thread, so a warp reads 32 contiguous vectors of one token
row: fully coalesced.

Staging: the window vectors travel global -> shared memory by ``cp.async``, ``stages``
rows ahead of the row being computed, so a thread keeps ~``stages`` windows in flight
without holding them in registers (the register-resident design kept one window in
flight and spent most of its time either waiting or computing). Every thread reads back
only its own vectors; the warp copies them together in 16-byte pieces where each warp
holds one row (staging.WindowSlots.stage_window_warp, two warp syncs a row), else each
thread copies its own. Vectors under 4 bytes (odd head_dim) cannot use ``cp.async`` and
load directly.

Op order is torch's fp32 region's (docs/contract.md): serial max, ``exp(s - m)``, serial sum, true
division (one shared reciprocal + an exact correction, see softmax.softmax_row), products
rounded on their own (``mul.rn``) before a serial sum. ``numerics="eager"`` rounds the
weights and the products to the input dtype as well (softmax.pooled_product), as
Megatron-LM's eager region does.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .tuning import Tuning, current
from .ptx import mul_rn, round_bf16, round_bf16_pair, rounder
from .segments import Pack, start_walk, walk_rows, walk_window
from ..softmax_order import SUM_ACCUMULATORS, ordered_sum, torch_sum_lanes_by_rows
from .softmax import pooled_product, softmax_row
from .staging import Tiles, WindowSlots


class PoolForward(WindowSlots):
    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, arch_major: int = 9,
                 tuning: Tuning | None = None, row_stride: int = 0, batch: int = 0,
                 numerics: str = "fp32"):
        self.t = t = tuning or current()
        self.dtype = dtype
        self.rnd = rounder(dtype, numerics)
        self.ratio = ratio
        self.coff = coff
        self.d = head_dim
        self.set_rows(row_stride, batch)
        elem_bytes = dtype.width // 8
        self.vec = t.forward_vector_elems(head_dim, elem_bytes, coff * ratio)
        self.cpr = head_dim // self.vec  # column chunks per output row
        self.slots = coff * ratio
        assert self.slots <= t.MAX_REG_SLOTS, "long windows use pool_long.LongPoolForward"
        assert torch_sum_lanes_by_rows(self.slots, head_dim) == [(None, 1)], "torch splits this window"
        self.chunk_slots = self.slots  # the whole window lives in registers, read once
        self.lanes = min(self.cpr, t.MAX_CTA_THREADS)
        self.col_groups = math.ceil(self.cpr / self.lanes)
        self.row_lanes = max(1, t.FWD_CTA_THREADS // self.lanes)
        self.threads = self.lanes * self.row_lanes
        self.staged = self.stageable()
        narrow = self.vec * elem_bytes <= 4  # 4-byte vectors or less (d=128 bf16)
        self.stages = max(2, min(t.FWD_STAGES,
                                 t.FWD_SMEM_PER_CTA // self.staging_bytes(1)))
        self.smem_bytes = self.staging_bytes(self.stages) if self.staged else 0
        # FWD_TARGET_CTAS_PER_SM, or fewer where the staging buffers do not fit that many.
        fit = self.ctas_fitting_smem()
        self.target_ctas_per_sm = max(1, min(t.FWD_TARGET_CTAS_PER_SM, fit))
        # Narrow-vector forwards are compiled for FWD_BOUND_CTAS_PER_SM[arch] resident CTAs
        # (a register bound) and their grid sized for that many.
        bound = t.fwd_bound_ctas(arch_major)
        bounded = (bound and narrow and self.slots * self.vec <= t.FWD_BOUND_MAX_ELEMS
                   and (ratio, coff, self.vec) not in t.fwd_bound_spills(arch_major))
        self.hold_to(max(1, min(bound, fit)) if bounded else 0)
        self.specialise()
        # Warp-cooperative 16-byte staging copies where every warp holds one row
        # (staging.stage_window_warp; measured in tuning log, "Adopted at v17").
        self.coop = self.coop_stageable()

    def rows_per_thread(self, num_rows: int, sms: int, ctas_per_sm: int | None = None,
                        tuning: Tuning | None = None) -> int:
        """Rows each thread walks (``num_rows`` a sequence of the grid.z ones): enough that
        the grid fits in one wave of ``ctas_per_sm`` CTAs an SM (the compiled kernel's
        grid_ctas_per_sm; the design's without one): a partial second wave ran at a
        fraction of the occupancy. At most FWD_MAX_ROWS_PER_THREAD."""
        ctas = max(1, sms * (ctas_per_sm or self.target_ctas_per_sm)
                   // (self.col_groups * self.grid_z()))
        per = -(-num_rows // (ctas * self.row_lanes))
        return max(1, min((tuning or current()).FWD_MAX_ROWS_PER_THREAD, per))  # launch-only

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mOut: cute.Tensor, rows_per_thread: Int32, stream):
        tiler = (1, self.vec)
        gKV = cute.zipped_divide(mKV, tiler)
        gSc = cute.zipped_divide(mScore, tiler)
        gApe = cute.zipped_divide(mApe, tiler)
        gOut = cute.zipped_divide(mOut, tiler)
        num_rows = mOut.shape[0]
        rows_per_cta = rows_per_thread * self.row_lanes
        grid_x = (num_rows + rows_per_cta - 1) // rows_per_cta
        self.kernel(gKV, gSc, gApe, mCu, mCuc, gOut, num_rows, mKV.shape[0], rows_per_thread).launch(
            grid=[grid_x, self.col_groups, self.grid_z()], block=[self.lanes, self.row_lanes, 1],
            smem=self.smem_bytes, stream=stream, use_pdl=True,  # see kernel()'s first statement
            preferred_smem_carveout=self.carveout, min_blocks_per_mp=self.min_ctas)

    @cute.jit
    def issue_row(self, tt: Tiles, pk: Pack, walk, row, stage):
        """Start the cp.async copies of row ``row``'s window into ``stage``; returns the
        issuing walk. Rows that compute nothing copy nothing."""
        walk = walk_rows(pk.cu, pk.cuc, walk, row, pk.num_seqs)
        t0, has_prev, ok = walk_window(walk, row, pk.num_seqs, pk.num_tokens, self.ratio,
                                       self.coff)
        if (row < pk.num_rows) & ok:
            self.stage_window(tt, t0, has_prev, stage)
        return walk

    @cute.jit
    def output_row(self, tt: Tiles, pk: Pack, gOut, regs, walk, row, stage):
        """Row ``row``'s output (``walk`` at the row): its window read back from ``stage``
        (staged; ``tt.sS`` None: loaded from global memory), pooled and stored; zeros where
        the window leaves the tokens. ``regs``: the thread's (sf, vf, acc, res)."""
        sf, vf, acc, res = regs
        if row < pk.num_rows:
            t0, has_prev, ok = walk_window(walk, row, pk.num_seqs, pk.num_tokens, self.ratio,
                                           self.coff)
            for e in cutlass.range_constexpr(self.vec):
                acc[e] = Float32(0.0)
            if ok:
                if cutlass.const_expr(tt.sS is not None):
                    self.read_staged(tt, sf, vf, t0, has_prev, stage)
                else:
                    self.load_slots(tt, sf, vf, Int32(0), t0, has_prev)
                self.pool_row(sf, vf, acc)
            res.store(acc.load().to(self.dtype))
            gOut[(None, (row, tt.chunk))].store(res.load())

    @cute.jit
    def pool_row(self, sf, vf, acc):
        CH = self.slots
        softmax_row(sf, self.vec, CH)
        if cutlass.const_expr(self.rnd is round_bf16 and self.vec % 2 == 0):
            # The eager roundings two columns at a time (round_bf16_pair; the forward at
            # d=512 became issue-bound on one conversion each); the same bits as rnd.
            for k in cutlass.range_constexpr(CH):
                for e in cutlass.range_constexpr(0, self.vec, 2):
                    sf[k, e], sf[k, e + 1] = round_bf16_pair(sf[k, e], sf[k, e + 1])
                    vf[k, e], vf[k, e + 1] = round_bf16_pair(mul_rn(vf[k, e], sf[k, e]),
                                                             mul_rn(vf[k, e + 1], sf[k, e + 1]))
            for e in cutlass.range_constexpr(self.vec):
                acc[e] = ordered_sum(lambda k: vf[k, e], CH, 1, CH, SUM_ACCUMULATORS)
            return
        for e in cutlass.range_constexpr(self.vec):
            # torch's sum of the products for windows this short: one lane, 4 accumulators
            acc[e] = ordered_sum(lambda k: pooled_product(vf[k, e], sf[k, e], self.rnd), CH, 1,
                                 CH, SUM_ACCUMULATORS)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gOut: cute.Tensor, num_rows: Int32, num_tokens: Int32,
               rows_per_thread: Int32):
        # Launched as a programmatic dependent (measured in tuning log, "Adopted at v15"), so
        # the launch and CTA start-up overlap the previous kernel's tail; nothing is read or
        # written before that kernel has completed and flushed (any predecessor may produce
        # our inputs or still read the memory of our output).
        cute.arch.griddepcontrol_wait()
        self.pool_rows(gKV, gSc, gApe, mCu, mCuc, gOut, num_rows, num_tokens, rows_per_thread)

    @cute.jit
    def pool_rows(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
                  mCuc: cute.Tensor, gOut: cute.Tensor, num_rows: Int32, num_tokens: Int32,
                  rows_per_thread: Int32):
        """The CTA's rows ``[bx * rows_per_thread * row_lanes, ...)``, pooled and stored."""
        (gKV, gSc), (gOut,), _ = self.batch_tensors((gKV, gSc), (gOut,))
        tid, ty, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        vec, CH, P = self.vec, self.slots, self.stages
        num_seqs = mCuc.shape[0] - 1
        chunk = by * self.lanes + tid
        thr = ty * self.lanes + tid
        sf = cute.make_rmem_tensor((CH, vec), Float32)
        vf = cute.make_rmem_tensor((CH, vec), Float32)
        acc = cute.make_rmem_tensor((vec,), Float32)
        res = cute.make_rmem_tensor((vec,), self.dtype)
        row0 = bx * rows_per_thread * self.row_lanes + ty
        if chunk < self.cpr:
            walk = start_walk(mCu, mCuc, row0, num_seqs, self.warp_search)
            pk = Pack(mCu, mCuc, num_rows, num_tokens, num_seqs)
            # unstaged: output_row loads the window from global memory
            tt = Tiles(gKV, gSc, gApe, chunk, thr)
            if cutlass.const_expr(self.staged):
                smem = cutlass.memory.SmemAllocator()
                tt.sS, tt.sV = self.alloc_staging(smem, P)
                tt.atom = self.window_atom()
                tt.apef = cute.make_rmem_tensor((CH, vec), Float32)
                self.load_ape(tt)

                def issue(w, row, stage):
                    return self.issue_row(tt, pk, w, row, stage)

                walk_in = self.prime_stages(issue, walk, row0, rows_per_thread)
            for i in cutlass.range(rows_per_thread):
                if cutlass.const_expr(self.staged):
                    walk_in = self.advance_stages(issue, walk_in, row0, i, rows_per_thread)
                row = row0 + i * self.row_lanes
                walk = walk_rows(mCu, mCuc, walk, row, num_seqs)
                self.output_row(tt, pk, gOut, (sf, vf, acc, res), walk, row, i % P)
