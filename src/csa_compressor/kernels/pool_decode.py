"""A streaming decode step in one launch: each entry's new tokens into its slot's ring, the
rows whose windows closed pooled straight from the ring, the slot's count advanced.

One CTA an entry, one thread a column chunk of the row (PoolForward's vector and column
chunks, one row lane): a thread writes its own columns of the new tokens into the ring
and then reads back only those columns, so no barrier sits between the writes and the
window loads. The ring holds ``coff*ratio + max_next_n`` tokens a slot, so a step's new
tokens never overwrite a token its windows read (streaming/state.py).

A row's window is the training op's row for block ``i`` of the whole sequence (first
token ``i * ratio``, a previous block where ``i > 0``), pooled by PoolForward.pool_row:
the same per-column operations in the same order, so the same bits.

Malformed entries cannot raise inside a CUDA graph: a slot out of range takes the spare
slot, and an entry whose slot is out of range, repeated in the step, already bad, or
pushed past the position limit gets NaN rows, writes no ring and marks its slot bad
(its count still advances, as the gather path's does).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from .plan import DECODE_MAX_THREADS
from .pool_fwd import PoolForward
from .staging import Tiles


@cute.jit
def decode_entry(mSlots: cute.Tensor, mCount: cute.Tensor, mBad: cute.Tensor, b: Int32,
                 tid: Int32, threads: cutlass.Constexpr[int], next_n: Int32, limit: Int32):
    """Entry ``b``'s slot as a decode step's CTA of ``threads`` takes it: (slot, its count,
    the count in 32 bits, malformed). Out of range: the spare slot; malformed: out of range,
    repeated in the step (every CTA scans the step's slots for its own, so both entries of
    a repeated slot see it, with no atomics), already bad, or pushed past ``limit``. Ends
    with a barrier after every thread has read the slot's state (16 bytes of shared
    memory: the repeated-slot flag)."""
    entries = mSlots.shape[0]
    spare = mCount.shape[0] - 1
    smem = cutlass.memory.SmemAllocator()
    flag = smem.allocate_tensor(Int32, cute.make_layout((1,)), 16)
    if tid == 0:
        flag[0] = Int32(0)
    cute.arch.sync_threads()
    raw = mSlots[b]
    repeated = Int32(0)
    for j in cutlass.range(tid, entries, threads, unroll=1):
        if (mSlots[j] == raw) & (j != b):
            repeated = Int32(1)
    if repeated != 0:
        flag[0] = Int32(1)  # any writer's 1 will do
    inside = (raw >= Int64(0)) & (raw < Int64(spare))
    slot = Int32(spare)
    if inside:
        slot = raw.to(Int32)
    c = mCount[slot]
    was_bad = mBad[slot] != Uint8(0)
    cute.arch.sync_threads()  # the flag is whole; every thread has read the slot's state
    # token positions in 32 bits (a 64-bit remainder is a subroutine with a stack frame):
    # a count past that is malformed, and a bad entry reads and writes no ring
    sane = (c >= Int64(0)) & (c + Int64(next_n) <= Int64(2**31 - 1))
    bad = (flag[0] != 0) | (~inside) | was_bad | (~sane)
    bad = bad | (c + Int64(next_n) > Int64(limit))
    c32 = Int32(0)
    if sane:
        c32 = c.to(Int32)
    return slot, c, c32, bad


class PoolDecode(PoolForward):
    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, arch_major: int = 9,
                 tuning=None, numerics: str = "fp32"):
        super().__init__(dtype, ratio, coff, head_dim, arch_major, tuning, numerics=numerics)
        # one CTA holds a whole row, so the slot's count is advanced after one CTA barrier
        assert self.cpr <= DECODE_MAX_THREADS, "plan.decode_designable: a row wider than a CTA"
        self.lanes, self.col_groups, self.row_lanes = self.cpr, 1, 1
        self.threads = self.lanes
        self.staged = self.coop = False
        self.smem_bytes = 16  # the CTA's repeated-slot flag

    @cute.jit
    def __call__(self, mRingKV: cute.Tensor, mRingSc: cute.Tensor, mKV: cute.Tensor,
                 mScore: cute.Tensor, mApe: cute.Tensor, mSlots: cute.Tensor, mCount: cute.Tensor,
                 mLastN: cute.Tensor, mBad: cute.Tensor, mOut: cute.Tensor, mEmit: cute.Tensor,
                 mPos: cute.Tensor, next_n: Int32, history: Int32, limit: Int32, stream):
        tiler = (1, self.vec)
        self.kernel(cute.zipped_divide(mRingKV, tiler), cute.zipped_divide(mRingSc, tiler),
                    cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
                    cute.zipped_divide(mApe, tiler), mSlots, mCount, mLastN, mBad,
                    cute.zipped_divide(mOut, tiler), mEmit, mPos, next_n, history, limit).launch(
            grid=[mSlots.shape[0], 1, 1], block=[self.lanes, 1, 1], smem=self.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.jit
    def ring_row(self, slot: Int32, t: Int32, history: Int32) -> Int32:
        """The ring row of token ``t`` (>= 0) of ``slot``."""
        return slot * history + t % history

    @cute.kernel
    def kernel(self, gRingKV: cute.Tensor, gRingSc: cute.Tensor, gKV: cute.Tensor,
               gSc: cute.Tensor, gApe: cute.Tensor, mSlots: cute.Tensor, mCount: cute.Tensor,
               mLastN: cute.Tensor, mBad: cute.Tensor, gOut: cute.Tensor, mEmit: cute.Tensor,
               mPos: cute.Tensor, next_n: Int32, history: Int32, limit: Int32):
        # launched as a programmatic dependent: nothing is touched before the wait
        cute.arch.griddepcontrol_wait()
        chunk, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        vec, CH, r = self.vec, self.slots, self.ratio
        entries = mSlots.shape[0]
        slot, c, c32, bad = decode_entry(mSlots, mCount, mBad, b, chunk, self.lanes, next_n, limit)
        # every thread read the slot's state before the barrier: advance it now
        if chunk == 0:
            mCount[slot] = c + Int64(next_n)
            mLastN[slot] = Int64(next_n)
            if bad:
                mBad[slot] = Uint8(1)

        tt = Tiles(gRingKV, gRingSc, gApe, chunk)
        tt.apef = cute.make_rmem_tensor((CH, vec), Float32)
        self.load_ape(tt)
        if ~bad:
            for k in cutlass.range(next_n, unroll=1):
                dst = self.ring_row(slot, c32 + k, history)
                for h in cutlass.range_constexpr(self.coff):
                    colc = chunk + h * self.cpr
                    gRingKV[(None, (dst, colc))].store(gKV[(None, (b * next_n + k, colc))].load())
                    gRingSc[(None, (dst, colc))].store(gSc[(None, (b * next_n + k, colc))].load())

        sf = cute.make_rmem_tensor((CH, vec), Float32)
        vf = cute.make_rmem_tensor((CH, vec), Float32)
        acc = cute.make_rmem_tensor((vec,), Float32)
        res = cute.make_rmem_tensor((vec,), self.dtype)
        rows = (next_n + (r - 1)) // r
        i0 = c32 // r
        i1 = (c32 + next_n) // r
        for j in cutlass.range(rows, unroll=1):
            i = i0 + j
            emitted = i < i1
            for e in cutlass.range_constexpr(vec):
                acc[e] = Float32(0.0)
            if emitted & (~bad):
                self.load_ring_window(tt, sf, vf, slot, i * r, i > 0, history)
                self.pool_row(sf, vf, acc)
            if bad:
                for e in cutlass.range_constexpr(vec):
                    acc[e] = Float32(float("nan"))
            res.store(acc.load().to(self.dtype))
            row = b * rows + j
            gOut[(None, (row, chunk))].store(res.load())
            if chunk == 0:  # a row not emitted at position 0: inside any rotary table
                mEmit[row] = Uint8(0)
                mPos[row] = Int64(0)
                if emitted:
                    mEmit[row] = Uint8(1)
                    mPos[row] = Int64(i * r)
        # rows past the entries' (a pack padded for the epilogue's norm): zeros at position 0
        if b == 0:
            for pad in cutlass.range(entries * rows, mPos.shape[0], unroll=1):
                for e in cutlass.range_constexpr(vec):
                    res[e] = self.dtype(0.0)
                gOut[(None, (pad, chunk))].store(res.load())
                if chunk == 0:
                    mPos[pad] = Int64(0)

    @cute.jit
    def load_ring_window(self, tt: Tiles, sf, vf, slot: Int32, t0: Int32, has_prev,
                         history: Int32):
        """The window of first token ``t0`` from ``slot``'s ring into fp32 registers (score
        + ape, value); empty slots get -inf / 0 (staging.WindowSlots.load_slots' values)."""
        for k in cutlass.range_constexpr(self.slots):
            tok, colc, _, valid = self.slot_coords(Int32(k), t0, has_prev, tt.chunk)
            if valid:
                at = self.ring_row(slot, tok, history)
                s32 = tt.score[(None, (at, colc))].load().to(Float32)
                v32 = tt.kv[(None, (at, colc))].load().to(Float32)
                for e in cutlass.range_constexpr(self.vec):
                    sf[k, e] = s32[e] + tt.apef[k, e]
                    vf[k, e] = v32[e]
            else:
                self.empty_slot(sf, vf, k)
