"""The Compressor's epilogue after the pooling: RMSNorm over head_dim (fp32, eps, a weight),
rotary embedding on the last ``rope_dim`` channels at each row's position, optional
orthonormal Walsh-Hadamard rotation, then one rounding to the pooled rows' dtype.

``apply_epilogue`` runs it as one autograd node whose backward is written out (the ops
autograd would run, without the fp32 intermediates it keeps or the zero-filled gradients
of every slice it adds up): bitwise the composition of torch ops, ``eager_epilogue``,
forward and backward; on the GPU one kernel a direction (kernels.epilogue_rows), after
the pooling kernels, not inside them. The positions come from the layout: ``rope_positions``
(THD: ``block_index * ratio``), ``grouped_positions`` (``max(id, 0) * ratio``),
``sbhd_positions``. ``megatron_epilogue`` rounds where Megatron-LM's Compressor rounds
instead (torch ops, the module's ``numerics="megatron"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .softmax_order import ROWSUM_MIN_ROWS
from .validation import kernel_aligned


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two), in fp32."""
    return (walsh_hadamard(x) / math.sqrt(x.shape[-1])).view(x.shape)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform over the last dim, in fp32 (rows x dim)."""
    d = x.shape[-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2).view(-1, d)
        h *= 2
    return y


@dataclass(frozen=True)
class YaRN:
    """YaRN frequency scaling of the rotary embedding (as Megatron-LM's
    YarnRotaryEmbedding builds it; the rotation itself stays unit-magnitude, mscale 1):
    frequencies below the correction range are interpolated by ``factor``, those above kept,
    a linear ramp between."""

    factor: float
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    round_to_int: bool = True


def rope_inv_freq(rope_dim: int, theta: float, yarn: YaRN | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The rotary frequencies of the ``rope_dim // 2`` channel pairs (float64), made on
    ``device`` (no host copy: the module's step stays capturable in a CUDA graph)."""
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device) / rope_dim
    extra = theta ** (-exponent)
    if yarn is None:
        return extra
    keep = _yarn_keep(rope_dim, theta, yarn, torch.float64, device)
    return extra / yarn.factor * (1 - keep) + extra * keep


def _yarn_keep(rope_dim: int, theta: float, yarn: YaRN, dtype, device) -> torch.Tensor:
    """Per channel pair, 1 where YaRN keeps the original frequency, 0 where it interpolates,
    a linear ramp between (computed in ``dtype``, the ramp's arithmetic as Megatron's)."""

    def correction_dim(rotations):
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=dtype, device=device) - low)
            / (high - low)).clamp(0, 1)
    return 1.0 - ramp


def apply_rope(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float, interleaved: bool,
               yarn: YaRN | None = None):
    """Rotary embedding on the last ``rope_dim`` channels of ``x`` (rows x channels, fp32)
    at integer positions ``pos`` (one per row)."""
    if rope_dim == 0:
        return x
    cos, sin = _torch_cos_sin(pos, rope_inv_freq(rope_dim, theta, yarn, device=x.device))
    return _rotate(x, cos, sin, rope_dim, interleaved, 1)


