"""Plain-PyTorch references of the gated pooling, differentiable, any device.

Four numerics modes:

- ``"upstream"``: the eager region as training runs it today (Megatron-LM's Compressor):
  fp32 softmax over the window, weights rounded to the input dtype, the product in the
  input dtype, the sum accumulated in fp32 and rounded. The benchmark times it as "eager".
- ``"fp32"``: the same region with every intermediate in fp32, written with torch's own
  ops (``torch.softmax(..., dtype=torch.float32)``, ``(v * w).sum(1)``, one final
  rounding) and differentiated by torch's autograd: what a user computes with torch.
  The fused kernels' contract is stated against this mode on the same GPU.
- ``"fp32_explicit"``: that region's CUDA arithmetic spelled out operation by operation
  (max, the softmax sums in torch's CUDA order, true division, the backward's
  ``fma(-p, S, p*dp)`` rounded exactly once, the output sum in torch's CUDA reduce
  order), so it gives the same bits on any device, the CPU included, and equals the
  fused kernels' everywhere.
- ``"fp64"``: the oracle; everything in float64 and the output left in float64.
"""

from __future__ import annotations

import torch

from .checks import poison_if_malformed
from .softmax_order import SUM_ACCUMULATORS, ordered_sum, torch_softmax_lanes, torch_sum_lanes
from .validation import check_ratio_coff, validate

MODES = ("upstream", "fp32", "fp32_explicit", "fp64")
# The mode that computes what the fused kernels compute under each of their numerics.
MODE_OF_NUMERICS = {"fp32": "fp32", "eager": "upstream"}


def row_geometry(cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, total_comp: int, ratio: int):
    """Per output row: first token ``t0``, block index ``i``, and whether it is a real row.

    Rows at or beyond ``Nv = cu_seqlens_comp[-1]`` are padding rows: a first block at token 0.
    """
    dev = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    cuc = cu_seqlens_comp.to(torch.int64)
    rows = torch.arange(total_comp, device=dev, dtype=torch.int64)
    # Last s with cuc[s] <= b (cuc[0] = 0); s == B past the true rows. (Searching the whole
    # tensor, not a slice of it: inductor cannot lower searchsorted over a slice view.)
    seg = torch.searchsorted(cuc, rows, right=True) - 1
    real = seg < cuc.numel() - 1
    seg_c = seg.clamp(max=cuc.numel() - 2)
    i = torch.where(real, rows - cuc[seg_c], torch.zeros_like(rows))
    t0 = torch.where(real, cu[seg_c] + i * ratio, torch.zeros_like(rows))
    return t0, i, real


def _windows(kv2, score2, ape, t0, i, ratio, coff, d):
    """Gather ``(N, K, d)`` value and score windows plus a slot mask (False = empty slot)."""
    T = kv2.shape[0]
    k = torch.arange(ratio, device=kv2.device, dtype=torch.int64)
    own = (t0[:, None] + k[None, :]).clamp(0, max(T - 1, 0))  # (N, ratio)
    v_own = kv2[own][:, :, (coff - 1) * d:]
    s_own = score2[own][:, :, (coff - 1) * d:]
    a_own = ape[:, (coff - 1) * d:]
    if coff == 1:
        mask = torch.ones(t0.shape[0], ratio, dtype=torch.bool, device=kv2.device)
        return v_own, s_own, a_own.unsqueeze(0).expand(t0.shape[0], -1, -1), mask
    prev = (t0[:, None] - ratio + k[None, :]).clamp(0, max(T - 1, 0))
    v = torch.cat([kv2[prev][:, :, :d], v_own], 1)
    s = torch.cat([score2[prev][:, :, :d], s_own], 1)
    a = torch.cat([ape[:, :d], a_own], 0).unsqueeze(0).expand(t0.shape[0], -1, -1)
    has_prev = (i > 0)[:, None].expand(-1, ratio)
    mask = torch.cat([has_prev, torch.ones_like(has_prev)], 1)
    return v, s, a, mask


def _window_sum(x):
    """Sum over dim 1 of ``(N, K, d)`` in torch's CUDA softmax order: serial over the slots,
    or lane j summing slots j, j + L, ... then a halving tree (L = torch_softmax_lanes)."""
    K = x.shape[1]
    return ordered_sum(lambda k: x[:, k], K, torch_softmax_lanes(K, x.shape[2]), K)


