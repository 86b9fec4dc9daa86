"""The Compressor's epilogue after the pooling: RMSNorm over head_dim (fp32, eps, a weight),
rotary embedding on the last ``rope_dim`` channels at each row's position, optional
orthonormal Walsh-Hadamard rotation, then one rounding to the pooled rows' dtype.

Here: its settings (``Epilogue``), the rows' positions of each layout (``rope_positions``
for THD, ``block_index * ratio``; ``grouped_positions``; ``sbhd_positions``), their
cosines and sines, and the torch compositions: ``eager_epilogue`` (the reference) and
``megatron_epilogue`` (rounded where Megatron-LM's Compressor rounds). The autograd node
that runs it on the kernels is epilogue_op.apply_epilogue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .rotary import YaRN, megatron_inv_freq, rope_inv_freq, torch_cos_sin  # noqa: F401
from .runtime import small_kernels_usable


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


def apply_rope(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float, interleaved: bool,
               yarn: YaRN | None = None):
    """Rotary embedding on the last ``rope_dim`` channels of ``x`` (rows x channels, fp32)
    at integer positions ``pos`` (one per row)."""
    if rope_dim == 0:
        return x
    cos, sin = torch_cos_sin(pos, rope_inv_freq(rope_dim, theta, yarn, device=x.device))
    return rotate(x, cos, sin, rope_dim, interleaved, 1)


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
        # Positions outside the table read a clamped row made NaN: on the GPU an
        # unclamped index_select is a device-side assert, which ends the process's CUDA use.
        idx = positions.to(torch.int64)
        held = idx.clamp(0, rope_table[0].shape[0] - 1)
        inside = (held == idx).unsqueeze(1)
        return tuple(torch.where(inside, t.index_select(0, held), float("nan"))
                     for t in rope_table)
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
    return torch_cos_sin(positions, inv_freq)


def rotate(y, cos, sin, rope_dim, interleaved, sign):
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


def hadamard_backward(g: torch.Tensor) -> torch.Tensor:
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


def check_rope_table(rope_table, rope_dim: int, device):
    """``(cos, sin)`` of a caller's rotary table, checked: fp32 ``(P, rope_dim // 2)`` each,
    ``P >= 1``, on ``device``. Rows at positions outside ``[0, P)`` get NaN angles
    (rope_cos_sin), never a read past the table."""
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
        x = rotate(x, cos, sin, ep.rope_dim, ep.rope_interleaved, 1)
    else:
        x = apply_rope(x, positions, ep.rope_dim, ep.rope_theta, ep.rope_interleaved, ep.rope_yarn)
    if ep.rotate:
        x = hadamard(x)
    return x.to(pooled.dtype)


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
        y = rotate(y, torch.cos(ang).to(dt), torch.sin(ang).to(dt), ep.rope_dim,
                    ep.rope_interleaved, 1)
    if ep.rotate:  # as Megatron calls it: hadamard_transform(y, scale=head_dim ** -0.5)
        y = (walsh_hadamard(y) * y.shape[-1] ** -0.5).view(y.shape).to(dt)
    return y
