"""What a streaming prefill does after its pooling, in one launch: each slot's last
``history`` tokens of its chunk into its ring, its count advanced, and the emitted rows'
slots and positions written. The torch ops it stands in for were some fourteen small
launches and two host copies a call (streaming/chunks.py).

A column of CTAs a call slot, each thread COPIES_IN_FLIGHT 16-byte copies with their loads
issued before their stores: one CTA a slot, one copy at a time, took some 30 µs at ratio
128 (a ring of 132 tokens a slot: each thread's chain of dependent loads and stores) where
the pooling before it took 37. Per slot the host passes (slot, first chunk row, new
tokens, tokens seen before, first output row) as int32 (prefill has checked them: slots
in range, counts within int32, chunks inside the pack). The CTA at y 0 writes the rows'
slots and positions and the count.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .jit import small_kernel

THREADS = 256
COPIES_IN_FLIGHT = 4  # a thread's loads issued before its stores
PER_CTA = THREADS * COPIES_IN_FLIGHT
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
            grid=[mMeta.shape[0], (history * self.chunks + PER_CTA - 1) // PER_CTA, 1],
            block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gRingKV: cute.Tensor,
               gRingSc: cute.Tensor, mMeta: cute.Tensor, mCount: cute.Tensor,
               mLastN: cute.Tensor, mSlots: cute.Tensor, mPos: cute.Tensor, history: Int32):
        tid, _, _ = cute.arch.thread_idx()
        b, y, _ = cute.arch.block_idx()
        r = self.ratio
        slot, start, n, c, row0 = (mMeta[b, k] for k in range(META))
        keep = cutlass.min(n, history)
        first = c + n - keep
        total = keep * self.chunks
        base = y * PER_CTA + tid
        if base < total:
            # past the end a thread copies the slot's last vector again: the same bytes to
            # the same place as its owner, so every load and store can be unconditional
            kv, sc, at = [], [], []
            for i in cutlass.range_constexpr(COPIES_IN_FLIGHT):
                e = cutlass.min(base + i * THREADS, total - 1)
                k = e // self.chunks
                ch = e - k * self.chunks
                t = first + k
                at.append((slot * history + t % history, ch))
                kv.append(gKV[(None, (start + (t - c), ch))].load())
                sc.append(gSc[(None, (start + (t - c), ch))].load())
            for i in cutlass.range_constexpr(COPIES_IN_FLIGHT):
                gRingKV[(None, at[i])].store(kv[i])
                gRingSc[(None, at[i])].store(sc[i])
        if y == 0:
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
