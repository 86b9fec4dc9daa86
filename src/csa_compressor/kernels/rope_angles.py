"""The rotary embedding's inputs on the device, one launch each where torch ops take a
dozen small kernels a step (epilogue.rope_positions, epilogue.rope_cos_sin):

- ``RopePositions``: THD row positions ``min(row - cuc[seg], cap) * ratio``, ``seg`` the
  row's segment (the last segment starting at or before the row, clamped to the last
  segment: capacity padding rows continue it), the same integers torch's searchsorted
  composition gives;
- ``RopeAngles``: the fp32 angles ``fl32(fl64(position) * inv_freq)``, one IEEE product
  and one rounding each, bitwise torch's ``positions.double()[:, None] * inv_freq``
  then ``.float()``; or, in the same launch, their cosines and sines, bitwise torch's
  cos and sin kernels where a once-a-device check finds them so.

One thread a row (positions) or an angle; no shared memory.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, Int64

from ..rotary import torch_cos_sin
from .jit import checked_once, placeholder, small_kernel
from .segments import find_segment

THREADS = 256


class RopePositions:
    @cute.jit
    def __call__(self, mCuc: cute.Tensor, mPos: cute.Tensor, cap: Int64, ratio: Int32, stream):
        n = mPos.shape[0]
        self.kernel(mCuc, mPos, cap, ratio, n).launch(
            grid=[(n + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mCuc: cute.Tensor, mPos: cute.Tensor, cap: Int64, ratio: Int32, n: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        row = bx * THREADS + tid
        if row < n:
            segs = mCuc.shape[0] - 1
            # in [0, max(segs - 1, 0)] whatever the offsets hold: the load stays in bounds
            seg = cutlass.min(find_segment(mCuc, row, segs), cutlass.max(segs - 1, Int32(0)))
            block = Int64(row) - Int64(mCuc[seg])
            mPos[row] = cutlass.min(block, cap) * Int64(ratio)


class RopeAngles:
    """``trig``: the cosines and sines of the fp32 angles instead (the precise, non-fast-math
    ``cosf`` / ``sinf``, as torch's cos and sin kernels compute them: the caller checks
    that once a device, rope_angles.cos_sin)."""

    def __init__(self, pairs: int, trig: bool = False):
        self.pairs, self.trig = pairs, trig

    @cute.jit
    def __call__(self, mPos: cute.Tensor, mInv: cute.Tensor, mAng: cute.Tensor,
                 mSin: cute.Tensor, stream):
        total = mPos.shape[0] * self.pairs
        self.kernel(mPos, mInv, mAng, mSin, total).launch(
            grid=[(total + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPos: cute.Tensor, mInv: cute.Tensor, mAng: cute.Tensor,
               mSin: cute.Tensor, total: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        i = bx * THREADS + tid
        if i < total:
            row = i // self.pairs
            j = i - row * self.pairs
            ang = (Float64(mPos[row]) * mInv[j]).to(Float32)
            if cutlass.const_expr(self.trig):
                mAng[row, j] = cute.math.cos(ang)
                mSin[row, j] = cute.math.sin(ang)
            else:
                mAng[row, j] = ang


def compile_args(kind: str, pairs: int = 0) -> tuple:
    """Symbolic arguments: row and segment counts stay symbolic (one compile, or one a
    rotary width). ``kind``: "positions", "angles" or "trig" (cosines and sines)."""
    from .plan import _fake

    N, B1 = cute.sym_int32(), cute.sym_int32()
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if kind == "positions":
        return (_fake(cutlass.Int32, (B1,), 4), _fake(cutlass.Int64, (N,), 8), Int64(0),
                Int32(1), stream)
    sin = _fake(cutlass.Float32, (N, pairs), 4) if kind == "trig" else _fake(cutlass.Float32, (1, pairs), 4)
    return (_fake(cutlass.Int64, (N,), 8), _fake(cutlass.Float64, (pairs,), 8),
            _fake(cutlass.Float32, (N, pairs), 4), sin, stream)


NO_CAP = (1 << 62)  # positions uncapped: larger than any block index


def _get(kind: str, pairs: int, device):
    def build():
        if kind == "positions":
            return RopePositions(), compile_args(kind)
        return RopeAngles(pairs, kind == "trig"), compile_args(kind, pairs)

    return small_kernel(("rope", kind, pairs), device, build)


def positions(cuc, total: int, ratio: int, cap: int | None):
    """``(total,)`` int64 positions of the THD rows over the int32 row offsets ``cuc``, or
    None where the kernel cannot be had now (jit.small_kernel)."""
    import torch

    fn = _get("positions", 0, cuc.device)
    if fn is None:
        return None
    out = torch.empty(total, dtype=torch.int64, device=cuc.device)
    if total:
        fn(cuc, out, NO_CAP if cap is None else cap, ratio)
    return out


def angles(pos, inv_freq):
    """``(N, pairs)`` fp32 angles of int64 ``pos`` ``(N,)`` and fp64 ``inv_freq``, or None
    where the kernel cannot be had now."""
    return _launch("angles", pos, inv_freq)


def _launch(kind, pos, inv_freq):
    import torch

    pairs = inv_freq.shape[0]
    fn = _get(kind, pairs, pos.device)
    if fn is None:
        return None
    out = torch.empty((pos.shape[0], pairs), dtype=torch.float32, device=pos.device)
    # the angles kernel never writes its sine output
    sin = torch.empty_like(out) if kind == "trig" else placeholder((1, pairs), torch.float32, pos.device)
    if out.numel():
        fn(pos, inv_freq, out, sin)
    return (out, sin) if kind == "trig" else out


# device -> whether the kernel's cosf / sinf are torch's, bit for bit
_TRIG_AGREES: dict = {}


def cos_sin(pos, inv_freq):
    """``(cos, sin)`` ``(N, pairs)`` fp32 of the angles in one launch, bitwise torch's
    ``torch.cos`` / ``torch.sin`` of them; None where the kernel cannot be had now or its
    cosf / sinf were found to differ from this torch's on this device (checked once a
    device, on the caller's frequencies at positions over the range they reach, against
    the torch composition: another CUDA math library may round otherwise)."""
    import torch

    def check():
        probe = torch.cat((torch.arange(0, 1 << 20, 97, device=pos.device),
                           torch.arange(1 << 40, (1 << 40) + 4096, device=pos.device),
                           torch.tensor([0, 1, (1 << 53) - 1, -7], device=pos.device)))
        got = _launch("trig", probe, inv_freq)
        if got is None:
            return None
        want = torch_cos_sin(probe, inv_freq)
        return torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    return _launch("trig", pos, inv_freq) if checked_once(_TRIG_AGREES, pos.device, check) else None
