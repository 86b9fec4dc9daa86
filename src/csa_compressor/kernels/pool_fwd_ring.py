"""Candidate FWD_BULK_RING (config.py): the short-window forward with its windows staged by
bulk copies (``cp.async.bulk``, the copy engine) instead of every thread's ``cp.async``.

Each row lane's first warp issues a row's copies: lane ``k`` copies slot ``k``'s run of
score and of kv (the row lane's ``lanes * vec`` columns of one token row, contiguous in
global memory and in the staging buffer), and lane 0 tells the stage's ``full`` mbarrier
how many bytes to expect. Every thread of the row lane waits on ``full``, reads its own
vectors back as PoolForward does, and arrives on the stage's ``empty`` mbarrier; the
issuing warp waits on ``empty`` before copying the next row into that stage. The
computing threads issue no copies and no ``cp.async.wait_group``; the bytes in flight are
the ring's (``FWD_RING_STAGES`` rows a row lane) whatever the threads are doing.

Same windows, values and op order as PoolForward: bitwise the same outputs.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from . import config
from .common import start_walk, walk_rows, walk_window
from .pool_fwd import PoolForward


def ring_slot(step, stages: int):
    """(stage, phase parity) of a row lane's row ``step`` (0, 1, ...) in a ring of
    ``stages``: rows take the stages in turn, and the stage's mbarriers complete one phase
    a use, so use ``step // stages`` is the phase to wait for. Plain arithmetic, so the
    kernel (on DSL integers) and tests/test_ring_protocol_cpu.py (which replays the
    protocol) share it."""
    return step % stages, (step // stages) % 2


def ring_applies(kernel: PoolForward) -> bool:
    """Where a row lane's run of a slot is one legal bulk copy (16-byte aligned, a multiple
    of 16 bytes), every thread holds a column chunk (the mbarriers count them all), each
    row lane's first warp lies inside it, and one lane a slot fits a warp. Not the
    forwards of 4-byte vectors (d=128 bf16): held to their 64 registers they spilled 64 B
    (ratio 4 coff 2), and held to their grid's CTAs ratio 8 coff 2 spilled too."""
    eb = kernel.dtype.width // 8
    run = kernel.lanes * kernel.vec * eb
    return (kernel.staged and kernel.vec * eb >= 8 and kernel.cpr % kernel.lanes == 0
            and kernel.lanes % 32 == 0
            and run % 16 == 0 and (kernel.coff * kernel.d * eb) % 16 == 0
            and (kernel.d * eb) % 16 == 0 and kernel.slots <= 32)


