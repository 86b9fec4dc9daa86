"""The grouped (context-parallel) layout: rows already packed as consecutive groups of
``ratio`` tokens, as Megatron-LM's context-parallel Compressor hands them over.

``kv``, ``score``: ``(G*ratio, coff*d)`` (or ``(G*ratio, 1, coff*d)``), group ``g`` being
tokens ``[g*ratio, (g+1)*ratio)``; ``group_ids (G,)`` integers: the group's block index in
its sequence. ``0``: a sequence's first block (its previous-block slots are empty);
``> 0``: it continues from group ``g-1`` (whose tokens are its previous block); ``< 0``:
padding, computed like a continuation and given no gradient. Output ``(G, d)``.

Row 0 always has empty previous slots: where ``group_ids[0] != 0`` its previous block is a
halo on another rank, which Megatron's eager code stands in for with the buffer's last
group (``torch.roll``) and then discards; here that row is computed as a first block.

The groups map onto a THD pack with a segment starting at every ``group_ids == 0`` (and at
row 0), built on the device with no host sync, so the fused op, its autograd, torch.compile
and CUDA graphs all work as for THD.
"""

from __future__ import annotations

import torch

from . import reference
from .checks import check_ratio_coff
from .kernel_api import pool_backward, pool_forward
from .layout import compressed_cu_seqlens
from .ops import fused_from_problem
from .runtime import small_kernels_usable
from .validation import validate


def grouped_offsets(group_ids: torch.Tensor, ratio: int):
    """``(cu_seqlens, cu_seqlens_comp)`` int32 ``(G+1,)`` of the THD pack whose rows are the
    groups in order: segment boundaries at the groups that start a sequence, empty
    segments after the last. Well formed for any ids (every group is ``ratio`` tokens), so
    the ops skip their device-side offsets check on them (Problem.offsets_built). One
    launch on a GPU the kernels run on (kernels.grouped_offsets), else torch ops."""
    ids = group_ids.reshape(-1)
    if ids.is_cuda and ids.dtype in (torch.int32, torch.int64) and small_kernels_usable(ids):
        from .kernels.grouped_offsets import grouped_offsets as launched

        got = launched(ids.contiguous(), ratio)
        if got is not None:  # None: not compiled while a CUDA graph captures
            return got
    return _torch_grouped_offsets(ids, ratio)


def _torch_grouped_offsets(ids: torch.Tensor, ratio: int):
    G = ids.numel()
    dev = ids.device
    starts = ids == 0
    starts[0:1] = True
    seg = torch.cumsum(starts.to(torch.int64), 0) - 1
    g = torch.arange(G, device=dev, dtype=torch.int64)
    # Every group writes a distinct slot: the starts into their segment's, the rest past
    # the end (a scatter with repeated indices would not be deterministic).
    buf = torch.full((2 * G + 1,), G * ratio, dtype=torch.int64, device=dev)
    buf.scatter_(0, torch.where(starts, seg, G + 1 + g), g * ratio)
    cu = buf[:G + 1].to(torch.int32)
    return cu, compressed_cu_seqlens(cu, ratio)


def _check(kv, score, group_ids, ratio, coff):
    check_ratio_coff(ratio, coff)
    if not isinstance(group_ids, torch.Tensor) or group_ids.dim() != 1 or group_ids.numel() < 1:
        raise ValueError(f"group_ids: expected a 1-D tensor of G >= 1 group ids, got "
                         f"{type(group_ids).__name__} {tuple(getattr(group_ids, 'shape', ()))}")
    if group_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"group_ids: expected int32 or int64, got {group_ids.dtype}")
    if not isinstance(kv, torch.Tensor) or kv.dim() not in (2, 3):
        raise ValueError(f"kv: expected (G*ratio, coff*d), got {tuple(getattr(kv, 'shape', ()))}")
    if kv.shape[0] != group_ids.numel() * ratio:
        raise ValueError(f"kv: expected G*ratio = {group_ids.numel()}*{ratio} = "
                         f"{group_ids.numel() * ratio} rows for {group_ids.numel()} groups, got {kv.shape[0]}")
    if group_ids.device != kv.device:
        raise ValueError(f"group_ids: expected the device of kv ({kv.device}), got {group_ids.device}")


def _pack(kv, score, group_ids, ratio, coff):
    """The checked arguments' THD offsets, and the rows that take gradient (not padding)."""
    _check(kv, score, group_ids, ratio, coff)
    cu, cuc = grouped_offsets(group_ids, ratio)
    return cu, cuc, (group_ids >= 0)[:, None]


def _grouped(pool, kv, score, ape, group_ids, ratio, coff, **kwargs):
    cu, cuc, keep = _pack(kv, score, group_ids, ratio, coff)
    out = pool(kv, score, ape, cu, cuc, group_ids.numel(), ratio=ratio, coff=coff, **kwargs)
    return torch.where(keep, out, out.detach())  # padding groups take no gradient


def _fused(kv, score, ape, cu, cuc, total_comp, *, ratio, coff):
    p = validate(kv, score, ape, cu, cuc, total_comp, ratio=ratio, coff=coff, for_kernel=True)
    p.offsets_built = True  # grouped_offsets' offsets: well formed whatever the ids
    return fused_from_problem(p)


def compress_grouped(kv, score, ape, group_ids, *, ratio: int, coff: int):
    """Fused gated pooling of grouped rows: ``(G, d)``; forward and backward under the THD
    contract (dkv / dscore bitwise to torch's eager fp32 region)."""
    return _grouped(_fused, kv, score, ape, group_ids, ratio, coff)


def compress_grouped_reference(kv, score, ape, group_ids, *, ratio: int, coff: int,
                               mode: str = "fp32"):
    """``compress_grouped`` with the plain-PyTorch reference (``reference.compress_thd``'s
    modes), on any device."""
    return _grouped(reference.compress_thd, kv, score, ape, group_ids, ratio, coff, mode=mode)


def pool_forward_grouped(kv, score, ape, group_ids, out, *, ratio: int, coff: int):
    """Kernel-level grouped forward into ``out`` ``(G, d)``: the THD kernels on the groups'
    device-built offsets (two small int32 tensors are allocated for them)."""
    cu, cuc, _ = _pack(kv, score, group_ids, ratio, coff)
    return pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)


def pool_backward_grouped(kv, score, ape, group_ids, grad_out, grad_kv, grad_score, grad_ape, *,
                          ratio: int, coff: int, workspace=None):
    """Kernel-level grouped backward into caller buffers: gradients arriving on padding
    groups (``group_ids < 0``) are ignored, as in compress_grouped (a masked copy of
    ``grad_out`` is allocated)."""
    cu, cuc, keep = _pack(kv, score, group_ids, ratio, coff)
    if not isinstance(grad_out, torch.Tensor):
        raise TypeError(f"grad_out: expected a torch.Tensor, got {type(grad_out).__name__}")
    if grad_out.dim() != 2 or grad_out.shape[0] != group_ids.numel():
        raise ValueError(f"grad_out: expected ({group_ids.numel()}, d) rows, got {tuple(grad_out.shape)}")
    grad = torch.where(keep, grad_out, torch.zeros((), dtype=grad_out.dtype, device=grad_out.device))
    return pool_backward(kv, score, ape, cu, cuc, grad, grad_kv, grad_score, grad_ape,
                         ratio=ratio, coff=coff, workspace=workspace)
