"""The kernel-level API (kernel_api.pool_forward / pool_backward) on the CPU: the reference
of the kernels' numerics into the caller's buffers, with an fp32 ``grad_score`` taking the
gradient of the fp32 logits before its rounding, as the kernels store it."""

import torch

from csa_compressor import reference, validation


def pool_forward(kv, score, ape, cu, cuc, out, *, ratio, coff, numerics="fp32", **_):
    mode = reference.MODE_OF_NUMERICS[numerics]
    out.copy_(reference.compress_thd(kv, score, ape, cu, cuc, out.shape[0], ratio=ratio,
                                     coff=coff, mode=mode))
    return out


def pool_backward(kv, score, ape, cu, cuc, grad_out, grad_kv, grad_score, grad_ape, *, ratio,
                  coff, numerics="fp32", **_):
    mode = reference.MODE_OF_NUMERICS[numerics]
    p = validation.validate(kv, score, ape, cu, cuc, grad_out.shape[0], ratio=ratio, coff=coff)
    T, W = kv.shape
    d, N = W // coff, grad_out.shape[0]
    t0, i, real = reference.row_geometry(p.cu_seqlens, p.cu_seqlens_comp, N, ratio)
    with torch.enable_grad():  # called inside an autograd.Function's backward
        k = kv.detach().requires_grad_(True)
        v, s, a, mask = reference._windows(k, score.detach(), ape.detach(), t0, i, ratio, coff, d)
        s32 = s.float().requires_grad_(True)  # the logits' fp32 gradient, unrounded
        a32 = a.detach().requires_grad_(True)
        out = reference._pool(v, s32, a32, mask, mode, kv.dtype)
        g = torch.where(real[:, None], grad_out, torch.zeros_like(grad_out))
        dk, ds, da = torch.autograd.grad(out, (k, s32, a32), g)
    # each token's column is in at most one window slot: a scatter of the slots' values
    tok, col = _slot_targets(t0, i, ratio, coff, d, T)
    flat = torch.zeros(T * W, dtype=torch.float32)
    keep = mask[:, :, None].expand_as(ds) & real[:, None, None]
    flat[(tok * W + col)[keep]] = ds[keep]
    grad_kv.copy_(dk)
    grad_score.copy_(flat.view(T, W).to(grad_score.dtype))
    grad_ape.copy_(da.sum(0) if coff == 1 else torch.cat([da[:, :ratio, :d].sum(0), da[:, ratio:].sum(0)], 1))
    return grad_kv, grad_score, grad_ape


def _slot_targets(t0, i, ratio, coff, d, T):
    """(token, column) of each (row, slot, element) of reference._windows' windows."""
    k = torch.arange(ratio)
    own = t0[:, None] + k[None, :]
    cols = torch.arange(d)
    if coff == 1:
        return own[:, :, None].expand(-1, -1, d), cols.expand(own.shape[0], ratio, d)
    prev = t0[:, None] - ratio + k[None, :]
    tok = torch.cat([prev, own], 1)[:, :, None].expand(-1, -1, d)
    col = torch.cat([cols.expand(ratio, d), (cols + d).expand(ratio, d)], 0)
    return tok.clamp(0, max(T - 1, 0)), col.expand(tok.shape[0], -1, -1)
