"""What a streaming prefill does after its pooling, in one launch: each slot's last
``history`` tokens of its chunk into its ring, its count advanced, and the emitted rows'
slots and positions written. The torch ops it stands in for were some fourteen small
launches and two host copies a call (streaming/chunks.py).

One CTA a call slot. Per slot the host passes (slot, first chunk row, new tokens, tokens
seen before, first output row) as int32 (prefill has checked them: slots in range, counts
within int32, chunks inside the pack).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .jit import small_kernel

THREADS = 256
META = 5  # slot, chunk start, new tokens, tokens before, first row


class PrefillTail:
    def __init__(self, dtype, width: int, vec: int, ratio: int):
        self.dtype, self.width, self.vec, self.ratio = dtype, width, vec, ratio
        self.chunks = width // vec

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mRingKV: cute.Tensor,
                 mRingSc: cute.Tensor, mMeta: cute.Tensor, mCount: cute.Tensor,
                 mLastN: cute.Tensor, mSlots: cute.Tensor, mPos: cute.Tensor, history: Int32,
                 stream):
        tiler = (1, self.vec)
        self.kernel(cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
                    cute.zipped_divide(mRingKV, tiler), cute.zipped_divide(mRingSc, tiler),
                    mMeta, mCount, mLastN, mSlots, mPos, history).launch(
            grid=[mMeta.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gRingKV: cute.Tensor,
               gRingSc: cute.Tensor, mMeta: cute.Tensor, mCount: cute.Tensor,
               mLastN: cute.Tensor, mSlots: cute.Tensor, mPos: cute.Tensor, history: Int32):
        tid, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        r = self.ratio
        slot, start, n, c, row0 = (mMeta[b, k] for k in range(META))
        keep = cutlass.min(n, history)
        first = c + n - keep
        for e in cutlass.range(tid, keep * self.chunks, THREADS, unroll=1):
            k = e // self.chunks
            ch = e - k * self.chunks
            t = first + k
            dst = slot * history + t % history
            src = start + (t - c)
            gRingKV[(None, (dst, ch))].store(gKV[(None, (src, ch))].load())
            gRingSc[(None, (dst, ch))].store(gSc[(None, (src, ch))].load())
        i0 = c // r
        rows = (c + n) // r - i0
        for j in cutlass.range(tid, rows, THREADS, unroll=1):
            mSlots[row0 + j] = Int64(slot)
            mPos[row0 + j] = Int64(i0 + j) * Int64(r)
        if tid == 0:
            mCount[slot] = Int64(c + n)
            mLastN[slot] = Int64(0)


def tail_vector(width: int, elem_bytes: int) -> int:
    """Elements of one copy: 16 bytes where the rows allow, else the widest that divides."""
    return next(b for b in (16, 8, 4, 2, 1) if b >= elem_bytes and (width * elem_bytes) % b == 0
                ) // elem_bytes


def compile_args(cdt, width: int) -> tuple:
    """Symbolic arguments: tokens, ring rows, call slots, state slots and rows stay
    symbolic (one compile a dtype, width and ratio)."""
    from .plan import _fake

    T, R, B, S, M = (cute.sym_int32() for _ in range(5))
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (_fake(cdt, (T, width), 16), _fake(cdt, (T, width), 16), _fake(cdt, (R, width), 16),
            _fake(cdt, (R, width), 16), _fake(Int32, (B, META), 4), _fake(Int64, (S,), 8),
            _fake(Int64, (S,), 8), _fake(Int64, (M,), 8), _fake(Int64, (M,), 8), Int32(1), stream)


def prefill_tail(dtype, width: int, ratio: int, device):
    """The launchable tail for ``dtype`` (torch) rows of ``width`` at ``ratio``, or None
    where it cannot be had now (jit.small_kernel)."""
    from .plan import cutlass_dtype

    vec = tail_vector(width, dtype.itemsize)
    return small_kernel(("prefill_tail", dtype, width, ratio), device,
                        lambda: (PrefillTail(cutlass_dtype(dtype), width, vec, ratio),
                                 compile_args(cutlass_dtype(dtype), width)))
