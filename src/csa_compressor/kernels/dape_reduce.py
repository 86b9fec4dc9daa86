"""Fixed-order sum of the backward's per-CTA dape partials: (P, C) fp32 -> (1, C) fp32.

``torch.sum`` over dim 0 of the partials ran one thread per column, each walking all P
rows one dependent load after another, in a handful of CTAs: longer than the backward
kernel itself at small shapes (docs/lab/ceilings.md). Here a CTA owns ``col_lanes`` column vectors and ``row_lanes`` row lanes:
lane y sums rows y, y + row_lanes, ... (independent loads, unrolled, so many are in
flight), then row lane 0 adds the lanes' sums in lane order from shared memory. The order
depends only on P, C and the tuning, so the result is bitwise
reproducible (tests/test_dape_reduce_gpu.py replays it with torch on the CPU).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .tuning import Tuning, current


class DapeReduce:
    """``wide``: few partial rows of many columns (ratio 128 at d=512: 16 x 65,536), where
    most of the default layout's 64 row lanes would have nothing to add; launch.dape_sum
    picks it (REDUCE_WIDE_*)."""

    def __init__(self, cols: int, wide: bool = False, tuning: Tuning | None = None):
        self.t = t = tuning or current()
        self.cols = cols
        self.vec = t.dape_vector(cols)
        self.cpr = cols // self.vec
        col_lanes, self.row_lanes = t.REDUCE_COL_LANES, t.REDUCE_ROW_LANES
        if wide:
            col_lanes, self.row_lanes = t.REDUCE_WIDE_COL_LANES, t.REDUCE_WIDE_ROW_LANES
        self.col_lanes = min(col_lanes, self.cpr)
        self.smem_bytes = self.row_lanes * self.col_lanes * self.vec * 4
        # Programmatic dependent launch: the backward lets this grid be scheduled early
        # (griddepcontrol.launch_dependents), and this kernel waits for the backward's end
        # and memory flush (griddepcontrol.wait) before it reads the partials, so its launch
        # latency overlaps the backward's tail. Launched on its own (the tests) it simply
        # waits for nothing.

    @cute.jit
    def __call__(self, mWork: cute.Tensor, mOut: cute.Tensor, stream):
        tiler = (1, self.vec)
        grid_x = (self.cpr + self.col_lanes - 1) // self.col_lanes
        self.kernel(cute.zipped_divide(mWork, tiler), cute.zipped_divide(mOut, tiler),
                    mWork.shape[0]).launch(grid=[grid_x, 1, 1],
                                           block=[self.col_lanes, self.row_lanes, 1],
                                           smem=self.smem_bytes, stream=stream,
                                           use_pdl=True,
                                           preferred_smem_carveout=None)

    @cute.kernel
    def kernel(self, gW: cute.Tensor, gO: cute.Tensor, rows: Int32):
        tid, ty, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        vec = self.vec
        chunk = bx * self.col_lanes + tid
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(
            Float32, cute.make_layout((vec, self.col_lanes, self.row_lanes)), 16)
        acc = cute.make_rmem_tensor((vec,), Float32)
        for e in cutlass.range_constexpr(vec):
            acc[e] = Float32(0.0)
        cute.arch.griddepcontrol_wait()  # the partials are the backward's output
        if chunk < self.cpr:
            for r in cutlass.range(ty, rows, self.row_lanes, unroll=self.t.REDUCE_UNROLL):
                v = gW[(None, (r, chunk))].load()
                for e in cutlass.range_constexpr(vec):
                    acc[e] = acc[e] + v[e]
        for e in cutlass.range_constexpr(vec):
            red[e, tid, ty] = acc[e]
        cute.arch.barrier()
        if (ty == 0) & (chunk < self.cpr):
            for y in cutlass.range_constexpr(1, self.row_lanes):
                for e in cutlass.range_constexpr(vec):
                    acc[e] = acc[e] + red[e, tid, y]
            gO[(None, (0, chunk))].store(acc.load())
