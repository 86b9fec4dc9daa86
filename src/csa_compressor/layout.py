"""Packed THD layout helpers: offsets of the compressed stream and its static capacity."""

from __future__ import annotations

import torch

from .checks import check_tensor
from .runtime import small_kernels_usable


def compressed_cu_seqlens(cu_seqlens: torch.Tensor, ratio: int) -> torch.Tensor:
    """Offsets of the compressed rows: segment ``s`` owns ``len_s // ratio`` rows.

    Computed on the tensor's device with no host sync, so it is safe inside CUDA graphs.
    Returns int32 ``(B+1,)``.
    """
    check_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens: expected a 1-D tensor of B+1 >= 1 offsets, got "
            f"{type(cu_seqlens).__name__} {tuple(getattr(cu_seqlens, 'shape', ()))}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected int32 (or int64) offsets, got {cu_seqlens.dtype}")
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio: expected an int >= 1, got {ratio!r}")
    if cu_seqlens.dtype == torch.int32 and cu_seqlens.is_cuda and cu_seqlens.is_contiguous():
        if small_kernels_usable(cu_seqlens):
            from .kernels.offsets import compressed_offsets

            out = compressed_offsets(cu_seqlens, ratio)
            if out is not None:  # None: not compiled while a CUDA graph captures
                return out
    return _torch_compressed_cu_seqlens(cu_seqlens, ratio)


def _torch_compressed_cu_seqlens(cu_seqlens, ratio):
    cu = cu_seqlens.to(torch.int64)
    blocks = torch.div(cu[1:] - cu[:-1], ratio, rounding_mode="floor")
    out = torch.zeros_like(cu)
    out[1:] = torch.cumsum(blocks, 0)
    return out.to(torch.int32)


def compressed_capacity(total_tokens: int, num_seqs: int, max_seqlen: int, ratio: int) -> int:
    """Static row count ``N >= Nv`` known on the host without reading the offsets.

    ``min(T // ratio, B * (max_seqlen // ratio))``: every segment holds at most
    ``max_seqlen // ratio`` rows and the pack at most ``T // ratio``.
    """
    for name, v, lo in (("total_tokens", total_tokens, 0), ("num_seqs", num_seqs, 0),
                        ("max_seqlen", max_seqlen, 0), ("ratio", ratio, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    return min(total_tokens // ratio, num_seqs * (max_seqlen // ratio))
