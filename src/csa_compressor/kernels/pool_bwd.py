"""Fused backward of the gated pooling: one launch writes every element of dkv and dscore
and one fp32 dape partial per row-CTA.

Two kinds of CTA share the grid:
- row CTAs (bx < num_row_ctas) walk ``rows_per_cta`` consecutive rows (row lanes
  interleaved; each thread stages its rows' windows and grad_out vectors through cp.async
  BWD_STAGES rows ahead, as the forward does), recompute the
  window softmax in the forward's op order and store ``dkv = g*p`` and
  ``dscore = fma(-p, S, p*dp)`` (``dp = g*v``, ``S`` a serial sum of ``p*dp``: torch's
  softmax backward, operation for operation) at the window's
  slots: each input element is in at most one window, so these are plain disjoint stores.
  dape contributions are summed per thread in registers over its rows (fixed order) and
  stored as the CTA's partial; the host reduces the partials in a fixed order, so the
  whole backward is bitwise reproducible without atomics.
- zero CTAs write exact zeros to the elements no window reads (tails, the first-half
  columns of a segment's last block, short segments, tokens at or past cu_seqlens[B],
  rows cut off by total_comp), so gradient buffers may start uninitialised.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .tuning import Tuning, current
from .segments import Pack, start_walk, walk_rows, walk_window
from .ptx import rounder
from .softmax import p_times_dp, softmax_grads, softmax_row
from .backward_grid import BackwardGrid
from .staging import Tiles, WindowSlots, smem_footprint


class PoolBackward(BackwardGrid, WindowSlots):
    # Launched as a programmatic dependent whose first statement is griddepcontrol.wait
    # (kernel(), and pool_long.LongPoolBackward's): the launch and CTA start-up overlap the
    # previous kernel's tail (docs/lab/tuning-log.md).

    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, arch_major: int = 9,
                 large: bool = False, tuning: Tuning | None = None, row_stride: int = 0,
                 batch: int = 0, numerics: str = "fp32", vec_bytes: int | None = None):
        self.t = t = tuning or current()
        if vec_bytes is None:
            vec_bytes = t.BWD_VEC_BYTES
            if dtype.width == 32 and t.BWD_FP32_VEC_BYTES != vec_bytes:
                # fp32 takes bf16's two elements a thread where the wider staging keeps the
                # design's CTAs an SM (at d=128 it would not: 3 -> 1)
                kw = dict(tuning=t, row_stride=row_stride, batch=batch, numerics=numerics)
                wide = PoolBackward(dtype, ratio, coff, head_dim, arch_major,
                                    vec_bytes=t.BWD_FP32_VEC_BYTES, **kw)
                narrow = PoolBackward(dtype, ratio, coff, head_dim, arch_major,
                                      vec_bytes=vec_bytes, **kw)
                # and only where the wider staging fits a CTA at all (d=64 ratio 8 coff 2
                # asked 230 KB, past the 227 KB a CTA may have, and failed to launch)
                if (wide.ctas_fitting_smem() >= 1
                        and wide.target_ctas_per_sm >= narrow.target_ctas_per_sm):
                    vec_bytes = t.BWD_FP32_VEC_BYTES
        self.dtype = dtype
        self.rnd = rounder(dtype, numerics)
        self.ratio = ratio
        self.coff = coff
        self.d = head_dim
        self.set_rows(row_stride, batch)
        self.vec = t.vector_elems(head_dim, dtype.width // 8, vec_bytes)
        self.cpr = head_dim // self.vec
        self.slots = coff * ratio
        assert self.slots <= self.t.MAX_REG_SLOTS, "long windows use pool_long.LongPoolBackward"
        self.chunk_slots = self.slots  # the whole window lives in registers, read once
        self.lanes = min(self.cpr, self.t.MAX_CTA_THREADS)
        self.col_groups = math.ceil(self.cpr / self.lanes)
        # Row lanes need every thread active (one column group) for the CTA barrier.
        stack = self.col_groups == 1
        self.row_lanes = max(1, self.t.BWD_CTA_THREADS // self.lanes) if stack else 1
        self.min_rows_per_cta = self.row_lanes
        self.target_ctas_per_sm = self.t.BWD_TARGET_CTAS_PER_SM
        # ``large``: the variant for packs of BWD_LARGE_PACK_ROWS rows or more
        # (launch.backward_kernel), where stacked row lanes take the cooperative copies too,
        # at one CTA an SM fewer than the default (below).
        stacked_coop = large and self.row_lanes > 1
        self.threads = self.lanes * self.row_lanes
        self.red_bytes = (self.row_lanes * self.slots * self.vec * self.lanes * 4
                          if self.row_lanes > 1 else 0)
        self.staged = self.stageable()
        self.specialise()
        self.interleave = self.col_groups > 1  # see grid()
        self.stages = self.t.BWD_STAGES
        # In kernel()'s order: the window stages (score, kv), the grad_out stages, the row
        # lanes' dape sums.
        grad_bytes = self.stages * self.threads * self.vec * dtype.width // 8
        staging = (self.staging_bytes(self.stages) + smem_footprint(grad_bytes)
                   if self.staged else 0)
        self.smem_bytes = staging + smem_footprint(self.red_bytes)
        # Size the grid for the CTAs whose shared memory fits an SM (at d=128 only 3 do): a
        # grid sized for more runs a partial second wave.
        self.target_ctas_per_sm = max(1, min(self.target_ctas_per_sm, self.ctas_fitting_smem()))
        default_ctas = self.target_ctas_per_sm
        large_ctas = self.large_pack_ctas(default_ctas)
        if stacked_coop:
            assert large_ctas, "this configuration has no large-pack variant (has_large_variant)"
            self.target_ctas_per_sm = large_ctas
        # Warp-cooperative 16-byte staging copies of the window (staging.stage_window_warp;
        # measured in tuning log, "Adopted at v17"). With stacked row lanes (d=128: 256
        # threads) only in the large-pack variant, held to fewer CTAs an SM than the
        # default: at d=128 ratio 4 coff 2's 3, ptxas spilled 108 B under their 80
        # registers, and small packs ran faster without (BWD_LARGE_PACK_ROWS). Not
        # on sm_100, where the d=512 bound spilled 8 B (sm_90a: none).
        coop_ok = self.coop_stageable() and arch_major == 9
        self.coop = coop_ok and (self.row_lanes == 1 or stacked_coop)
        self.guess_first = self.coop and self.guesses_at(self.target_ctas_per_sm)
        self.has_large_variant = coop_ok and self.row_lanes > 1 and not large and large_ctas > 0
        # Whether that variant guesses, which may make it pay from fewer rows
        # (BWD_LARGE_GUESS_PACK_ROWS; launch.backward_kernel).
        self.large_guesses = self.has_large_variant and self.guesses_at(large_ctas)
        # A register bound for the cooperative copies, whose lane offsets cost ptxas 6-11
        # registers (86 at d=512): held to the CTAs the grid is sized for, or the one-wave
        # grid runs 1.2 waves; at most as many as BWD_COOP_MAX_CTAS allows a window of its
        # size (more spilled).
        if self.coop:
            ctas = self.target_ctas_per_sm
            for elems, most in t.coop_max_ctas(coff):
                if self.slots * self.vec > elems:
                    ctas = min(ctas, most)
            self.hold_to(ctas)
        else:
            self.hold_to(0)

    def guesses_at(self, ctas: int) -> bool:
        """A cooperative backward held to ``ctas`` CTAs an SM copies its first row's window at
        a guess before the row walk (stage_guess; lab tuning-backward.md, "The first window at
        a guess"): with one row lane, or stacked row lanes at 3 CTAs an SM or fewer. The d=128
        default backward took 88 registers with it (78 without: 2 CTAs an SM instead of 3),
        spilling 8 B held to 3; large-pack variants held to 4 and 5 spilled (ratio 5, 3, coff 1)."""
        return self.row_lanes == 1 or ctas <= 3

    def large_pack_ctas(self, default_ctas: int) -> int:
        """CTAs an SM of the large-pack variant, 0 where there is none. The variant trades
        CTAs for wide copies. It paid at every one-CTA step measured (3 -> 2, 4 -> 3, 5 ->
        4, 6 -> 5: BWD_LARGE_PACK_ROWS) and at 6 -> 4 where 6 -> 5 spills (windows of
        4 slots: ratio 2 coff 2, ratio 4 coff 1; BWD_LARGE_MAX_SLOTS), and lost at
        4-6 -> 2. Shared memory holding a kernel to 2 or fewer (ratio 8 coff 2 at d=128: 1)
        leaves nothing to trade."""
        if not 3 <= default_ctas <= self.t.BWD_LARGE_MAX_DEFAULT_CTAS:
            return 0
        fewest = max(2, default_ctas - 2)
        for ctas in range(default_ctas - 1, fewest - 1, -1):
            if self.slots <= self.t.large_max_slots(ctas):
                return ctas
        return 0

    @cute.jit
    def issue_row(self, tt: Tiles, pk: Pack, walk, row, stage):
        """Start the cp.async copies of row ``row``'s window and grad_out vector into
        ``stage``; returns the issuing walk. Rows that compute nothing copy nothing."""
        walk = walk_rows(pk.cu, pk.cuc, walk, row, pk.num_seqs)
        t0, has_prev, ok = walk_window(walk, row, pk.num_seqs, pk.num_tokens, self.ratio,
                                       self.coff)
        if (row < pk.num_rows) & self.real(walk, pk.num_seqs) & ok:
            self.stage_row(tt, row, t0, has_prev, stage)
        return walk

    @cute.jit
    def stage_row(self, tt: Tiles, row, t0, has_prev, stage):
        """The cp.async copies of row ``row``'s grad_out vector and window (first token t0)."""
        self.copy_vec(tt.grad_atom, tt.grad[(None, (row, tt.chunk))].iterator,
                      tt.sG[(None, tt.thr, stage)].iterator)
        self.stage_window(tt, t0, has_prev, stage)

    @cute.jit
    def real(self, walk, num_seqs):
        """The walk is on a true segment (not past the last: padding rows have no gradient)."""
        s, _, _, _ = walk
        return s < num_seqs

    @cute.jit
    def store_slots(self, gDKV, gDSc, sf, vf, dacc, t0, has_prev, chunk):
        """Store dscore (in sf) and dkv (in vf) of the window's slots and add dscore to the
        thread's dape registers ``dacc``."""
        vl = cute.make_layout((self.vec,))
        bS = self.window_base(gDSc, t0, chunk)
        bV = self.window_base(gDKV, t0, chunk)
        for kk in cutlass.range_constexpr(self.chunk_slots):
            _, _, _, valid = self.slot_coords(Int32(kk), t0, has_prev, chunk)
            if valid:
                off = self.slot_offset(kk)
                cute.make_tensor(bS + off, vl).store(sf[kk, None].load().to(gDSc.element_type))
                cute.make_tensor(bV + off, vl).store(vf[kk, None].load().to(self.dtype))
                if cutlass.const_expr(self.has_ape):
                    for e in cutlass.range_constexpr(self.vec):
                        dacc[kk, e] = dacc[kk, e] + sf[kk, e]

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gGrad: cute.Tensor, gDKV: cute.Tensor, gDSc: cute.Tensor,
               gWork: cute.Tensor, num_rows: Int32, num_tokens: Int32, rows_per_cta: Int32,
               num_row_ctas: Int32):
        tid, ty, _ = cute.arch.thread_idx()
        bx, by = self.cta_coords()
        # Lets the dape sum (dape_reduce.DapeReduce) be scheduled before this grid ends;
        # it waits for this grid's completion and memory flush before reading.
        cute.arch.griddepcontrol_launch_dependents()
        # Before any read or write: any predecessor may produce our inputs or still read
        # the memory of our outputs.
        cute.arch.griddepcontrol_wait()
        self.pool_rows(gKV, gSc, gApe, mCu, mCuc, gGrad, gDKV, gDSc, gWork, num_rows, num_tokens,
                       rows_per_cta, num_row_ctas, tid, ty, bx, by)

    @cute.jit
    def pool_rows(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
                  mCuc: cute.Tensor, gGrad: cute.Tensor, gDKV: cute.Tensor, gDSc: cute.Tensor,
                  gWork: cute.Tensor, num_rows: Int32, num_tokens: Int32, rows_per_cta: Int32,
                  num_row_ctas: Int32, tid, ty, bx, by):
        """The CTA's work: its rows' window gradients and dape partial, or its zero fill
        (thread ``(tid, ty)`` of CTA ``(bx, by)``, cta_coords())."""
        (gKV, gSc, gDKV, gDSc), (gGrad,), gWork = self.batch_tensors(
            (gKV, gSc, gDKV, gDSc), (gGrad,), gWork, num_row_ctas * self.ratio)
        vec, CH, ratio, cpr = self.vec, self.chunk_slots, self.ratio, self.cpr
        num_seqs = mCuc.shape[0] - 1
        chunk = by * self.lanes + tid
        if chunk < cpr:
            if bx < num_row_ctas:
                sf, vf, gv, dacc = self.backward_registers()
                row0 = bx * rows_per_cta + ty
                # The walk starts here, or after the guessed copies where the kernel guesses
                # (below); one site for both moved the non-guessing kernels' code.
                if cutlass.const_expr(not self.guess_first):
                    walk = start_walk(mCu, mCuc, row0, num_seqs, self.warp_search)
                smem = cutlass.memory.SmemAllocator()
                # this thread's rows: row0, row0 + row_lanes, ... below bx*rows_per_cta + rows_per_cta
                mine = (rows_per_cta - ty + self.row_lanes - 1) // self.row_lanes
                tt = Tiles(gKV, gSc, gApe, chunk, grad=gGrad)
                pk = Pack(mCu, mCuc, num_rows, num_tokens, num_seqs)
                if cutlass.const_expr(self.staged):
                    P = self.stages
                    tt.sS, tt.sV = self.alloc_staging(smem, P)
                    tt.sG = smem.allocate_tensor(self.dtype, cute.make_layout((vec, self.threads, P)), 16)
                    tt.grad_atom, tt.atom = self.copy_atom(), self.window_atom()
                    tt.thr = ty * self.lanes + tid
                if cutlass.const_expr(self.guess_first):
                    def stage_row(row, t0, has_prev, stage):
                        self.stage_row(tt, row, t0, has_prev, stage)

                    t0g, okg = self.stage_guess(stage_row, row0, mine, num_rows, num_tokens)
                    walk = start_walk(mCu, mCuc, row0, num_seqs, self.warp_search)
                if cutlass.const_expr(self.staged):
                    def issue(w, row, stage):
                        return self.issue_row(tt, pk, w, row, stage)

                    if cutlass.const_expr(self.guess_first):
                        t1, prev1, ok1 = walk_window(walk, row0, num_seqs, num_tokens, ratio,
                                                     self.coff)
                        go = (row0 < num_rows) & self.real(walk, num_seqs) & ok1
                        self.fix_guess(stage_row, go, t1, prev1, t0g, okg, row0)
                        walk_in = self.prime_stages(issue, walk, row0, mine, 1)
                    else:
                        walk_in = self.prime_stages(issue, walk, row0, mine)
                if cutlass.const_expr(self.staged):  # unstaged: APE loaded by load_slots
                    tt.apef = cute.make_rmem_tensor((CH, vec), Float32)
                for i in cutlass.range(mine):
                    row = row0 + i * self.row_lanes
                    if cutlass.const_expr(self.staged):
                        # The row's APE loads go out before the stage's wait, so their
                        # latency hides behind it; held for the whole walk instead they
                        # spill at d=512.
                        self.load_ape(tt)
                        walk_in = self.advance_stages(issue, walk_in, row0, i, mine)
                    walk = walk_rows(mCu, mCuc, walk, row, num_seqs)
                    t0, has_prev, ok = walk_window(walk, row, num_seqs, num_tokens, self.ratio,
                                                   self.coff)
                    if (row < num_rows) & self.real(walk, num_seqs) & ok:
                        if cutlass.const_expr(self.staged):
                            stage = i % self.stages
                            gv.store(tt.sG[(None, tt.thr, stage)].load().to(Float32))
                            self.read_staged(tt, sf, vf, t0, has_prev, stage)
                        else:
                            gv.store(gGrad[(None, (row, chunk))].load().to(Float32))
                            self.load_slots(tt, sf, vf, Int32(0), t0, has_prev)
                        softmax_row(sf, vec, CH)
                        for e in cutlass.range_constexpr(vec):
                            g = gv[e]
                            for k in cutlass.range_constexpr(CH):
                                p = sf[k, e]
                                pdp = p_times_dp(p, g, vf[k, e], self.rnd)
                                sf[k, e] = p
                                vf[k, e] = pdp  # p*dp until S is known
                            acc = vf[0, e]
                            for k in cutlass.range_constexpr(1, CH):
                                acc = acc + vf[k, e]
                            for k in cutlass.range_constexpr(CH):
                                sf[k, e], vf[k, e] = softmax_grads(sf[k, e], vf[k, e], acc, g, self.rnd)
                        self.store_slots(gDKV, gDSc, sf, vf, dacc, t0, has_prev, chunk)
                if cutlass.const_expr(self.row_lanes > 1 and self.has_ape):
                    # Row lanes meet in shared memory; lane 0 sums them in a fixed order.
                    red = smem.allocate_tensor(
                        Float32, cute.make_layout((self.lanes, CH * vec, self.row_lanes)), 16)
                    for i in cutlass.range_constexpr(CH * vec):
                        red[tid, i, ty] = dacc[i // vec, i % vec]
                    cute.arch.barrier()
                    if ty == 0:
                        for y in cutlass.range_constexpr(1, self.row_lanes):
                            for i in cutlass.range_constexpr(CH * vec):
                                dacc[i // vec, i % vec] = dacc[i // vec, i % vec] + red[tid, i, y]
                if cutlass.const_expr(self.has_ape):  # else no dape: the partials stay unwritten
                    if ty == 0:
                        for kk in cutlass.range_constexpr(CH):
                            _, colc, arow, _ = self.slot_coords(Int32(kk), Int32(0), True, chunk)
                            gWork[(None, (bx * ratio + arow, colc))].store(dacc[kk, None].load())
            else:
                t = ((bx - num_row_ctas) * self.row_lanes + ty) * self.t.ZERO_TOKENS_PER_THREAD
                self.zero_unread(Pack(mCu, mCuc, num_rows, num_tokens, num_seqs), gDKV, gDSc, t,
                                 chunk)
