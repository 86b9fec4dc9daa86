"""The epilogue's row-wise part in one kernel a direction, each op as torch runs it in the
epilogue's composition (epilogue.eager_epilogue), so the results are bitwise its own:

- forward: ``y = (x * r) * w`` (``r`` the rows' rsqrt statistics, from torch; every
  product pinned with ``mul.rn``, or the butterfly's adds would take them into FMAs), the
  rotary embedding on the last ``rope_dim`` channels (``a*cos - b*sin``, ``a*sin +
  b*cos``, products rounded on their own), the Walsh-Hadamard butterfly stage by stage
  (``y0 + y1``, ``y0 - y1``) and its scale (torch multiplies by the scalar's fp32
  reciprocal), one rounding to the rows' dtype;
- backward: the gradient's fp32 copy, the scale, the butterfly stages in reverse order,
  the rotation back; fp32 out, for the norm's backward (torch: its reductions).

With ``norm`` the kernel also does the norm's row-wise math that torch otherwise runs as
a dozen kernels: the forward its statistics ``r = rsqrt(mean(x^2) + eps)`` (written out
for the backward), the backward the norm's input gradient ``g*w*r + (-0.5 * sum(g*w*x) *
r^3 / d) * 2x`` and the products ``g * (x*r)`` whose column sums (torch) are the weight's
gradient. The row sums add in torch's reduce order (softmax_order.torch_rowsum_vec),
through shared memory: each value where torch's lane would read it.

One warp a row: lane ``l`` holds channels ``[l*E, (l+1)*E)``, ``E = head_dim / 32``; the
butterfly's stages within ``E`` run in registers, the others between lanes
(``shfl.bfly``). The rotary pairs lie in one lane (interleaved pairs, ``E`` even) or
``rope_dim / 2`` channels apart in lanes a power of two apart (halves).
"""

import math

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from ..softmax_order import ROWSUM_VEC, ROWSUM_WARP_OFFSETS, torch_rowsum_vec
from .jit import placeholder, small_kernel
from .plan import cutlass_dtype
from .ptx import div_exact, i64_to_f32, mul_rn, rsqrt_approx

WARPS_PER_CTA = 4  # rows a CTA: one a warp


def dtypes():
    """The dtypes the kernel takes the rows in, and the norm weight in, each its own
    (Megatron keeps the weight in fp32 unless Float16Module casts it)."""
    import torch

    return (torch.bfloat16, torch.float16, torch.float32)


