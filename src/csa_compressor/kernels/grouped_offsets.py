"""The grouped (context-parallel) layout's THD offsets in one launch, where the torch ops of
grouped.grouped_offsets take about fourteen small kernels on the GPU. A segment starts at
group 0 and at every group whose id is 0; ``cu[s]`` is segment ``s``'s first group times
``ratio`` and ``cuc[s]`` that group's index; every entry past the last segment is
``G * ratio`` in ``cu`` and ``G`` in ``cuc``. The same integers as the torch ops for any
ids, and offsets well formed by construction (every group is ``ratio`` tokens).

One CTA: thread ``t`` counts the starts in a contiguous run of groups, the CTA scans the
counts in shared memory (offsets.RunScan, as the compressed offsets do), then each
thread writes its run's starts and the threads together fill the entries past the last
segment.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .jit import small_kernel
from .offsets import THREADS, RunScan


class GroupedOffsets(RunScan):
    def __init__(self, ratio: int):
        self.ratio = ratio

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mCu: cute.Tensor, mCuc: cute.Tensor, stream):
        self.kernel(mIds, mCu, mCuc).launch(grid=[1, 1, 1], block=[THREADS, 1, 1],
                                            smem=THREADS * 4, stream=stream)

    @cute.jit
    def starts(self, mIds: cute.Tensor, g: Int32) -> Int32:
        """1 where group ``g`` starts a segment (row 0 always does), else 0."""
        s = Int32(0)
        if g == 0 or mIds[g] == 0:
            s = Int32(1)
        return s

    item = starts  # RunScan's

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mCu: cute.Tensor, mCuc: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        G = mIds.shape[0]
        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(Int32, cute.make_layout((THREADS,)), 16)
        # seg: the segments that start before this thread's run
        lo, hi, seg = self.scanned_run(mIds, sums, tid, G)
        for g in cutlass.range(lo, hi):
            s = self.starts(mIds, g)
            if s != 0:
                mCu[seg] = g * self.ratio
                mCuc[seg] = g
            seg = seg + s
        for k in cutlass.range(sums[THREADS - 1] + tid, G + 1, THREADS):
            mCu[k] = G * self.ratio
            mCuc[k] = G


def compile_args(ids_dtype) -> tuple:
    """Symbolic arguments: the group count stays symbolic (one compile a ratio and id
    dtype)."""
    from .plan import _fake

    G, G1 = cute.sym_int32(), cute.sym_int32()
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    width = 8 if ids_dtype is cutlass.Int64 else 4
    return (_fake(ids_dtype, (G,), width), _fake(Int32, (G1,), 4), _fake(Int32, (G1,), 4),
            stream)


def grouped_offsets(ids, ratio: int):
    """``(cu, cuc)`` int32 ``(G+1,)`` of the contiguous int32 or int64 group ids ``ids``
    ``(G,)`` on a GPU, or None where the kernel cannot be had now (jit.small_kernel)."""
    import torch

    wide = ids.dtype == torch.int64
    fn = small_kernel(("grouped_offsets", ratio, "int64" if wide else "int32"), ids.device,
                      lambda: (GroupedOffsets(ratio),
                               compile_args(cutlass.Int64 if wide else Int32)))
    if fn is None:
        return None
    out = torch.empty((2, ids.numel() + 1), dtype=torch.int32, device=ids.device)
    fn(ids, out[0], out[1])
    return out[0], out[1]
