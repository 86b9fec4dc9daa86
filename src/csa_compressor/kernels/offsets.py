"""The compressed rows' offsets in one launch (layout.compressed_cu_seqlens on the GPU,
where torch ops take eight small kernels): ``out[0] = 0``, ``out[s + 1]`` the running sum
of ``floor((cu[k + 1] - cu[k]) / ratio)`` over ``k <= s``, in int64, stored as int32 (the
low 32 bits, as torch's ``.to(torch.int32)``): the same integers for any offsets.

One CTA: thread ``t`` sums a contiguous run of segments, the CTA scans the runs' sums in
shared memory (Hillis-Steele), then each thread writes its run's offsets.
"""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from .jit import small_kernel

THREADS = 1024
SCAN_STEPS = 10  # log2(THREADS)


@cute.jit
def thread_run(tid: Int32, n: Int32):
    """``(lo, hi)``: thread ``tid``'s contiguous run of ``n`` items, THREADS threads."""
    per = (n + THREADS - 1) // THREADS
    lo = cutlass.min(tid * per, n)
    return lo, cutlass.min(lo + per, n)


@cute.jit
def runs_before(sums: cute.Tensor, tid: Int32, own):
    """The sum of the values ``own`` of the threads before ``tid``: a Hillis-Steele scan
    in the shared memory ``sums`` (THREADS values of own's type), whose last entry then
    holds the total."""
    sums[tid] = own
    cute.arch.sync_threads()
    for k in cutlass.range_constexpr(SCAN_STEPS):
        v = sums.element_type(0)
        if tid >= (1 << k):
            v = sums[tid - (1 << k)]
        cute.arch.sync_threads()
        sums[tid] = sums[tid] + v
        cute.arch.sync_threads()
    return sums[tid] - own


class RunScan:
    """One CTA's exclusive scan of ``self.item(m, i)`` over ``n`` items: each thread sums
    its contiguous run (thread_run), the CTA scans the runs' sums (runs_before)."""

    @cute.jit
    def scanned_run(self, m: cute.Tensor, sums: cute.Tensor, tid: Int32, n: Int32):
        """``(lo, hi, before)``: thread ``tid``'s run and the items' sum over the runs
        before it; ``sums`` (THREADS values of the items' type) then ends with the total."""
        lo, hi = thread_run(tid, n)
        own = sums.element_type(0)
        for i in cutlass.range(lo, hi):
            own = own + self.item(m, i)
        return lo, hi, runs_before(sums, tid, own)


class CompressedOffsets(RunScan):
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

    item = blocks  # RunScan's

    @cute.kernel
    def kernel(self, mCu: cute.Tensor, mOut: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(Int64, cute.make_layout((THREADS,)), 16)
        lo, hi, run = self.scanned_run(mCu, sums, tid, mCu.shape[0] - 1)
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
    fn = small_kernel(("offsets", ratio), cu.device,
                      lambda: (CompressedOffsets(ratio), compile_args()))
    if fn is None:
        return None
    out = torch.empty_like(cu)
    fn(cu, out)
    return out


GUARD_THREADS = 1024
GUARD_MAX_CTAS = 16  # every CTA checks every segment: a few, each copying a slice of ape


class OffsetsGuard:
    """``out = ape`` (zeros past ape's end: an empty ape gives the flag alone, for packs
    with no position bias) where the pack's offsets keep the layout's rules, else NaN: the
    default GPU path's check, with no host sync. The pooling then reads ``out``, so a
    malformed pack gives NaN rows and gradients instead of finite garbage. The rules are
    validation.check_offset_contents': ``cu[0] == 0``, no segment shorter than 0 tokens,
    ``cu[B] <= num_tokens``, ``cuc[s+1] - cuc[s] == (cu[s+1] - cu[s]) // ratio`` with
    ``cuc[0] == 0``, and ``cuc[B] <= total_comp``."""

    def __init__(self, ratio: int):
        self.ratio = ratio

    @cute.jit
    def __call__(self, mCu: cute.Tensor, mCuc: cute.Tensor, mApe: cute.Tensor, mOut: cute.Tensor,
                 num_tokens: Int32, total_comp: Int32, ctas: Int32, stream):
        self.kernel(mCu, mCuc, mApe, mOut, num_tokens, total_comp).launch(
            grid=[ctas, 1, 1], block=[GUARD_THREADS, 1, 1], smem=16, stream=stream)

    @cute.kernel
    def kernel(self, mCu: cute.Tensor, mCuc: cute.Tensor, mApe: cute.Tensor, mOut: cute.Tensor,
               num_tokens: Int32, total_comp: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        segs = mCu.shape[0] - 1
        smem = cutlass.memory.SmemAllocator()
        flag = smem.allocate_tensor(Int32, cute.make_layout((1,)), 16)
        if tid == 0:
            flag[0] = Int32(0)
        cute.arch.sync_threads()
        bad = Int32(0)
        if tid == 0:
            if mCu[0] != 0 or mCuc[0] != 0 or mCu[segs] > num_tokens or mCuc[segs] > total_comp:
                bad = Int32(1)
        for s in cutlass.range(tid, segs, GUARD_THREADS):
            n = Int64(mCu[s + 1]) - Int64(mCu[s])
            rows = Int64(mCuc[s + 1]) - Int64(mCuc[s])
            if n < 0:
                bad = Int32(1)
            elif rows != n // Int64(self.ratio):
                bad = Int32(1)
        if bad != 0:
            flag[0] = Int32(1)  # any writer's 1 will do
        cute.arch.sync_threads()
        poisoned = flag[0] != 0
        for i in cutlass.range(cta * GUARD_THREADS + tid, mOut.shape[0], ctas * GUARD_THREADS):
            v = cutlass.Float32(0.0)
            if i < mApe.shape[0]:
                v = mApe[i]
            if poisoned:
                v = cutlass.Float32(float("nan"))
            mOut[i] = v


def guard_compile_args() -> tuple:
    """Symbolic arguments: segments, ape's size and the output's stay symbolic (one compile
    a ratio)."""
    from .plan import _fake

    B1, n, m = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (_fake(cutlass.Int32, (B1,), 4), _fake(cutlass.Int32, (B1,), 4),
            _fake(cutlass.Float32, (n,), 4), _fake(cutlass.Float32, (m,), 4),
            Int32(1), Int32(1), Int32(1), stream)


def guarded_ape(cu, cuc, ape, num_tokens: int, total_comp: int, ratio: int, shape=None):
    """``ape`` as the pooling should read it: a copy, NaN where the offsets are malformed
    (OffsetsGuard, one launch; its torch version where the kernel cannot be had now). An
    empty ``ape`` (no position bias) gives the flag alone: zeros of ``shape``, or NaN."""
    shape = tuple(ape.shape) if shape is None else tuple(shape)
    fn = small_kernel(("offsets_guard", ratio), cu.device,
                      lambda: (OffsetsGuard(ratio), guard_compile_args()))
    if fn is None:
        from ..checks import poison_if_malformed

        src = ape if ape.numel() else torch.zeros(shape, dtype=torch.float32, device=ape.device)
        return poison_if_malformed(src, cu, cuc, num_tokens, total_comp, ratio)
    out = torch.empty(shape, dtype=torch.float32, device=ape.device)
    n = out.numel()
    # an empty ape as a view of out: a real address, which an empty tensor may not have
    src = ape.view(-1) if ape.numel() else out.view(-1)[:0]
    fn(cu, cuc, src, out.view(-1), num_tokens, total_comp,
       max(1, min(GUARD_MAX_CTAS, -(-n // (4 * GUARD_THREADS)))))
    return out
