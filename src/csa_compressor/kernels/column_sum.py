"""``x.sum(0)`` of a contiguous fp32 ``(N, d)`` tensor in the order torch's CUDA reduce adds
it (softmax_order.torch_colsum_order): the norm weight's gradient from the epilogue's
products, bit for bit torch's.

Torch's one kernel ends with a semaphore and a last CTA that walks the other CTAs' partial
sums one dependent load after another; here the same additions run in two launches: the
lanes' sums and their tree a CTA (the result itself where there is one CTA along the
rows), then the CTAs' partials, all loads in flight, and the same tree. Columns are
independent, so a CTA takes as many as suits it; which rows a lane adds, into which
accumulator, and how lanes and CTAs meet are torch's.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..softmax_order import COLSUM_VEC, SUM_ACCUMULATORS
from .jit import small_kernel

COLUMN_VECTORS = 32  # column vectors a CTA: one warp across, lanes of the order down


class ColumnSum:
    """``finish=False``: the sums of ``lanes`` row lanes of the CTA (grid y: its index
    along the rows, of ``ctas``) over ``mX`` ``(N, d)``, met in the tree, into row c of
    ``mOut`` ``(ctas, d)``. ``finish=True``: lane y adds rows y, y + lanes, ... of ``mX``
    (the partials) to zero, then the tree, into ``mOut`` ``(1, d)``."""

    def __init__(self, head_dim: int, lanes: int, finish: bool):
        self.d, self.lanes, self.finish = head_dim, lanes, finish
        self.cpr = head_dim // COLSUM_VEC
        self.width = min(COLUMN_VECTORS, self.cpr)
        self.levels = lanes.bit_length() - 1  # lanes: a power of two
        self.smem_bytes = COLSUM_VEC * self.width * lanes * 4

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, ctas: Int32, stream):
        tiler = (1, COLSUM_VEC)
        grid_x = (self.cpr + self.width - 1) // self.width
        grid_y = ctas
        if cutlass.const_expr(self.finish):
            grid_y = 1
        self.kernel(cute.zipped_divide(mX, tiler), cute.zipped_divide(mOut, tiler),
                    mX.shape[0], ctas).launch(grid=[grid_x, grid_y, 1],
                                              block=[self.width, self.lanes, 1],
                                              smem=self.smem_bytes, stream=stream,
                                              use_pdl=True)

    @cute.kernel
    def kernel(self, gX: cute.Tensor, gO: cute.Tensor, rows: Int32, ctas: Int32):
        tx, ty, _ = cute.arch.thread_idx()
        bx, c, _ = cute.arch.block_idx()
        chunk = bx * self.width + tx
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((COLSUM_VEC, self.width, self.lanes)), 16)
        v = cute.make_rmem_tensor((COLSUM_VEC,), Float32)
        for e in cutlass.range_constexpr(COLSUM_VEC):
            v[e] = Float32(0.0)
        # Both launches are programmatic dependents: each starts while its predecessor (the
        # epilogue's backward, then the first launch) drains, and reads nothing before that
        # predecessor has completed and flushed. The first lets the second be scheduled at
        # once (the second has a few CTAs, and they only wait).
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(not self.finish):
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.finish):
            if chunk < self.cpr:
                for p in cutlass.range(ty, rows, self.lanes, unroll=4):
                    w = gX[(None, (p, chunk))].load()
                    for e in cutlass.range_constexpr(COLSUM_VEC):
                        v[e] = v[e] + w[e]
        else:
            acc = cute.make_rmem_tensor((SUM_ACCUMULATORS, COLSUM_VEC), Float32)
            for a in cutlass.range_constexpr(SUM_ACCUMULATORS):
                for e in cutlass.range_constexpr(COLSUM_VEC):
                    acc[a, e] = Float32(0.0)
            if chunk < self.cpr:
                step = self.lanes * ctas
                first = ty + self.lanes * c
                n = Int32(0)
                if first < rows:
                    n = (rows - first + step - 1) // step
                groups = n // SUM_ACCUMULATORS
                for j in cutlass.range(groups):
                    base = first + j * (SUM_ACCUMULATORS * step)
                    for a in cutlass.range_constexpr(SUM_ACCUMULATORS):
                        w = gX[(None, (base + a * step, chunk))].load()
                        for e in cutlass.range_constexpr(COLSUM_VEC):
                            acc[a, e] = acc[a, e] + w[e]
                base = first + groups * (SUM_ACCUMULATORS * step)
                for a in cutlass.range_constexpr(SUM_ACCUMULATORS - 1):
                    if groups * SUM_ACCUMULATORS + a < n:
                        w = gX[(None, (base + a * step, chunk))].load()
                        for e in cutlass.range_constexpr(COLSUM_VEC):
                            acc[a, e] = acc[a, e] + w[e]
            for e in cutlass.range_constexpr(COLSUM_VEC):
                v[e] = acc[0, e]
            for a in cutlass.range_constexpr(1, SUM_ACCUMULATORS):
                for e in cutlass.range_constexpr(COLSUM_VEC):
                    v[e] = v[e] + acc[a, e]
        # the lanes' halving tree: lane y < off takes lane y + off
        for e in cutlass.range_constexpr(COLSUM_VEC):
            red[e, tx, ty] = v[e]
        for k in cutlass.range_constexpr(self.levels):
            off = self.lanes >> (k + 1)
            cute.arch.barrier()
            if ty < off:
                for e in cutlass.range_constexpr(COLSUM_VEC):
                    v[e] = v[e] + red[e, tx, ty + off]
                    red[e, tx, ty] = v[e]
        row = c
        if cutlass.const_expr(self.finish):
            row = 0
        if (ty == 0) & (chunk < self.cpr):
            gO[(None, (row, chunk))].store(v.load())


def compile_args(head_dim: int) -> tuple:
    """Symbolic arguments: the row and partial counts stay symbolic (one compile a
    head_dim and lane count)."""
    from .plan import _fake

    N, M = cute.sym_int32(), cute.sym_int32()
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (_fake(Float32, (N, head_dim), 16), _fake(Float32, (M, head_dim), 16), Int32(1),
            stream)


def _get(head_dim: int, lanes: int, finish: bool, device):
    return small_kernel(("column_sum", head_dim, lanes, finish), device,
                        lambda: (ColumnSum(head_dim, lanes, finish), compile_args(head_dim)))


def column_sum(x, lanes: int, ctas: int):
    """``(d,)`` fp32: the column sum of ``x`` (contiguous fp32 ``(N, d)`` on a GPU, d a
    multiple of COLSUM_VEC, N >= 1) in the order ``(lanes, ctas)``; None where a kernel
    cannot be had now (jit.small_kernel: not compiled while a graph captures)."""
    import torch

    d = x.shape[1]
    first = _get(d, lanes, False, x.device)
    last = _get(d, lanes, True, x.device) if ctas > 1 else None
    if first is None or (ctas > 1 and last is None):
        return None
    out = torch.empty((1, d), dtype=torch.float32, device=x.device)
    if ctas == 1:
        first(x, out, 1)
    else:
        parts = torch.empty((ctas, d), dtype=torch.float32, device=x.device)
        first(x, parts, ctas)
        last(parts, out, ctas)
    return out.view(d)
