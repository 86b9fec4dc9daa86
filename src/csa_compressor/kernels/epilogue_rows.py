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

from .ptx import mul_rn

WARPS_PER_CTA = 4  # rows a CTA: one a warp


def supported(dtype, head_dim: int, rope_dim: int, interleaved: bool, rotate: bool) -> bool:
    """Whether EpilogueRows covers this dtype and geometry (else the epilogue runs as torch
    ops)."""
    import torch

    if dtype not in (torch.bfloat16, torch.float16, torch.float32) or head_dim % 32 \
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


class EpilogueRows:
    def __init__(self, dtype, head_dim: int, rope_dim: int, interleaved: bool, rotate: bool,
                 backward: bool):
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
        self.cs_vec = self.E // 2 if interleaved else self.E  # cos / sin values a lane
        self.stages = head_dim.bit_length() - 1  # butterfly stages: log2(head_dim)

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mCos: cute.Tensor,
                 mSin: cute.Tensor, mOut: cute.Tensor, stream):
        E = self.E
        rows = mIn.shape[0]
        grid = (rows + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(cute.zipped_divide(mIn, (1, E)), mR, cute.zipped_divide(mW, (E,)),
                    cute.zipped_divide(mCos, (1, self.cs_vec)),
                    cute.zipped_divide(mSin, (1, self.cs_vec)),
                    cute.zipped_divide(mOut, (1, E)), rows).launch(
            grid=[grid, 1, 1], block=[32, WARPS_PER_CTA, 1], stream=stream)

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
    def rope(self, v, gCos, gSin, row, lane, sign: int):
        """The rotation of the lane's rope channels by the row's angles (``sign`` -1:
        back, by the negated sines, as the epilogue's backward multiplies). Every lane
        takes part in the halves' shuffles; the lanes before the rope channels then keep
        their values."""
        E = self.E
        j = lane - self.rope_lane0
        if cutlass.const_expr(self.interleaved):
            if j >= 0:
                c = gCos[(None, (row, j))].load()
                s = gSin[(None, (row, j))].load()
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
                c = gCos[(None, (row, j % half))].load()
                s = gSin[(None, (row, j % half))].load()
                upper = (j // half) % 2 == 1
                for k in cutlass.range_constexpr(E):
                    # operands taken before the branch: both sides use them
                    ck, sk, ok, vk = c[k], (s[k] if sign > 0 else -s[k]), other[k], v[k]
                    if upper:  # b' = a*sin + b*cos, a the partner's
                        v[k] = mul_rn(ok, sk) + mul_rn(vk, ck)
                    else:  # a' = a*cos - b*sin
                        v[k] = mul_rn(vk, ck) - mul_rn(ok, sk)

    @cute.kernel
    def kernel(self, gIn: cute.Tensor, mR: cute.Tensor, gW: cute.Tensor, gCos: cute.Tensor,
               gSin: cute.Tensor, gOut: cute.Tensor, rows: Int32):
        lane, warp, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        row = bx * WARPS_PER_CTA + warp
        E = self.E
        if row < rows:  # uniform over the warp: its shuffles see every lane
            v = cute.make_rmem_tensor((E,), Float32)
            x = gIn[(None, (row, lane))].load().to(Float32)
            for e in cutlass.range_constexpr(E):
                v[e] = x[e]
            if cutlass.const_expr(not self.backward):
                r = mR[row, 0]
                w = gW[(None, lane)].load().to(Float32)
                for e in cutlass.range_constexpr(E):
                    # pinned: the butterfly's adds must not absorb them into FMAs
                    v[e] = mul_rn(mul_rn(v[e], r), w[e])
                if cutlass.const_expr(self.R > 0):
                    self.rope(v, gCos, gSin, row, lane, 1)
                if cutlass.const_expr(self.rotate):
                    for st in cutlass.range_constexpr(self.stages):
                        self.stage(v, 1 << st, lane)
                    for e in cutlass.range_constexpr(E):
                        v[e] = mul_rn(v[e], Float32(self.scale))
            else:
                if cutlass.const_expr(self.rotate):
                    for e in cutlass.range_constexpr(E):
                        v[e] = mul_rn(v[e], Float32(self.scale))
                    for st in cutlass.range_constexpr(self.stages):
                        self.stage(v, 1 << (self.stages - 1 - st), lane)
                if cutlass.const_expr(self.R > 0):
                    self.rope(v, gCos, gSin, row, lane, -1)
            gOut[(None, (row, lane))].store(v.load().to(gOut.element_type))


def compile_args(dtype, head_dim: int, rope_dim: int, interleaved: bool, backward: bool) -> tuple:
    """Symbolic arguments: the row counts stay symbolic (one compile a geometry)."""
    import cutlass.cute as cute

    from .plan import _fake, cutlass_dtype

    cdt = cutlass_dtype(dtype)
    N, M = cute.sym_int32(), cute.sym_int32()
    cs = (head_dim // 32) // 2 if interleaved else head_dim // 32
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    rows_out = cutlass.Float32 if backward else cdt
    return (_fake(cdt, (N, head_dim), 16), _fake(cutlass.Float32, (N, 1), 4),
            _fake(cdt, (head_dim,), 16), _fake(cutlass.Float32, (M, max(rope_dim // 2, cs)), 16),
            _fake(cutlass.Float32, (M, max(rope_dim // 2, cs)), 16),
            _fake(rows_out, (N, head_dim), 16), stream)


_COMPILED: dict = {}
_PLACEHOLDER: dict = {}


def run(backward: bool, rows, r, weight, cos, sin, out, rope_dim: int, interleaved: bool,
        rotate: bool):
    """One launch on the current stream (compiled on first use of the geometry): rows
    ``(N, d)`` contiguous (the pooled rows, or the output's gradient), their statistics
    ``r`` ``(N, 1)`` fp32 and the norm weight ``(d,)`` (read by the forward), fp32 ``cos``
    / ``sin`` ``(N, rope_dim / 2)`` (``None`` where rope_dim is 0), into ``out``."""
    import torch

    from .compile import _compile, _direct
    from .plan import cutlass_dtype

    d = rows.shape[1]
    key = (rows.dtype, d, rope_dim, interleaved, rotate, backward, rows.device.index)
    fn = _COMPILED.get(key)
    if fn is None:
        kernel = EpilogueRows(cutlass_dtype(rows.dtype), d, rope_dim, interleaved, rotate,
                              backward)
        owner = _compile(kernel, *compile_args(rows.dtype, d, rope_dim, interleaved, backward))
        fn = _COMPILED[key] = (_direct(owner), owner)
    if cos is None:  # never read: one small placeholder a device
        cs = (d // 32) // 2 if interleaved else d // 32
        cos = sin = _PLACEHOLDER.get((cs, rows.device))
        if cos is None:
            cos = sin = _PLACEHOLDER[(cs, rows.device)] = torch.zeros(
                (1, cs), dtype=torch.float32, device=rows.device)
    fn[0](rows, r, weight, cos, sin, out)
    return out