def rope_positions(cu_seqlens_comp: torch.Tensor, total_comp: int, ratio: int,
                   max_seqlen: int | None = None) -> torch.Tensor:
    """RoPE position of each output row: ``block_index * ratio`` inside its segment. Rows
    past the true count (capacity padding) continue the last segment, held to the last
    entry of the ``max_seqlen // ratio``-row table where ``max_seqlen`` is given: where
    Megatron-LM's THD rotary embedding puts them. No host sync."""
    cap = None if max_seqlen is None else max(max_seqlen // ratio - 1, 0)
    if _small_kernels(cu_seqlens_comp) and cu_seqlens_comp.dtype == torch.int32 \
            and cu_seqlens_comp.dim() == 1 and cu_seqlens_comp.is_contiguous():
        from .kernels import rope_angles

        pos = rope_angles.positions(cu_seqlens_comp, total_comp, ratio, cap)
        if pos is not None:
            return pos
    return _torch_rope_positions(cu_seqlens_comp, total_comp, ratio, cap)


def _small_kernels(t: torch.Tensor) -> bool:
    from .dispatch import small_kernels_usable

    return small_kernels_usable(t)


def _torch_rope_positions(cu_seqlens_comp, total_comp, ratio, cap):
    cuc = cu_seqlens_comp.to(torch.int64)
    rows = torch.arange(total_comp, device=cuc.device, dtype=torch.int64)
    # The whole offsets tensor, not a slice of it: inductor cannot lower searchsorted over
    # a slice view. Rows past the last offset clamp into the last segment.
    seg = (torch.searchsorted(cuc, rows, right=True) - 1).clamp(0, max(cuc.numel() - 2, 0))
    block = rows - cuc[seg]
    if cap is not None:
        block = block.clamp_max(cap)
    return block * ratio


def grouped_positions(group_ids: torch.Tensor, ratio: int) -> torch.Tensor:
    """RoPE position of each grouped row: ``max(group_id, 0) * ratio`` (Megatron-LM's
    pre-grouped Compressor)."""
    return group_ids.to(torch.int64).clamp_min(0) * ratio


def sbhd_positions(n: int, batch: int, ratio: int, device=None) -> torch.Tensor:
    """RoPE positions of ``(n, batch)`` SBHD rows flattened row-major: ``row * ratio``."""
    return (torch.arange(n, device=device, dtype=torch.int64) * ratio).repeat_interleave(batch)


@dataclass(frozen=True)
class Epilogue:
    """What follows the pooling: RMSNorm (``eps``), rotary embedding on the last
    ``rope_dim`` channels (0: none; interleaved pairs or the two halves; frequencies from
    ``rope_theta``, YaRN-scaled where ``rope_yarn``), a Hadamard rotation where
    ``rotate`` (head_dim a power of two)."""

    eps: float = 1e-6
    rope_dim: int = 64
    rope_theta: float = 160000.0
    rope_interleaved: bool = True
    rope_yarn: YaRN | None = None
    rotate: bool = False

    def check(self, head_dim: int) -> None:
        for name, value in (("rope_theta", self.rope_theta), ("eps", self.eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
        r = self.rope_dim
        if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r % 2 or r > head_dim:
            raise ValueError(f"rope_dim: expected an even int in [0, head_dim={head_dim}], got {r!r}")
        if self.rope_yarn is not None and not isinstance(self.rope_yarn, YaRN):
            raise TypeError(f"rope_yarn: expected a csa_compressor.epilogue.YaRN, got {self.rope_yarn!r}")
        if self.rotate and head_dim & (head_dim - 1):
            raise ValueError(f"head_dim: rotate=True needs a power of two, got {head_dim}")


def rope_cos_sin(positions: torch.Tensor, ep: Epilogue, inv_freq: torch.Tensor | None = None,
                 rope_table=None):
    """fp32 ``(N, rope_dim // 2)`` cosines and sines of the rows' angles (fp64 angles, as
    apply_rope makes them), or the rows ``positions`` of a caller's ``rope_table``."""
    if rope_table is not None:
        idx = positions.to(torch.int64)
        return rope_table[0].index_select(0, idx), rope_table[1].index_select(0, idx)
    if inv_freq is None:
        inv_freq = rope_inv_freq(ep.rope_dim, ep.rope_theta, ep.rope_yarn, device=positions.device)
    return _cos_sin(positions, inv_freq)


def _cos_sin(positions, inv_freq):
    if (_small_kernels(positions) and positions.dtype == torch.int64 and positions.dim() == 1
            and positions.is_contiguous() and inv_freq.dtype == torch.float64
            and inv_freq.is_contiguous() and inv_freq.device == positions.device):
        from .kernels import rope_angles

        cs = rope_angles.cos_sin(positions, inv_freq)
        if cs is not None:
            return cs
        ang = rope_angles.angles(positions, inv_freq)
        if ang is not None:
            return torch.cos(ang), torch.sin(ang)
    return _torch_cos_sin(positions, inv_freq)


def _torch_cos_sin(positions, inv_freq):
    ang = (positions.to(torch.float64)[:, None] * inv_freq[None, :]).to(torch.float32)
    return torch.cos(ang), torch.sin(ang)


def _rotate(y, cos, sin, rope_dim, interleaved, sign):
    """``y`` (... x channels) with its last ``rope_dim`` channels rotated by the angles
    (``sign`` -1: back), in ``y``'s dtype."""
    rot = y[..., -rope_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., : rope_dim // 2], rot[..., rope_dim // 2:]
    s = sin if sign > 0 else -sin
    ra, rb = a * cos - b * s, a * s + b * cos
    out = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)
    return torch.cat((y[..., :-rope_dim], out), dim=-1)


def _butterfly_back(g: torch.Tensor) -> torch.Tensor:
    """The gradient of hadamard(): what autograd computes through its stages (the
    division's backward first, then the stages in reverse order, each its own transpose)."""
    d = g.shape[-1]
    y = (g / math.sqrt(d)).reshape(-1, d)
    h = d // 2
    while h >= 1:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2).view(-1, d)
        h //= 2
    return y.view(g.shape)


def _rows_kernel(x_in, weight, ep) -> bool:
    """Whether the row-wise ops run as kernels.epilogue_rows (one launch a direction, the
    same ops): rows and weight each in a dtype it reads (the weight's widened to fp32 as
    the composition's ``weight.float()``), a geometry it covers, where the small kernels
    run (dispatch.small_kernels_usable)."""
    if not (x_in.is_cuda and x_in.dim() == 2):
        return False
    from .kernels.epilogue_rows import dtypes, supported

    return (weight.dtype in dtypes()
            and supported(x_in.dtype, x_in.shape[1], ep.rope_dim, ep.rope_interleaved, ep.rotate)
            and _small_kernels(x_in))


# (device, dtype, head_dim, Epilogue) -> whether the kernel's statistics were torch's
_ROWSUM_AGREES: dict = {}


def _norm_in_kernel(x_in, weight, ep) -> bool:
    """Whether the row kernel also computes the norm's statistics and backward: rows enough
    that torch's reduce gives a row one warp, and the kernel's order found to be this
    torch's. Checked once a geometry on a probe of 64 random rows (the same compiled
    kernel against torch's ops, bit for bit): another torch version may reduce in another
    order, and then the statistics stay torch's. While a CUDA graph captures, an
    unchecked geometry takes torch's statistics."""
    d = x_in.shape[1]
    if x_in.shape[0] < ROWSUM_MIN_ROWS:
        return False
    from .kernels.compile import checked_once

    def check():
        from .kernels import epilogue_rows

        probe = _probe_rows(64, d, x_in.device).to(x_in.dtype)
        r = torch.empty((64, 1), dtype=torch.float32, device=x_in.device)
        cs = None
        if ep.rope_dim:
            cs = torch.zeros((64, ep.rope_dim // 2), dtype=torch.float32, device=x_in.device)
        epilogue_rows.run(False, probe, r, torch.ones_like(weight), cs, cs,
                          torch.empty_like(probe), ep.rope_dim, ep.rope_interleaved, ep.rotate,
                          norm_eps=ep.eps)
        return torch.equal(r, _rsqrt_stat(probe.float(), ep.eps))

    return checked_once(_ROWSUM_AGREES, (x_in.device, x_in.dtype, d, ep), check)


def _probe_rows(n: int, d: int, device) -> torch.Tensor:
    """``(n, d)`` fp32 rows for a kernel's once-a-geometry check against torch: random
    values, each row scaled differently (seeded: the same probe every run)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(n, d, device=device, generator=gen)
            * (10 * torch.rand(n, 1, device=device, generator=gen)))


# (device, head_dim, lanes, ctas) -> whether kernels.column_sum's sums were torch's
_COLSUM_AGREES: dict = {}


def _column_sum(prod):
    """``prod.sum(0)`` of the row kernel's fp32 products (the norm weight's gradient):
    kernels.column_sum in torch's order (softmax_order.torch_colsum_order) where that
    order was found torch's for this geometry, once, on a probe of the same shape (another
    torch or GPU may reduce otherwise), else torch's own sum. While a CUDA graph captures,
    an unchecked geometry takes torch's."""
    from .kernels import column_sum
    from .kernels.compile import checked_once
    from .kernels.hardware import sm_count, threads_per_sm
    from .softmax_order import torch_colsum_order

    N, d = prod.shape
    if N * d >= 2 ** 31:  # the kernels index in 32 bits
        return prod.sum(0)
    dev = prod.device
    lanes, ctas = torch_colsum_order(N, d, sm_count(dev.index), threads_per_sm(dev.index))

    def check():
        probe = _probe_rows(N, d, dev)
        got = column_sum.column_sum(probe, lanes, ctas)
        return None if got is None else torch.equal(got, probe.sum(0))

    if checked_once(_COLSUM_AGREES, (dev, d, lanes, ctas), check):
        out = column_sum.column_sum(prod, lanes, ctas)
        if out is not None:
            return out
    return prod.sum(0)


def _forward(x_in, weight, positions, inv_freq, ep, rope_table=None):
    """The node's forward: ``(out, r, cos, sin)`` (``cos``/``sin`` None without RoPE)."""
    cos = sin = None
    if ep.rope_dim:
        cos, sin = rope_cos_sin(positions, ep, inv_freq, rope_table)
    if _rows_kernel(x_in, weight, ep):
        from .kernels import epilogue_rows

        xc, wc = kernel_aligned(x_in), kernel_aligned(weight)
        norm = _norm_in_kernel(xc, wc, ep)
        if norm:
            r = torch.empty((xc.shape[0], 1), dtype=torch.float32, device=xc.device)
        else:
            r = _rsqrt_stat(xc.float(), ep.eps)
        out = epilogue_rows.run(False, xc, r, wc, cos, sin, torch.empty_like(xc),
                                ep.rope_dim, ep.rope_interleaved, ep.rotate,
                                norm_eps=ep.eps if norm else None)
        if out is not None:
            return out, r, cos, sin
    # the composition's torch ops (also where the kernel is not compiled while a CUDA
    # graph captures: the same bits)
    x = x_in.float()
    r = _rsqrt_stat(x, ep.eps)
    y = x * r * weight.float()
    if ep.rope_dim:
        y = _rotate(y, cos, sin, ep.rope_dim, ep.rope_interleaved, 1)
    if ep.rotate:
        y = hadamard(y)
    return y.to(x_in.dtype), r, cos, sin


def _backward(g, x_in, weight, cos, sin, r, ep):
    """The node's backward: the gradients of the rows and of the norm weight."""
    gy = None
    if _rows_kernel(x_in, weight, ep) and g.dtype == x_in.dtype:
        from .kernels import epilogue_rows

        xc, wc, gc = kernel_aligned(x_in), kernel_aligned(weight), kernel_aligned(g)
        if _norm_in_kernel(xc, wc, ep):
            gx = torch.empty_like(xc)
            prod = torch.empty(xc.shape, dtype=torch.float32, device=g.device)
            if epilogue_rows.run(True, gc, r, wc, cos, sin, gx, ep.rope_dim, ep.rope_interleaved,
                                 ep.rotate, norm_eps=ep.eps, x=xc, aux=prod) is not None:
                return gx, _column_sum(prod).to(weight.dtype)
        else:
            gy = epilogue_rows.run(True, gc, r, wc, cos, sin,
                                   torch.empty(g.shape, dtype=torch.float32, device=g.device),
                                   ep.rope_dim, ep.rope_interleaved, ep.rotate)
    if gy is None:  # the torch ops (as in the forward: also for a kernel not compiled yet)
        gy = g.float()
        if ep.rotate:
            gy = _butterfly_back(gy)
        if ep.rope_dim:
            gy = _rotate(gy, cos, sin, ep.rope_dim, ep.rope_interleaved, -1)
    x = x_in.float()
    xr = x * r
    # y = (x * r) * w, r = rsqrt(mean(x^2) + eps), as autograd differentiates them
    g_xr = gy * weight.float()
    gw = (gy * xr).sum(0)
    g_r = (g_xr * x).sum(-1, keepdim=True)
    g_mean = (-0.5 * g_r) * r.pow(3)
    gx = g_xr * r + (g_mean.expand_as(x) / x.shape[-1]) * (2 * x)
    return gx.to(x_in.dtype), gw.to(weight.dtype)


# Under torch.compile the node's two directions are custom ops (opaque: the compiled
# graph runs the same kernels, or on the CPU the same torch ops, bit for bit the eager
# node); eager calls bypass the op dispatch, as ops.py's do. The Epilogue travels as
# scalars: eps, rope_dim, rope_theta, interleaved, YaRN's fields (empty: none), rotate.

def _ep_args(ep: Epilogue) -> tuple:
    y = ep.rope_yarn
    yarn = [] if y is None else [float(y.factor), float(y.original_max_position_embeddings),
                                 float(y.beta_fast), float(y.beta_slow), float(y.round_to_int)]
    return float(ep.eps), int(ep.rope_dim), float(ep.rope_theta), bool(ep.rope_interleaved), \
        yarn, bool(ep.rotate)


def _ep_of(eps, rope_dim, rope_theta, interleaved, yarn, rotate) -> Epilogue:
    y = None if not yarn else YaRN(yarn[0], int(yarn[1]), yarn[2], yarn[3], bool(yarn[4]))
    return Epilogue(eps, rope_dim, rope_theta, interleaved, y, rotate)


@torch.library.custom_op("csa_compressor::epilogue_fwd", mutates_args=())
def epilogue_fwd_op(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor | None, cos_table: torch.Tensor | None,
                    sin_table: torch.Tensor | None, eps: float, rope_dim: int, rope_theta: float,
                    interleaved: bool, yarn: list[float], rotate: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ep = _ep_of(eps, rope_dim, rope_theta, interleaved, yarn, rotate)
    table = None if cos_table is None else (cos_table, sin_table)
    out, r, cos, sin = _forward(x, weight, positions, inv_freq, ep, table)
    if cos is None:  # an op returns tensors: empty ones where there is no rotary table
        cos, sin = (x.new_empty((0, 0), dtype=torch.float32) for _ in range(2))
    return out, r, cos, sin


@epilogue_fwd_op.register_fake
def _(x, weight, positions, inv_freq, cos_table, sin_table, eps, rope_dim, rope_theta, interleaved,
      yarn, rotate):
    n = x.shape[0] if rope_dim else 0
    cs = x.new_empty((n, rope_dim // 2), dtype=torch.float32)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((x.shape[0], 1), dtype=torch.float32), cs, torch.empty_like(cs))


@torch.library.custom_op("csa_compressor::epilogue_bwd", mutates_args=())
def epilogue_bwd_op(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, r: torch.Tensor, eps: float, rope_dim: int,
                    rope_theta: float, interleaved: bool, yarn: list[float], rotate: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    ep = _ep_of(eps, rope_dim, rope_theta, interleaved, yarn, rotate)
    if not rope_dim:
        cos = sin = None
    return _backward(g, x, weight, cos, sin, r, ep)


@epilogue_bwd_op.register_fake
def _(g, x, weight, cos, sin, r, eps, rope_dim, rope_theta, interleaved, yarn, rotate):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format))


class _EpilogueFn(torch.autograd.Function):
    """eager_epilogue as one node: its forward's ops, and as backward the ops autograd
    runs through them (bitwise the same gradients), without the intermediates autograd
    keeps (fp32 copies of the rows at every step) or the zero-filled slice gradients it
    adds up. On the GPU the row-wise ops (the norm's statistics and scaling, the rotary
    embedding, the rotation, the norm's backward) run as one kernel a direction, op for
    op the same, their row sums in torch's order; the weight's gradient is torch's column
    sum of the kernel's products."""

    @staticmethod
    def forward(ctx, x_in, weight, positions, inv_freq, ep, cos_table, sin_table):
        if torch.compiler.is_compiling():
            out, r, cos, sin = epilogue_fwd_op(x_in, weight, positions, inv_freq, cos_table,
                                               sin_table, *_ep_args(ep))
        else:
            table = None if cos_table is None else (cos_table, sin_table)
            out, r, cos, sin = _forward(x_in, weight, positions, inv_freq, ep, table)
        ctx.save_for_backward(x_in, weight, cos, sin, r)
        ctx.ep = ep
        return out

    @staticmethod
    def backward(ctx, g):
        x_in, weight, cos, sin, r = ctx.saved_tensors
        if torch.compiler.is_compiling():
            gx, gw = epilogue_bwd_op(g, x_in, weight, cos, sin, r, *_ep_args(ctx.ep))
        else:
            gx, gw = _backward(g, x_in, weight, cos, sin, r, ctx.ep)
        return gx, gw, None, None, None, None, None


def _rsqrt_stat(x, eps):
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def apply_epilogue(pooled: torch.Tensor, norm_weight: torch.Tensor, positions: torch.Tensor,
                   ep: Epilogue, inv_freq: torch.Tensor | None = None,
                   rope_table: tuple | None = None) -> torch.Tensor:
    """The epilogue of ``pooled`` ``(N, head_dim)`` rows at ``positions`` ``(N,)``, as one
    autograd node (differentiable in ``pooled`` and ``norm_weight``): fp32 math, the
    pooled dtype out. ``inv_freq``: the rotary frequencies, where the caller keeps them.
    ``rope_table``: the caller's ``(cos, sin)``, fp32 ``(P, rope_dim // 2)`` each, row
    ``p`` the angles of position ``p`` (``ep``'s theta and YaRN are then not used;
    positions must lie in ``[0, P)``)."""
    if not isinstance(ep, Epilogue):
        raise TypeError(f"ep: expected a csa_compressor.Epilogue, got {type(ep).__name__}")
    for name, t in (("pooled", pooled), ("norm_weight", norm_weight), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if pooled.dim() != 2:
        raise ValueError(f"pooled: expected (N, head_dim) rows, got {tuple(pooled.shape)}")
    if not pooled.is_floating_point() or not norm_weight.is_floating_point():
        raise TypeError(f"pooled, norm_weight: expected floating-point tensors, got "
                        f"{pooled.dtype}, {norm_weight.dtype}")
    if positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions: expected integer positions, got {positions.dtype}")
    if norm_weight.device != pooled.device or positions.device != pooled.device:
        raise ValueError(f"pooled, norm_weight, positions: expected one device, got "
                         f"{pooled.device}, {norm_weight.device}, {positions.device}")
    ep.check(pooled.shape[1])
    if tuple(norm_weight.shape) != (pooled.shape[1],):
        raise ValueError(f"norm_weight: expected shape ({pooled.shape[1]},), got {tuple(norm_weight.shape)}")
    if tuple(positions.shape) != (pooled.shape[0],):
        raise ValueError(f"positions: expected shape ({pooled.shape[0]},), got {tuple(positions.shape)}")
    cos_table = sin_table = None
    if rope_table is not None:
        cos_table, sin_table = check_rope_table(rope_table, ep.rope_dim, pooled.device)
    return _EpilogueFn.apply(pooled, norm_weight, positions, inv_freq, ep, cos_table, sin_table)


def check_rope_table(rope_table, rope_dim: int, device):
    """``(cos, sin)`` of a caller's rotary table, checked: fp32 ``(P, rope_dim // 2)`` each,
    ``P >= 1``, on ``device``. Positions outside ``[0, P)`` are an indexing error (on the
    GPU torch's device-side bounds assert), never a read past the table."""
    if not isinstance(rope_table, (tuple, list)) or len(rope_table) != 2:
        raise TypeError(f"rope_table: expected a (cos, sin) pair of tensors, got {type(rope_table).__name__}")
    cos, sin = rope_table
    for name, t in (("rope_table[0] (cos)", cos), ("rope_table[1] (sin)", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected torch.float32, got {t.dtype}")
        if t.dim() != 2 or t.shape[0] < 1 or t.shape[1] != rope_dim // 2:
            raise ValueError(f"{name}: expected shape (P >= 1, rope_dim // 2 = {rope_dim // 2}), "
                             f"got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name}: expected the pooled rows' device {device}, got {t.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"rope_table: cos and sin must have one shape, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    return cos, sin


def eager_epilogue(pooled, norm_weight, positions, ep: Epilogue, rope_table=None) -> torch.Tensor:
    """The epilogue as a composition of torch ops (autograd records each): the reference."""
    x = pooled.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ep.eps) * norm_weight.float()
    if rope_table is not None and ep.rope_dim:
        cos, sin = rope_cos_sin(positions, ep, rope_table=rope_table)
        x = _rotate(x, cos, sin, ep.rope_dim, ep.rope_interleaved, 1)
    else:
        x = apply_rope(x, positions, ep.rope_dim, ep.rope_theta, ep.rope_interleaved, ep.rope_yarn)
    if ep.rotate:
        x = hadamard(x)
    return x.to(pooled.dtype)


def megatron_inv_freq(rope_dim: int, theta: float, yarn: YaRN | None = None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """The rotary frequencies as Megatron-LM's RotaryEmbedding / YarnRotaryEmbedding make
    them: fp32 throughout (``1 / theta ** (2i / rope_dim)``; YaRN's two tables and its fp32
    ramp), on ``device``."""
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim
    extra = 1.0 / (theta ** exponent)
    if yarn is None:
        return extra
    inter = 1.0 / (yarn.factor * theta ** exponent)
    keep = _yarn_keep(rope_dim, theta, yarn, torch.float32, device)
    return inter * (1 - keep) + extra * keep


def megatron_epilogue(pooled, norm_weight, positions, ep: Epilogue, inv_freq=None) -> torch.Tensor:
    """The epilogue rounded where Megatron-LM's Compressor rounds it (its unfused path):
    torch's rms_norm as Megatron's torch norm calls it (fp32 inside, the rows' dtype
    out), the rotary angles in fp32 (megatron_inv_freq, ``position * inv_freq``), their
    cosines and sines rounded to the dtype, each product and sum of the rotation rounded
    to it, the Hadamard rotation unnormalised in fp32 times ``head_dim ** -0.5``, one
    rounding. A composition of torch ops (autograd records each, so the gradients round
    where Megatron's do too)."""
    dt = pooled.dtype
    # the op Megatron's WrappedTorchNorm calls: torch picks the same kernel for the same dtypes
    y = torch.nn.functional.rms_norm(pooled, (pooled.shape[-1],), norm_weight, ep.eps)
    if ep.rope_dim:
        if inv_freq is None:
            inv_freq = megatron_inv_freq(ep.rope_dim, ep.rope_theta, ep.rope_yarn, pooled.device)
        ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        # in the dtype: each product and sum rounds, as Megatron's `t * cos + rot(t) * sin`
        y = _rotate(y, torch.cos(ang).to(dt), torch.sin(ang).to(dt), ep.rope_dim,
                    ep.rope_interleaved, 1)
    if ep.rotate:  # as Megatron calls it: hadamard_transform(y, scale=head_dim ** -0.5)
        y = (walsh_hadamard(y) * y.shape[-1] ** -0.5).view(y.shape).to(dt)
    return y
