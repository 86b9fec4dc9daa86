"""The compressed rows' offsets in one launch (layout.compressed_cu_seqlens on the GPU,
where torch ops take eight small kernels): ``out[0] = 0``, ``out[s + 1]`` the running sum
of ``floor((cu[k + 1] - cu[k]) / ratio)`` over ``k <= s``, in int64, stored as int32 (the
low 32 bits, as torch's ``.to(torch.int32)``): the same integers for any offsets.

One CTA: thread ``t`` sums a contiguous run of segments, the CTA scans the runs' sums in
shared memory (Hillis-Steele), then each thread writes its run's offsets.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .jit import small_kernel

THREADS = 1024
SCAN_STEPS = 10  # log2(THREADS)


class CompressedOffsets:
    def __init__(self, ratio: int):
        # a compile-time divisor: a multiply-high sequence, where a runtime 64-bit divide
        # is a subroutine with a stack frame
        self.ratio = ratio

    @cute.jit
    def __call__(self, mCu: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mCu, mOut).launch(grid=[1, 1, 1], block=[THREADS, 1, 1],
                                      smem=THREADS * 8, stream=stream)

    @cute.jit
    def blocks(self, mCu: cute.Tensor, s: Int32) -> Int64:
        """floor((cu[s+1] - cu[s]) / ratio): the DSL's ``//`` rounds down, as torch's
        ``rounding_mode="floor"`` (negative lengths of corrupt offsets included)."""
        return (Int64(mCu[s + 1]) - Int64(mCu[s])) // Int64(self.ratio)

    @cute.kernel
    def kernel(self, mCu: cute.Tensor, mOut: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        segs = mCu.shape[0] - 1
        per = (segs + THREADS - 1) // THREADS
        lo = cutlass.min(tid * per, segs)
        hi = cutlass.min(lo + per, segs)
        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(Int64, cute.make_layout((THREADS,)), 16)
        own = Int64(0)
        for s in cutlass.range(lo, hi):
            own = own + self.blocks(mCu, s)
        sums[tid] = own
        cute.arch.sync_threads()
        for k in cutlass.range_constexpr(SCAN_STEPS):
            v = Int64(0)
            if tid >= (1 << k):
                v = sums[tid - (1 << k)]
            cute.arch.sync_threads()
            sums[tid] = sums[tid] + v
            cute.arch.sync_threads()
        run = sums[tid] - own  # the runs before this thread's
        if tid == 0:
            mOut[0] = Int32(0)
        for s in cutlass.range(lo, hi):
            run = run + self.blocks(mCu, s)
            mOut[s + 1] = run.to(Int32)


def compile_args() -> tuple:
    """Symbolic arguments: the segment count stays symbolic (one compile a ratio)."""
    from .plan import _fake

    B1 = cute.sym_int32()
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (_fake(cutlass.Int32, (B1,), 4), _fake(cutlass.Int32, (B1,), 4), stream)


def compressed_offsets(cu, ratio: int):
    """``(B+1,)`` int32 compressed offsets of the int32 token offsets ``cu``, or None
    where the kernel cannot be had now (jit.small_kernel)."""
    import torch

    fn = small_kernel(("offsets", ratio), cu.device,
                      lambda: (CompressedOffsets(ratio), compile_args()))
    if fn is None:
        return None
    out = torch.empty_like(cu)
    fn(cu, out)
    return out
