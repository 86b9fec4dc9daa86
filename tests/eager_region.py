"""The eager region a user writes with torch: the Compressor's window gather, then fp32
softmax and sum with torch's own ops, differentiated by torch's autograd.

Written from the contract alone (window indices built per row on the host, sharing no
code with the package's reference), so that "bitwise to the fp32 reference" can be
checked against what torch itself computes.
"""

import torch


def window_indices(cu, total_comp, ratio, coff, num_tokens):
    """Per row: the tokens of its slots, whether each slot is filled, and whether the row
    is real (a padding row is a first block at token 0; all-empty if T < ratio)."""
    cu = [int(x) for x in cu]
    rows = []
    for s in range(len(cu) - 1):
        for i in range((cu[s + 1] - cu[s]) // ratio):
            rows.append((i, cu[s] + i * ratio))
    tokens, filled, real = [], [], []
    for b in range(total_comp):
        i, t0, r = rows[b] + (True,) if b < len(rows) else (0, 0, False)
        own = [t0 + k for k in range(ratio)]
        if coff == 2:
            prev = [t0 - ratio + k if i > 0 else t0 for k in range(ratio)]
            tokens.append(prev + own)
            filled.append([i > 0] * ratio + [True] * ratio)
        else:
            tokens.append(own)
            filled.append([True] * ratio)
        real.append(r)
    return tokens, filled, real


def eager_fp32_region(kv, score, ape, cu, total_comp, *, ratio, coff):
    """``(total_comp, d)`` in kv's dtype; gradients flow to kv, score and ape from real rows."""
    T, W = kv.shape
    d = W // coff
    if total_comp == 0 or T < ratio:
        return kv.new_zeros((total_comp, d))
    tokens, filled, real = window_indices(cu, total_comp, ratio, coff, T)
    dev = kv.device
    idx = torch.tensor(tokens, device=dev)  # (N, K)
    mask = torch.tensor(filled, device=dev)[:, :, None]
    K = idx.shape[1]
    # Slot k reads the first half of the columns for the previous block, the second for
    # its own (coff 2); the bias row is the slot's position inside its block.
    cols = torch.arange(d, device=dev)
    half = torch.tensor([0 if (coff == 2 and k < ratio) else (coff - 1) * d for k in range(K)],
                        device=dev)
    col_idx = half[:, None] + cols[None, :]  # (K, d)
    kv_w = kv[idx[:, :, None], col_idx[None]]
    sc_w = score[idx[:, :, None], col_idx[None]]
    ape_w = ape[torch.arange(K, device=dev)[:, None] % ratio, col_idx]  # (K, d)
    s = (sc_w.float() + ape_w).masked_fill(~mask, float("-inf"))
    w = torch.softmax(s, dim=1, dtype=torch.float32)
    v = kv_w.float().masked_fill(~mask, 0.0)
    out = (v * w).sum(dim=1).to(kv.dtype)
    keep = torch.tensor(real, device=dev)[:, None]
    return torch.where(keep, out, out.detach())
