"""Test inputs: packs described by segment lengths, with random data (never zeros)."""

import torch

from csa_compressor import compressed_cu_seqlens


def reference_of(p):
    """What a forward launch computes for validated problem ``p``: the reference of its
    numerics ("fp32", or "upstream" for the eager rounding) on its (detached) tensors. The
    CPU tests stand it in for the kernels."""
    from csa_compressor import reference

    return reference.compress_thd(p.kv.detach(), p.score.detach(), p.ape.detach(), p.cu_seqlens,
                                  p.cu_seqlens_comp, p.total_comp, ratio=p.ratio, coff=p.coff,
                                  mode=reference.MODE_OF_NUMERICS[p.numerics])


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


# (cu_seqlens, cu_seqlens_comp) a caller got wrong, for T = 300 tokens and N = 40 rows.
# Their contents are never read on the host (that would sync), so the kernels must stay
# inside every buffer and terminate whatever they hold; the results are unspecified.
# Used by tests/test_bounds_gpu.py and tools/sanitize_probe.py.
CORRUPT_OFFSETS = [
    ([0, 50, 20, 300], [0, 12, 17, 37]),  # decreasing token offsets
    ([0, 40, 5000], [0, 10, 40]),  # past T
    ([0, -30, 60], [0, 5, 20]),  # negative
    ([0, 40, 300], [0, 30, 31]),  # more rows than segment 0 has tokens
    ([0, 2**31 - 2, 2**31 - 1], [0, 0, 40]),  # t0 + ratio wraps around int32
    ([10, 50, 300], [0, 10, 22]),  # cu_seqlens[0] != 0
    ([0, 60, 300], [5, -7, 2**31 - 1]),  # garbage row offsets
    ([-2**31, 0, 300], [-2**31, 0, 25]),
    # 40 segments, scrambled: more than 32, so the warp searches take more than one round
    ([0] + [(i * 7919) % 400 - 50 for i in range(1, 41)],
     [0] + [(i * 104729) % 60 - 10 for i in range(1, 41)]),
]
