"""Test inputs: packs described by segment lengths, with random data (never zeros)."""

import torch

from csa_compressor import compressed_cu_seqlens


def make_pack(lens, d, ratio, coff, dtype=torch.float32, device="cpu", pad_tokens=0,
              extra_rows=0, seed=0, ape_scale=1.0):
    """Random kv/score/ape for segments ``lens``; ``pad_tokens`` tokens after the last
    segment; ``extra_rows`` static-capacity padding rows on top of the true count."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens) + pad_tokens
    W = coff * d
    kv = torch.randn(T, W, generator=gen).to(dtype).to(device)
    score = (2 * torch.randn(T, W, generator=gen)).to(dtype).to(device)
    ape = (ape_scale * torch.randn(ratio, W, generator=gen)).to(device)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()) if lens else [0],
                      dtype=torch.int32, device=device)
    if cu.numel() < 2:
        cu = torch.zeros(2, dtype=torch.int32, device=device)
    cuc = compressed_cu_seqlens(cu, ratio)
    n_true = sum(n // ratio for n in lens)
    return kv, score, ape, cu, cuc, n_true + extra_rows
