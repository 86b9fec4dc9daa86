"""A decode step's entries over rings that hold whole windows (streaming/state.py's
aligned rings, coff 1), in one launch: each entry's slot checked, its new tokens into the
ring, its count advanced, and what the training forward's pooling then reads in place:
``cu[b]``, the ring row where entry ``b``'s closing window starts, -1 where none closed
(the pooling reads nothing and writes zeros), or the rings' NaN window (``poison``) where
the entry is malformed (its row NaN), with the row's emitted flag and its position. The
rows are then the training
forward's (its kernel over the same tokens); in torch ops this bookkeeping is some fifty
small launches a step (steps._in_place and its slot checks).

One CTA an entry, its threads copying the new tokens' vectors. Malformed entries as
pool_decode's (pool_decode.decode_entry): such an entry writes no ring, marks its slot bad
and reads the NaN window (its count still advances).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

from .jit import small_kernel
from .pool_decode import decode_entry

THREADS = 128


class DecodeEntries:
    def __init__(self, dtype, width: int, vec: int, ratio: int):
        self.dtype, self.width, self.vec, self.ratio = dtype, width, vec, ratio
        self.chunks = width // vec

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mRingKV: cute.Tensor,
                 mRingSc: cute.Tensor, mSlots: cute.Tensor, mCount: cute.Tensor,
                 mLastN: cute.Tensor, mBad: cute.Tensor, mCu: cute.Tensor,
                 mEmit: cute.Tensor, mPos: cute.Tensor, next_n: Int32, history: Int32,
                 limit: Int32, poison: Int32, stream):
        tiler = (1, self.vec)
        self.kernel(cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
                    cute.zipped_divide(mRingKV, tiler), cute.zipped_divide(mRingSc, tiler),
                    mSlots, mCount, mLastN, mBad, mCu, mEmit, mPos, next_n, history,
                    limit, poison).launch(grid=[mSlots.shape[0], 1, 1], block=[THREADS, 1, 1], smem=16,
                                  stream=stream)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gRingKV: cute.Tensor,
               gRingSc: cute.Tensor, mSlots: cute.Tensor, mCount: cute.Tensor,
               mLastN: cute.Tensor, mBad: cute.Tensor, mCu: cute.Tensor,
               mEmit: cute.Tensor, mPos: cute.Tensor, next_n: Int32, history: Int32,
               limit: Int32, poison: Int32):
        tid, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        r = self.ratio
        entries = mSlots.shape[0]
        slot, c, c32, bad = decode_entry(mSlots, mCount, mBad, b, tid, THREADS, next_n, limit)
        if tid == 0:
            mCount[slot] = c + Int64(next_n)
            mLastN[slot] = Int64(next_n)
            i0 = c32 // r
            first = i0 * r
            at = Int32(-1)
            mEmit[b] = Uint8(0)
            mPos[b] = Int64(0)
            if (c32 + next_n) // r > i0:  # next_n <= ratio: one window closes at most
                mEmit[b] = Uint8(1)
                mPos[b] = Int64(first)
                at = slot * history + first % history
            if bad:
                mBad[slot] = Uint8(1)
                at = poison
            mCu[b] = at
            if b == 0:
                mCu[entries] = Int32(-1)
                for pad in cutlass.range(entries, mPos.shape[0], unroll=1):
                    mPos[pad] = Int64(0)  # rows past the entries': position 0
        if ~bad:
            for e in cutlass.range(tid, next_n * self.chunks, THREADS, unroll=1):
                k = e // self.chunks
                ch = e - k * self.chunks
                dst = slot * history + (c32 + k) % history
                gRingKV[(None, (dst, ch))].store(gKV[(None, (b * next_n + k, ch))].load())
                gRingSc[(None, (dst, ch))].store(gSc[(None, (b * next_n + k, ch))].load())


def compile_args(cdt, width: int) -> tuple:
    """Symbolic arguments: tokens, ring rows, entries, state slots and positions stay
    symbolic (one compile a dtype, width and ratio)."""
    from .plan import _fake

    T, R, B, B1, S, M = (cute.sym_int32() for _ in range(6))
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (_fake(cdt, (T, width), 16), _fake(cdt, (T, width), 16), _fake(cdt, (R, width), 16),
            _fake(cdt, (R, width), 16), _fake(Int64, (B,), 8), _fake(Int64, (S,), 8),
            _fake(Int64, (S,), 8), _fake(Uint8, (S,), 1), _fake(Int32, (B1,), 4),
            _fake(Uint8, (B,), 1), _fake(Int64, (M,), 8), Int32(1), Int32(1), Int32(1),
            Int32(1), stream)


def decode_entries(dtype, width: int, ratio: int, device):
    """The launchable kernel for ``dtype`` (torch) rows of ``width`` at ``ratio``, or None
    where it cannot be had now (jit.small_kernel)."""
    from .plan import cutlass_dtype
    from .prefill_tail import tail_vector

    vec = tail_vector(width, dtype.itemsize)
    return small_kernel(("decode_entries", dtype, width, ratio), device,
                        lambda: (DecodeEntries(cutlass_dtype(dtype), width, vec, ratio),
                                 compile_args(cutlass_dtype(dtype), width)))