def supported(dtype, head_dim: int, rope_dim: int, interleaved: bool, rotate: bool) -> bool:
    """Whether EpilogueRows covers this dtype and geometry (else the epilogue runs as torch
    ops)."""
    if dtype not in dtypes() or head_dim % 32 \
            or head_dim < 32:
        return False
    E = head_dim // 32
    if rotate and head_dim & (head_dim - 1):
        return False
    if rope_dim == 0:
        return True
    if (head_dim - rope_dim) % E:
        return False
    if interleaved:
        return E % 2 == 0
    half_lanes = (rope_dim // 2) // E
    return (rope_dim // 2) % E == 0 and half_lanes & (half_lanes - 1) == 0 \
        and (head_dim - rope_dim) % (2 * half_lanes * E) == 0


def cos_sin_vec(head_dim: int, interleaved: bool) -> int:
    """cos / sin values a lane reads (at least 1: the tables' shape where none is read, as
    at head_dim 32 without rotary channels)."""
    E = head_dim // 32
    return max(1, E // 2 if interleaved else E)


class EpilogueRows:
    def __init__(self, dtype, head_dim: int, rope_dim: int, interleaved: bool, rotate: bool,
                 backward: bool, norm: bool = False, eps: float = 1e-6):
        import torch

        torch_of = {cutlass.BFloat16: torch.bfloat16, cutlass.Float32: torch.float32,
                    cutlass.Float16: torch.float16}
        assert supported(torch_of[dtype], head_dim, rope_dim, interleaved, rotate)
        self.dtype, self.d, self.R = dtype, head_dim, rope_dim
        self.interleaved, self.rotate, self.backward = interleaved, rotate, backward
        self.E = head_dim // 32
        # torch's ``y / sqrt(d)`` on CUDA: times the fp32 reciprocal of the fp32 divisor
        self.scale = float(np.float32(1.0) / np.float32(math.sqrt(head_dim)))
        self.rope_lane0 = (head_dim - rope_dim) // self.E  # first lane holding rope channels
        self.cs_vec = cos_sin_vec(head_dim, interleaved)
        self.stages = head_dim.bit_length() - 1  # butterfly stages: log2(head_dim)
        self.norm = norm
        self.eps = float(np.float32(eps))  # torch adds the Python float as fp32
        self.inv_d = float(np.float32(1.0) / np.float32(head_dim))  # torch's ``/ d``
        self.sum_vec = torch_rowsum_vec(head_dim)
        self.smem_bytes = WARPS_PER_CTA * head_dim * 4 if norm else 0

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor,
                 mCos: cute.Tensor, mSin: cute.Tensor, mOut: cute.Tensor, mAux: cute.Tensor,
                 stream):
        """``mIn`` the rows (forward) or the output's gradient (backward); ``mX`` the
        pooled rows (the norm's backward); ``mR`` the statistics (written by the norm's
        forward, else read); ``mOut`` the output, or the gradient (fp32; the norm's
        backward: the rows' dtype); ``mAux`` ``g * (x*r)`` (the norm's backward)."""
        E = self.E
        rows = mIn.shape[0]
        grid = (rows + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(cute.zipped_divide(mIn, (1, E)), cute.zipped_divide(mX, (1, E)), mR,
                    cute.zipped_divide(mW, (E,)),
                    cute.zipped_divide(mCos, (1, self.cs_vec)),
                    cute.zipped_divide(mSin, (1, self.cs_vec)),
                    cute.zipped_divide(mOut, (1, E)), cute.zipped_divide(mAux, (1, E)),
                    rows).launch(grid=[grid, 1, 1], block=[32, WARPS_PER_CTA, 1],
                                 smem=self.smem_bytes, stream=stream, use_pdl=True)

    @cute.jit
    def row_sum(self, sRow: cute.Tensor, warp, lane):
        """The sum of the warp's row in shared memory, in torch's reduce order, on every
        lane."""
        d = self.d
        acc = cute.make_rmem_tensor((ROWSUM_VEC,), Float32)
        for i in cutlass.range_constexpr(ROWSUM_VEC):
            acc[i] = Float32(0.0)
        if cutlass.const_expr(self.sum_vec == 1):
            for j in cutlass.range_constexpr(d // 32):
                acc[j % ROWSUM_VEC] = acc[j % ROWSUM_VEC] + sRow[warp, lane + 32 * j]
        else:
            V = self.sum_vec
            nvec = d // V
            for k in cutlass.range_constexpr((nvec + 31) // 32):
                if cutlass.const_expr(32 * (k + 1) <= nvec):
                    for i in cutlass.range_constexpr(V):
                        acc[i] = acc[i] + sRow[warp, V * (lane + 32 * k) + i]
                else:
                    if lane + 32 * k < nvec:
                        for i in cutlass.range_constexpr(V):
                            acc[i] = acc[i] + sRow[warp, V * (lane + 32 * k) + i]
        total = acc[0]
        for i in cutlass.range_constexpr(1, ROWSUM_VEC):
            total = total + acc[i]
        for off in cutlass.range_constexpr(len(ROWSUM_WARP_OFFSETS)):
            total = total + cute.arch.shuffle_sync_down(total, offset=ROWSUM_WARP_OFFSETS[off])
        return cute.arch.shuffle_sync(total, 0)

    @cute.jit
    def stage(self, v, h: int, lane):
        """One butterfly stage over pairs ``h`` channels apart: the lower channel takes
        ``y0 + y1``, the upper ``y0 - y1``."""
        E = self.E
        if cutlass.const_expr(h < E):
            for e in cutlass.range_constexpr(E):
                if cutlass.const_expr((e // h) % 2 == 0):
                    y0, y1 = v[e], v[e + h]
                    v[e] = y0 + y1
                    v[e + h] = y0 - y1
        else:
            step = h // E  # lanes apart
            upper = (lane // step) % 2 == 1
            for e in cutlass.range_constexpr(E):
                other = cute.arch.shuffle_sync_bfly(v[e], offset=step)
                mine = v[e]
                if upper:
                    v[e] = other - mine
                else:
                    v[e] = mine + other

    @cute.jit
    def angles(self, gCos, gSin, row, lane):
        """The lane's cosines and sines of row ``row``. Every lane loads (a lane before the
        rope channels the first rope lane's, unused), so the loads join the row's others in
        one basic block instead of waiting behind the rope lanes' branch."""
        j = cutlass.max(lane - self.rope_lane0, Int32(0))
        if cutlass.const_expr(not self.interleaved):
            j = j % (self.R // 2 // self.E)
        return gCos[(None, (row, j))].load(), gSin[(None, (row, j))].load()

    @cute.jit
    def rope(self, v, c, s, lane, sign: int):
        """The rotation of the lane's rope channels by the row's angles (``c``, ``s`` from
        angles; ``sign`` -1: back, by the negated sines, as the epilogue's backward
        multiplies). Every lane takes part in the halves' shuffles; the lanes before the
        rope channels then keep their values."""
        E = self.E
        j = lane - self.rope_lane0
        if cutlass.const_expr(self.interleaved):
            if j >= 0:
                for k in cutlass.range_constexpr(E // 2):
                    a, b = v[2 * k], v[2 * k + 1]
                    sk = s[k] if sign > 0 else -s[k]
                    v[2 * k] = mul_rn(a, c[k]) - mul_rn(b, sk)
                    v[2 * k + 1] = mul_rn(a, sk) + mul_rn(b, c[k])
        else:
            half = self.R // 2 // E  # lanes between a pair's channels
            other = cute.make_rmem_tensor((E,), Float32)
            for k in cutlass.range_constexpr(E):
                other[k] = cute.arch.shuffle_sync_bfly(v[k], offset=half)
            if j >= 0:
                upper = (j // half) % 2 == 1
                for k in cutlass.range_constexpr(E):
                    # operands taken before the branch: both sides use them
                    ck, sk, ok, vk = c[k], (s[k] if sign > 0 else -s[k]), other[k], v[k]
                    if upper:  # b' = a*sin + b*cos, a the partner's
                        v[k] = mul_rn(ok, sk) + mul_rn(vk, ck)
                    else:  # a' = a*cos - b*sin
                        v[k] = mul_rn(vk, ck) - mul_rn(ok, sk)

    @cute.kernel
    def kernel(self, gIn: cute.Tensor, gX: cute.Tensor, mR: cute.Tensor, gW: cute.Tensor,
               gCos: cute.Tensor, gSin: cute.Tensor, gOut: cute.Tensor, gAux: cute.Tensor,
               rows: Int32):
        lane, warp, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        row = bx * WARPS_PER_CTA + warp
        sRow = None
        if cutlass.const_expr(self.norm):
            smem = cutlass.memory.SmemAllocator()
            sRow = smem.allocate_tensor(Float32, cute.make_layout((WARPS_PER_CTA, self.d),
                                                                  stride=(self.d, 1)), 16)
        # A programmatic dependent: its launch overlaps the pooling forward's (or the
        # gradient's producer's) tail; nothing is read or written before that has completed.
        cute.arch.griddepcontrol_wait()
        if row < rows:  # uniform over the warp: its shuffles see every lane
            v = self.load_row(gIn, row, lane)
            if cutlass.const_expr(not self.backward):
                self.forward_row(v, sRow, mR, gW, gCos, gSin, row, rows, warp, lane)
            else:
                self.backward_row(v, gX, mR, gW, gCos, gSin, gAux, sRow, row, warp, lane)
            gOut[(None, (row, lane))].store(v.load().to(gOut.element_type))

    @cute.jit
    def load_row(self, g: cute.Tensor, row, lane):
        """The lane's ``E`` values of row ``row`` of ``g`` (``(1, E)`` tiles), in fp32
        registers."""
        v = cute.make_rmem_tensor((self.E,), Float32)
        x = g[(None, (row, lane))].load().to(Float32)
        for e in cutlass.range_constexpr(self.E):
            v[e] = x[e]
        return v

    @cute.jit
    def forward_row(self, v, sRow, mR, gW, gCos, gSin, row, rows, warp, lane):
        """The forward of the warp's row ``row`` (of ``rows``) on its fp32 values ``v``
        (``E`` a lane), in place; with ``norm`` its statistics to ``mR`` (``sRow[warp]``
        the row sum's scratch), else read from it. Also the pooling kernels' epilogue
        (pool_epilogue), which is why it is a method of its own."""
        E = self.E
        # The row's operands first, beside its values' load: one wait a row.
        w = gW[(None, lane)].load()
        c = s = None
        if cutlass.const_expr(self.R > 0):
            c, s = self.angles(gCos, gSin, row, lane)
        r = Float32(0.0)
        if cutlass.const_expr(self.norm):
            # torch: x.pow(2) -> mean(-1) (the sum times fl(N) / fl(N*d)) -> + eps -> rsqrt
            for e in cutlass.range_constexpr(E):
                sRow[warp, lane * E + e] = mul_rn(v[e], v[e])
            cute.arch.sync_warp()
            n = cutlass.Int64(rows)
            factor = div_exact(i64_to_f32(n), i64_to_f32(n * self.d))
            r = rsqrt_approx(mul_rn(self.row_sum(sRow, warp, lane), factor)
                             + Float32(self.eps))
            if lane == 0:
                mR[row, 0] = r
        else:
            r = mR[row, 0]
        w = w.to(Float32)
        for e in cutlass.range_constexpr(E):
            # pinned: the butterfly's adds must not absorb them into FMAs
            v[e] = mul_rn(mul_rn(v[e], r), w[e])
        if cutlass.const_expr(self.R > 0):
            self.rope(v, c, s, lane, 1)
        if cutlass.const_expr(self.rotate):
            for st in cutlass.range_constexpr(self.stages):
                self.stage(v, 1 << st, lane)
            for e in cutlass.range_constexpr(E):
                v[e] = mul_rn(v[e], Float32(self.scale))

    @cute.jit
    def backward_row(self, v, gX, mR, gW, gCos, gSin, gAux, sRow, row, warp, lane, aux=True):
        """The backward of the warp's row ``row``: ``v`` the output's gradient in, the
        rows' gradient out (with ``norm``; else the gradient before the norm). ``aux``:
        whether this lane stores its weight products."""
        E = self.E
        # The row's operands first, beside the gradient's load: one wait a row.
        x = r = w = c = s = None
        if cutlass.const_expr(self.norm):
            x = gX[(None, (row, lane))].load()
            r = mR[row, 0]
            w = gW[(None, lane)].load()
        if cutlass.const_expr(self.R > 0):
            c, s = self.angles(gCos, gSin, row, lane)
        if cutlass.const_expr(self.rotate):
            for e in cutlass.range_constexpr(E):
                v[e] = mul_rn(v[e], Float32(self.scale))
            for st in cutlass.range_constexpr(self.stages):
                self.stage(v, 1 << (self.stages - 1 - st), lane)
        if cutlass.const_expr(self.R > 0):
            self.rope(v, c, s, lane, -1)
        if cutlass.const_expr(self.norm):
            self.norm_backward(v, x, r, w, gAux, sRow, row, warp, lane, aux)

    @cute.jit
    def norm_backward(self, v, x, r, w, gAux, sRow, row, warp, lane, aux=True):
        """``v``: the gradient of ``y = (x*r) * w`` in, the rows' gradient out, each op as
        autograd runs the composition's (``x``, ``w`` the lane's pooled values and weights
        as loaded, ``r`` the row's statistic): ``g_xr = gy*w``, the weight's ``gy * (x*r)``
        (to gAux), ``g_r = sum(g_xr * x)``, ``g_mean = (-0.5 * g_r) * ((r*r)*r)``, then
        ``g_xr*r + (g_mean * fl(1/d)) * (2x)``."""
        E = self.E
        xv = x.to(Float32)
        w = w.to(Float32)
        p = cute.make_rmem_tensor((E,), Float32)
        for e in cutlass.range_constexpr(E):
            gy = v[e]
            v[e] = mul_rn(gy, w[e])  # g_xr
            p[e] = mul_rn(gy, mul_rn(xv[e], r))
            sRow[warp, lane * E + e] = mul_rn(v[e], xv[e])
        if aux:
            gAux[(None, (row, lane))].store(p.load())
        cute.arch.sync_warp()
        g_r = self.row_sum(sRow, warp, lane)
        g_mean = mul_rn(mul_rn(g_r, Float32(-0.5)), mul_rn(mul_rn(r, r), r))
        g_md = mul_rn(g_mean, Float32(self.inv_d))
        for e in cutlass.range_constexpr(E):
            v[e] = mul_rn(v[e], r) + mul_rn(g_md, xv[e] + xv[e])


def compile_args(dtype, head_dim: int, rope_dim: int, interleaved: bool, backward: bool,
                 norm: bool = False, weight_dtype=None) -> tuple:
    """Symbolic arguments: the row counts stay symbolic (one compile a geometry). ``mX``
    and ``mAux`` have rows of their own: a one-row placeholder where the mode reads
    neither. The norm weight is in ``weight_dtype`` (default the rows'), widened to fp32
    on load as the composition's ``weight.float()``."""
    import cutlass.cute as cute

    from .plan import _fake, cutlass_dtype

    cdt = cutlass_dtype(dtype)
    wdt = cdt if weight_dtype is None else cutlass_dtype(weight_dtype)
    N, M, K, A = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    cs = cos_sin_vec(head_dim, interleaved)
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    rows_out = cutlass.Float32 if backward and not norm else cdt
    return (_fake(cdt, (N, head_dim), 16), _fake(cdt, (K, head_dim), 16),
            _fake(cutlass.Float32, (N, 1), 4),
            _fake(wdt, (head_dim,), 16), _fake(cutlass.Float32, (M, max(rope_dim // 2, cs)), 16),
            _fake(cutlass.Float32, (M, max(rope_dim // 2, cs)), 16),
            _fake(rows_out, (N, head_dim), 16), _fake(cutlass.Float32, (A, head_dim), 16),
            stream)


def run(backward: bool, rows, r, weight, cos, sin, out, rope_dim: int, interleaved: bool,
        rotate: bool, norm_eps: float | None = None, x=None, aux=None):
    """One launch on the current stream (compiled on first use of the geometry; None,
    nothing launched, where it is not compiled and a CUDA graph is capturing): rows
    ``(N, d)`` contiguous (the pooled rows, or the output's gradient), their statistics
    ``r`` ``(N, 1)`` fp32, the norm weight ``(d,)`` (dtypes()), fp32 ``cos`` / ``sin``
    ``(N, rope_dim / 2)`` (``None`` where rope_dim is 0), into ``out``.
    ``norm_eps`` given: the norm's own math too (``r`` written by the forward; the
    backward reads the pooled rows ``x`` and writes ``aux``, fp32 ``(N, d)``), at least
    ROWSUM_MIN_ROWS rows."""
    import torch

    d = rows.shape[1]
    norm = norm_eps is not None
    eps = 1e-6 if norm_eps is None else norm_eps
    dtype, wdtype = rows.dtype, weight.dtype

    def build():
        return (EpilogueRows(cutlass_dtype(dtype), d, rope_dim, interleaved, rotate, backward,
                             norm, eps),
                compile_args(dtype, d, rope_dim, interleaved, backward, norm, wdtype))

    fn = small_kernel(("epilogue_rows", dtype, wdtype, d, rope_dim, interleaved, rotate, backward,
                       norm, eps), rows.device, build)
    if fn is None:
        return None

    if cos is None:
        cs = cos_sin_vec(d, interleaved)
        cos = sin = placeholder((1, cs), torch.float32, rows.device)
    if x is None:
        x = placeholder((1, d), rows.dtype, rows.device)
    if aux is None:
        aux = placeholder((1, d), torch.float32, rows.device)
    fn(rows, x, r, weight, cos, sin, out, aux)
    return out