class PoolForwardRing(PoolForward):
    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, arch_major: int = 9):
        super().__init__(dtype, ratio, coff, head_dim, arch_major)
        assert ring_applies(self), "no bulk-copy ring for this geometry"
        self.coop = False  # read_staged's own vectors; no warp syncs
        self.stages = max(2, config.FWD_RING_STAGES)
        self.run = self.lanes * self.vec  # elements of one bulk copy
        # Two mbarriers (full, empty) a stage and row lane, after the staging buffers.
        self.bar_count = 2 * self.stages * self.row_lanes
        self.smem_bytes = self.staging_bytes(self.stages) + 16 + 8 * self.bar_count
        fit = self.ctas_fitting_smem()
        self.target_ctas_per_sm = max(1, min(self.target_ctas_per_sm, fit))
        # Held to the CTAs its grid is sized for: unbound, the d=512 forward took 135
        # registers (3 CTAs an SM instead of 4).
        self.hold_to(max(1, min(self.min_ctas or self.target_ctas_per_sm, fit)))

    @cute.jit
    def issue_bulk(self, gKV, gSc, sS, sV, atom, full, mCu, mCuc, walk, row, stage, ty, lane,
                   by, num_rows, num_tokens, num_seqs):
        """The issuing warp's copies of row ``row``'s window into ``stage``: lane 0 arms
        ``full`` with the bytes of the non-empty slots (0 for a row that computes nothing,
        so the waiters pass), lane ``k`` copies slot ``k``. Returns the issuing walk."""
        walk = walk_rows(mCu, mCuc, walk, row, num_seqs)
        t0, has_prev, ok = walk_window(walk, row, num_seqs, num_tokens, self.ratio, self.coff)
        go = (row < num_rows) & ok
        eb = self.dtype.width // 8
        copied = Int32(0)
        if go:
            copied = Int32(self.slots)
            if cutlass.const_expr(self.coff == 2):
                if ~has_prev:
                    copied = Int32(self.ratio)
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(full, copied * (2 * self.run * eb))
        cute.arch.sync_warp()
        W = self.coff * self.d
        first = t0
        if cutlass.const_expr(self.coff == 2):
            first = t0 - self.ratio
        k = lane
        own = k >= 0
        if cutlass.const_expr(self.coff == 2):
            own = k >= self.ratio
        if go & (k < self.slots) & (own | has_prev):
            goff = (first + k) * W + by * self.run
            if cutlass.const_expr(self.coff == 2):
                if own:
                    goff = goff + self.d
            soff = ((stage * self.slots + k) * self.threads + ty * self.lanes) * self.vec
            n16 = 16 // eb
            goff = cute.assume(goff, divby=n16)
            soff = cute.assume(soff, divby=n16)
            vl = cute.make_layout((self.run,))
            for src, dst in ((gSc, sS), (gKV, sV)):
                g, s = cpasync.group_bulk_copy_modes(cute.make_tensor(src.iterator + goff, vl),
                                                     cute.make_tensor(dst.iterator + soff, vl))
                cute.copy(atom, g, s, mbar_ptr=full)
        return walk

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gOut: cute.Tensor, num_rows: Int32, num_tokens: Int32,
               rows_per_thread: Int32):
        # Launched as a programmatic dependent, as PoolForward.
        cute.arch.griddepcontrol_wait()
        tid, ty, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        vec, CH, P = self.vec, self.slots, self.stages
        num_seqs = mCuc.shape[0] - 1
        chunk = by * self.lanes + tid
        thr = ty * self.lanes + tid
        smem = cutlass.memory.SmemAllocator()
        sS, sV = self.alloc_staging(smem, P)
        bars = smem.allocate_tensor(Int64, cute.make_layout((self.bar_count,)), 16)
        # full(s) = bars[s + P * ty], empty(s) = bars[s + P * (row_lanes + ty)]
        bar0 = bars.iterator
        if thr == 0:
            for b in cutlass.range_constexpr(self.stages * self.row_lanes):
                cute.arch.mbarrier_init(bar0 + b, 1)
                cute.arch.mbarrier_init(bar0 + (self.stages * self.row_lanes + b), self.lanes)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        full0 = bar0 + P * ty
        empty0 = bar0 + P * (self.row_lanes + ty)
        sf = cute.make_rmem_tensor((CH, vec), Float32)
        vf = cute.make_rmem_tensor((CH, vec), Float32)
        acc = cute.make_rmem_tensor((vec,), Float32)
        res = cute.make_rmem_tensor((vec,), self.dtype)
        apef = cute.make_rmem_tensor((CH, vec), Float32)
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), self.dtype,
                                   num_bits_per_copy=self.run * self.dtype.width)
        row0 = bx * rows_per_thread * self.row_lanes + ty
        issuer = tid < 32  # the row lane's first warp
        walk = start_walk(mCu, mCuc, row0, num_seqs, self.warp_search)
        self.load_ape(gApe, apef, chunk)
        walk_in = walk
        for p in cutlass.range_constexpr(P - 1):
            if issuer & (p < rows_per_thread):
                walk_in = self.issue_bulk(gKV, gSc, sS, sV, atom, full0 + p, mCu, mCuc, walk_in,
                                          row0 + p * self.row_lanes, Int32(p), ty, tid, by,
                                          num_rows, num_tokens, num_seqs)
        for i in cutlass.range(rows_per_thread):
            ahead = i + (P - 1)
            if issuer & (ahead < rows_per_thread):
                sa, _ = ring_slot(ahead, P)
                if i >= 1:
                    # Row i - 1 (the stage's last use) read back by the whole row lane.
                    _, last = ring_slot(i - 1, P)
                    cute.arch.mbarrier_wait(empty0 + sa, last)
                walk_in = self.issue_bulk(gKV, gSc, sS, sV, atom, full0 + sa, mCu, mCuc,
                                          walk_in, row0 + ahead * self.row_lanes, sa, ty, tid,
                                          by, num_rows, num_tokens, num_seqs)
            stage, phase = ring_slot(i, P)
            cute.arch.mbarrier_wait(full0 + stage, phase)
            row = row0 + i * self.row_lanes
            walk = walk_rows(mCu, mCuc, walk, row, num_seqs)
            self.output_row(gKV, gSc, gApe, sS, sV, gOut, sf, vf, acc, res, apef, walk, row,
                            stage, thr, chunk, num_rows, num_tokens, num_seqs,
                            release=empty0 + stage)