def _output_sum(x):
    """Sum over dim 1 of ``(N, K, d)`` in the order torch's CUDA reduce kernel sums it: L
    lanes (torch_sum_lanes), lane j adding its m-th slot (j + m*L) into accumulator m % 4
    and meeting the four in order, then the lanes in a halving tree."""
    N, K, d = x.shape
    return ordered_sum(lambda k: x[:, k], K, torch_sum_lanes(N, K, d), K, SUM_ACCUMULATORS)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a*b + c`` on fp32 tensors with one rounding, on any device: the product exactly
    in fp64, the sum rounded to odd in fp64 (TwoSum's error term decides), then rounded
    to fp32; rounding to odd with 29 spare bits makes the second rounding exact."""
    a64, b64, c64 = a.double(), b.double(), c.double()
    prod = a64 * b64  # 24 x 24 bits: exact in fp64
    s = prod + c64
    bb = s - prod
    err = (prod - (s - bb)) + (c64 - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even & torch.isfinite(s), torch.nextafter(s, toward), s)
    return s.float()


class _ExplicitSoftmaxPool(torch.autograd.Function):
    """fp32 pooling with every operation spelled out (mode ``"fp32_explicit"``).

    ``s``/``v`` are fp32 ``(N, K, d)``; empty slots carry ``s = -inf`` and ``v = 0``.
    """

    @staticmethod
    def forward(ctx, s, v):
        m = s.amax(dim=1)  # order-free
        e = torch.exp(s - m[:, None])
        p = e / _window_sum(e)[:, None]
        acc = _output_sum(v * p)
        ctx.save_for_backward(p, v)
        return acc

    @staticmethod
    def backward(ctx, g):
        p, v = ctx.saved_tensors
        pdp = (g[:, None] * v) * p
        S = _window_sum(pdp)
        ds = fma_f32(-p, S[:, None].expand_as(p), pdp)
        dv = g[:, None] * p
        return ds, dv


def _pool(v, s, a, mask, mode, out_dtype):
    if mode == "fp64":
        s = s.double() + a.double()
        v = v.double()
    else:
        s = s.float() + a
    # Scalars as python floats: a CPU tensor here would be a host copy, illegal in graph capture.
    s = s.masked_fill(~mask[:, :, None], float("-inf"))
    if mode == "upstream":
        p = torch.softmax(s, dim=1).to(v.dtype)
        v = v.masked_fill(~mask[:, :, None], 0.0)
        return (v * p).float().sum(1).to(out_dtype)
    v = v.to(s.dtype).masked_fill(~mask[:, :, None], 0.0)
    if mode == "fp32_explicit":
        return _ExplicitSoftmaxPool.apply(s, v).to(out_dtype)
    w = torch.softmax(s, dim=1, dtype=s.dtype)
    return (v * w).sum(dim=1).to(out_dtype)


def compress_thd(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff, mode="fp32",
                 check_offsets: bool = False):
    """Reference gated pooling over a packed THD batch; returns ``(total_comp, d)``.

    The output has the dtype of ``kv``, except in ``"fp64"`` mode (float64). Padding rows
    (``b >= cu_seqlens_comp[-1]``) are computed from token 0 and take no gradient; if
    ``T < ratio`` they are zeros. No host sync: the region can be captured in a CUDA
    graph and traced by ``torch.compile``, which is how the benchmark runs it.
    ``cu_seqlens_comp=None`` and ``check_offsets``: as for compress_thd_fused.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    prob = validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio, coff=coff,
                    check_offsets=check_offsets)
    kv2, score2, d, N = prob.kv, prob.score, prob.head_dim, total_comp
    out_dtype = torch.float64 if mode == "fp64" else kv2.dtype
    # offsets on the CPU were checked by validate; on the GPU a malformed pack gives NaN
    guard = None
    if prob.cu_seqlens.device.type != "cpu":
        def guard(t):
            return poison_if_malformed(t, prob.cu_seqlens, prob.cu_seqlens_comp, kv2.shape[0], N, ratio)
    if N == 0 or kv2.shape[0] < ratio:
        # No window fits: every row is a zero padding row (or there are no rows).
        out = kv2.new_zeros((N, d), dtype=out_dtype)
        return out if guard is None else guard(out)
    t0, i, real = row_geometry(prob.cu_seqlens, prob.cu_seqlens_comp, N, ratio)
    ape = prob.ape if prob.has_ape else kv2.new_zeros((ratio, kv2.shape[1]), dtype=torch.float32)
    v, s, a, mask = _windows(kv2, score2, ape if guard is None else guard(ape), t0, i,
                             ratio, coff, d)
    out = _pool(v, s, a, mask, mode, out_dtype)
    # Padding rows exist only for static shapes: finite values, no gradient.
    return torch.where(real[:, None], out, out.detach())


def compress_sbhd(kv, score, ape, *, ratio, coff, mode="fp32"):
    """Reference for ``(S, B, coff*d)`` inputs: every batch column is one segment of length S.

    Returns ``(S // ratio, B, d)``; ``S < ratio`` gives no rows: ``(0, B, d)`` (Megatron's
    Compressor returns None there; ``Compressor`` does too).
    """
    check_ratio_coff(ratio, coff)
    for name, t in (("kv", kv), ("score", score)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected shape (S, B, coff*d), got {tuple(getattr(t, 'shape', ()))}")
    S, B, W = kv.shape
    if score.shape != kv.shape:
        raise ValueError(f"score: expected the shape of kv {tuple(kv.shape)}, got {tuple(score.shape)}")
    if W % coff:
        raise ValueError(f"kv: last dimension must be a multiple of coff={coff}, got {W}")
    if S < ratio:
        return kv.new_zeros((0, B, W // coff), dtype=torch.float64 if mode == "fp64" else kv.dtype)
    kv_t = kv.transpose(0, 1).reshape(B * S, W)
    score_t = score.transpose(0, 1).reshape(B * S, W)
    cu = torch.arange(B + 1, device=kv.device, dtype=torch.int32) * S
    cuc = torch.arange(B + 1, device=kv.device, dtype=torch.int32) * (S // ratio)
    out = compress_thd(kv_t, score_t, ape, cu, cuc, B * (S // ratio), ratio=ratio, coff=coff, mode=mode)
    return out.view(B, S // ratio, -1).transpose(0, 1)
