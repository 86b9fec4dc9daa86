"""The epilogue as one autograd node (``apply_epilogue``): its backward written out (the ops
autograd would run, without the fp32 intermediates it keeps or the zero-filled gradients of
every slice it adds up), bitwise ``eager_epilogue`` forward and backward; on the GPU one
kernel a direction (kernels.epilogue_rows) where it gives torch's bits, else the torch ops.
Under torch.compile each direction is a custom op."""

from __future__ import annotations

import torch

from .checks import check_tensor, kernel_aligned
from .epilogue import (Epilogue, YaRN, hadamard_backward, rotate, check_rope_table, hadamard,
                       rope_cos_sin)
from .runtime import small_kernels_usable
from .softmax_order import ROWSUM_MIN_ROWS


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
            and small_kernels_usable(x_in))


# (device, dtype, head_dim, Epilogue) -> whether the kernel's statistics were torch's
_ROWSUM_AGREES: dict = {}


def norm_in_kernel(x_in, weight, ep) -> bool:
    """Whether the row kernel also computes the norm's statistics and backward: rows enough
    that torch's reduce gives a row one warp, and the kernel's order found to be this
    torch's. Checked once a geometry on a probe of 64 random rows (the same compiled
    kernel against torch's ops, bit for bit): another torch version may reduce in another
    order, and then the statistics stay torch's. While a CUDA graph captures, an
    unchecked geometry takes torch's statistics."""
    d = x_in.shape[1]
    if x_in.shape[0] < ROWSUM_MIN_ROWS:
        return False
    from .kernels.jit import checked_once

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


def column_sum(prod):
    """``prod.sum(0)`` of the row kernel's fp32 products (the norm weight's gradient):
    kernels.column_sum in torch's order (softmax_order.torch_colsum_order) where that
    order was found torch's for this geometry, once, on a probe of the same shape (another
    torch or GPU may reduce otherwise), else torch's own sum. While a CUDA graph captures,
    an unchecked geometry takes torch's."""
    from .kernels import column_sum
    from .kernels.jit import checked_once
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


def forward_rows(x_in, weight, positions, inv_freq, ep, rope_table=None):
    """The node's forward: ``(out, r, cos, sin)`` (``cos``/``sin`` None without RoPE)."""
    cos = sin = None
    if ep.rope_dim:
        cos, sin = rope_cos_sin(positions, ep, inv_freq, rope_table)
    if _rows_kernel(x_in, weight, ep):
        from .kernels import epilogue_rows

        xc, wc = kernel_aligned(x_in), kernel_aligned(weight)
        norm = norm_in_kernel(xc, wc, ep)
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
        y = rotate(y, cos, sin, ep.rope_dim, ep.rope_interleaved, 1)
    if ep.rotate:
        y = hadamard(y)
    return y.to(x_in.dtype), r, cos, sin


def backward_rows(g, x_in, weight, cos, sin, r, ep):
    """The node's backward: the gradients of the rows and of the norm weight."""
    gy = None
    if _rows_kernel(x_in, weight, ep) and g.dtype == x_in.dtype:
        from .kernels import epilogue_rows

        xc, wc, gc = kernel_aligned(x_in), kernel_aligned(weight), kernel_aligned(g)
        if norm_in_kernel(xc, wc, ep):
            gx = torch.empty_like(xc)
            prod = torch.empty(xc.shape, dtype=torch.float32, device=g.device)
            if epilogue_rows.run(True, gc, r, wc, cos, sin, gx, ep.rope_dim, ep.rope_interleaved,
                                 ep.rotate, norm_eps=ep.eps, x=xc, aux=prod) is not None:
                return gx, column_sum(prod).to(weight.dtype)
        else:
            gy = epilogue_rows.run(True, gc, r, wc, cos, sin,
                                   torch.empty(g.shape, dtype=torch.float32, device=g.device),
                                   ep.rope_dim, ep.rope_interleaved, ep.rotate)
    if gy is None:  # the torch ops (as in the forward: also for a kernel not compiled yet)
        gy = g.float()
        if ep.rotate:
            gy = hadamard_backward(gy)
        if ep.rope_dim:
            gy = rotate(gy, cos, sin, ep.rope_dim, ep.rope_interleaved, -1)
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

def ep_args(ep: Epilogue) -> tuple:
    y = ep.rope_yarn
    yarn = [] if y is None else [float(y.factor), float(y.original_max_position_embeddings),
                                 float(y.beta_fast), float(y.beta_slow), float(y.round_to_int)]
    return float(ep.eps), int(ep.rope_dim), float(ep.rope_theta), bool(ep.rope_interleaved), \
        yarn, bool(ep.rotate)


def ep_of(eps, rope_dim, rope_theta, interleaved, yarn, rotate) -> Epilogue:
    y = None if not yarn else YaRN(yarn[0], int(yarn[1]), yarn[2], yarn[3], bool(yarn[4]))
    return Epilogue(eps, rope_dim, rope_theta, interleaved, y, rotate)


@torch.library.custom_op("csa_compressor::epilogue_fwd", mutates_args=())
def epilogue_fwd_op(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor | None, cos_table: torch.Tensor | None,
                    sin_table: torch.Tensor | None, eps: float, rope_dim: int, rope_theta: float,
                    interleaved: bool, yarn: list[float], rotate: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ep = ep_of(eps, rope_dim, rope_theta, interleaved, yarn, rotate)
    table = None if cos_table is None else (cos_table, sin_table)
    out, r, cos, sin = forward_rows(x, weight, positions, inv_freq, ep, table)
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
    ep = ep_of(eps, rope_dim, rope_theta, interleaved, yarn, rotate)
    if not rope_dim:
        cos = sin = None
    return backward_rows(g, x, weight, cos, sin, r, ep)


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
                                               sin_table, *ep_args(ep))
        else:
            table = None if cos_table is None else (cos_table, sin_table)
            out, r, cos, sin = forward_rows(x_in, weight, positions, inv_freq, ep, table)
        ctx.save_for_backward(x_in, weight, cos, sin, r)
        ctx.ep = ep
        return out

    @staticmethod
    def backward(ctx, g):
        x_in, weight, cos, sin, r = ctx.saved_tensors
        if torch.compiler.is_compiling():
            gx, gw = epilogue_bwd_op(g, x_in, weight, cos, sin, r, *ep_args(ctx.ep))
        else:
            gx, gw = backward_rows(g, x_in, weight, cos, sin, r, ctx.ep)
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
    ``p`` the angles of position ``p`` (``ep``'s theta and YaRN are then not used; a row
    whose position lies outside ``[0, P)`` gets NaN rotary channels)."""
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
    if inv_freq is not None:
        check_tensor("inv_freq", inv_freq)
        if not inv_freq.is_floating_point() or tuple(inv_freq.shape) != (ep.rope_dim // 2,) \
                or inv_freq.device != pooled.device:
            raise ValueError(f"inv_freq: expected a floating-point ({ep.rope_dim // 2},) tensor "
                             f"(rope_dim // 2 frequencies) on {pooled.device}, got "
                             f"{inv_freq.dtype} {tuple(inv_freq.shape)} on {inv_freq.device}")
    cos_table = sin_table = None
    if rope_table is not None:
        cos_table, sin_table = check_rope_table(rope_table, ep.rope_dim, pooled.device)
    return _EpilogueFn.apply(pooled, norm_weight, positions, inv_freq, ep, cos_table, sin_table)


