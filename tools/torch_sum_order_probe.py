"""Which order torch's CUDA sum over the middle dimension of a contiguous fp32 ``(N, W, d)``
tensor adds in (the eager region's ``(v * w).sum(dim=1)``), found by matching candidates
bit for bit. A candidate: ``lanes`` threads, lane y taking slots y, y + lanes, ...; each
lane adds its j-th slot into accumulator j % 4, meets its 4 accumulators in order, then
the lanes meet in a halving tree. Prints one line per shape: the lane counts that match.

    python tools/torch_sum_order_probe.py [N,...] [W,...] [d,...]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)
import sys

import torch


def candidate(x, lanes):
    N, W, d = x.shape
    J = -(-W // lanes)
    pad = x.new_zeros((N, J * lanes, d))
    pad[:, :W] = x
    has = torch.zeros(J * lanes, dtype=torch.bool, device=x.device)
    has[:W] = True
    pad = pad.view(N, J, lanes, d)
    has = has.view(J, lanes)
    acc = [None] * 4
    for j in range(J):
        i = j % 4
        v = pad[:, j]
        if acc[i] is None:
            acc[i] = torch.where(has[j][None, :, None], v, torch.zeros_like(v))
        else:
            acc[i] = torch.where(has[j][None, :, None], acc[i] + v, acc[i])
    val = acc[0]
    for i in range(1, 4):
        if acc[i] is not None:
            val = val + acc[i]
    off = lanes // 2
    while off > 0:
        val = torch.cat([val[:, :off] + val[:, off:2 * off], val[:, off:]], dim=1)
        off //= 2
    return val[:, 0]


def main():
    Ns = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,3,7,300,8192").split(",")]
    Ws = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else
                           "2,3,4,5,6,7,8,9,12,16,31,32,33,63,64,65,96,127,128,129,255,256,257,512").split(",")]
    ds = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "1,64,65,96,128,512,576").split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    for d in ds:
        for W in Ws:
            for N in Ns:
                if N * W * d > 2 ** 27:
                    continue
                x = torch.randn((N, W, d), device="cuda", generator=g)
                ref = x.sum(dim=1)
                hits = [lanes for lanes in (1, 2, 4, 8, 16, 32, 64)
                        if lanes <= max(W, 1) and torch.equal(candidate(x, lanes), ref)]
                serial = x[:, 0].clone()
                for k in range(1, W):
                    serial = serial + x[:, k]
                s = "serial" if torch.equal(serial, ref) else ""
                print(f"N={N} W={W} d={d}: lanes {hits} {s}", flush=True)


if __name__ == "__main__":
    main()
