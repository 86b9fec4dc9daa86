"""Rotary frequencies (plain, YaRN-scaled, and as Megatron-LM makes them) and the torch
composition of their cosines and sines: a leaf the epilogue and the kernels' stand-ins share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


def torch_cos_sin(positions, inv_freq):
    ang = (positions.to(torch.float64)[:, None] * inv_freq[None, :]).to(torch.float32)
    return torch.cos(ang), torch.sin(ang)


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
