"""Inputs shared by the tests, the bench, the numerics gate and the developer tools:
random packs for a ``shapes.Shape`` (never zeros, which hide unwritten outputs)."""

from __future__ import annotations

import torch

from .layout import compressed_capacity, compressed_cu_seqlens
from .shapes import Shape, parse_shape  # noqa: F401  (re-exported for the tools)


def make_inputs(shape: Shape, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    T, W = sum(shape.lens), shape.coff * shape.d
    kv = torch.randn(T, W, device=device, dtype=torch.float32, generator=gen).to(dtype)
    score = (2 * torch.randn(T, W, device=device, generator=gen)).to(dtype)
    ape = torch.randn(shape.ratio, W, device=device, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(shape.lens).cumsum(0).tolist()), dtype=torch.int32,
                      device=device)
    cuc = compressed_cu_seqlens(cu, shape.ratio)
    # Static capacity, as a CUDA-graph training step would pass it (no host sync).
    N = compressed_capacity(T, len(shape.lens), max(shape.lens), shape.ratio)
    g = torch.randn(N, shape.d, device=device, generator=gen).to(dtype)
    return kv, score, ape, cu, cuc, N, g
