"""Which order torch's CUDA reduce kernel adds a contiguous fp32 ``(N, d)`` tensor's rows
in (the epilogue's ``x.pow(2).mean(-1)`` and ``(g * x).sum(-1)``), found by matching
candidates bit for bit, and whether the scalar ops around them are what they look like
(``r.pow(3)`` as ``(r*r)*r``, ``/ d`` as times the fp32 reciprocal, ``mean`` as the sum
times ``fl(N) / fl(N*d)``).

A candidate: 32 lanes a row; ``vec`` (1: torch's unrolled loads, 4 accumulators; V: V-wide
vector loads, one accumulator a vector element) and the warp's combine (``up``: shfl_down
offsets 1, 2, ..., 16; ``down``: 16, 8, ..., 1). Prints, per (N, d), the candidates that
match the sum and the mean.

    python tools/torch_rowsum_order_probe.py [N,...] [d,...]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)
import sys

import numpy as np
import torch

WARP = 32


def lane_values(x, vec):
    """(N, 32) each lane's sum: its accumulators in load order, then met in order."""
    N, d = x.shape
    span = WARP * vec * (4 if vec == 1 else 1)
    if d % span:  # the loads a lane lacks: its accumulators unchanged, as adding zeros
        x = torch.cat((x, x.new_zeros(N, span - d % span)), dim=1)
        d = x.shape[1]
    if vec == 1:  # lane t: loads t + 32*j; load j into accumulator j % 4
        cols = x.view(N, d // WARP, WARP)  # [row, j, lane]
        acc = [None] * 4
        for j in range(cols.shape[1]):
            v = cols[:, j]
            acc[j % 4] = v.clone() if acc[j % 4] is None else acc[j % 4] + v
    else:  # lane t: vectors t + 32*k, element i into accumulator i
        cols = x.view(N, d // (WARP * vec), WARP, vec)  # [row, k, lane, i]
        acc = [None] * vec
        for k in range(cols.shape[1]):
            for i in range(vec):
                v = cols[:, k, :, i]
                acc[i] = v.clone() if acc[i] is None else acc[i] + v
    val = None
    for a in acc:
        if a is not None:
            val = a if val is None else val + a
    return val


def warp_combine(val, direction):
    v = val.clone()
    offsets = [1, 2, 4, 8, 16] if direction == "up" else [16, 8, 4, 2, 1]
    for off in offsets:
        other = torch.cat((v[:, off:], v[:, -off:]), dim=1)  # shfl_down: lanes past the end keep their own
        v = v + other
    return v[:, 0]


def main(argv):
    Ns = [int(v) for v in argv[0].split(",")] if argv else [16, 17, 100, 2048, 6144, 24576]
    ds = [int(v) for v in argv[1].split(",")] if len(argv) > 1 else [32, 64, 96, 128, 160, 192, 256, 512, 576, 1024]
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    print(f"torch {torch.__version__}")
    for d in ds:
        for N in Ns:
            x = torch.randn(N, d, device=dev, generator=g) * torch.rand(N, 1, device=dev, generator=g) * 10
            sq = x.pow(2)
            s_ref = sq.sum(-1)
            m_ref = sq.mean(-1, keepdim=True)[:, 0]
            factor = np.float32(np.float32(N) / np.float32(N * d))
            hits = []
            for vec in (1, 2, 4, 8):
                if d % vec:
                    continue
                lanes = lane_values(sq, vec)
                for direction in ("up", "down"):
                    s = warp_combine(lanes, direction)
                    tags = []
                    if torch.equal(s, s_ref):
                        tags.append("sum")
                    if torch.equal(s * float(factor), m_ref):
                        tags.append("mean")
                    if tags:
                        hits.append(f"vec{vec}/{direction}:{'+'.join(tags)}")
            r = torch.rsqrt(m_ref + 1e-6)
            extras = ["pow2" if torch.equal(sq, x * x) else "pow2-NO"]
            extras.append("pow3" if torch.equal(r.pow(3), (r * r) * r) else "pow3-NO")
            gq = torch.randn(N, d, device=dev, generator=g)
            inv = float(np.float32(1.0) / np.float32(d))
            extras.append("div" if torch.equal(gq / d, gq * inv) else "div-NO")
            print(f"N={N} d={d}: {' '.join(hits) or 'no candidate'} | {' '.join(extras)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
