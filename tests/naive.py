"""An independent oracle: per-row, per-channel, per-slot loops in float64 (docs/contract.md).

Written from the contract alone, sharing no code with the package, so a mistake in the
package's vectorised gather cannot hide behind the same mistake here.
"""

import math

import torch


def naive_forward_backward(kv, score, ape, cu, total_comp, ratio, coff, grad_out=None):
    """Returns (out, dkv, dscore, dape) in float64; grads are None without grad_out."""
    kv = kv.reshape(kv.shape[0], kv.shape[-1]).double()
    score = score.reshape(score.shape[0], score.shape[-1]).double()
    ape = ape.double()
    T, W = kv.shape
    d = W // coff
    cu = [int(x) for x in cu]
    rows = []  # (segment-local block index i, first token t0) per real row, in order
    for s in range(len(cu) - 1):
        for i in range((cu[s + 1] - cu[s]) // ratio):
            rows.append((i, cu[s] + i * ratio))
    out = torch.zeros(total_comp, d, dtype=torch.float64)
    dkv = torch.zeros(T, W, dtype=torch.float64)
    dsc = torch.zeros(T, W, dtype=torch.float64)
    dape = torch.zeros(ratio, W, dtype=torch.float64)
    for b in range(total_comp):
        if b < len(rows):
            i, t0 = rows[b]
            real = True
        else:
            if T < ratio:
                continue
            i, t0, real = 0, 0, False
        for j in range(d):
            slots = []  # (token, column, ape row)
            if coff == 2:
                if i > 0:
                    for k in range(ratio):
                        slots.append((t0 - ratio + k, j, k))
                for k in range(ratio):
                    slots.append((t0 + k, d + j, k))
            else:
                for k in range(ratio):
                    slots.append((t0 + k, j, k))
            s = [score[t, c].item() + ape[a, c].item() for t, c, a in slots]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            den = sum(e)
            p = [x / den for x in e]
            out[b, j] = sum(kv[t, c].item() * pk for (t, c, _), pk in zip(slots, p))
            if grad_out is None or not real:
                continue
            g = float(grad_out[b, j])
            dp = [g * kv[t, c].item() for t, c, _ in slots]
            S = sum(pk * dpk for pk, dpk in zip(p, dp))
            for (t, c, a), pk, dpk in zip(slots, p, dp):
                dkv[t, c] = g * pk
                ds = pk * dpk - pk * S
                dsc[t, c] = ds
                dape[a, c] += ds
    if grad_out is None:
        return out, None, None, None
    return out, dkv, dsc, dape
