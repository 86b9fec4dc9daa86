"""Small ragged packs through every kernel family, for compute-sanitizer (memcheck):
short-window fwd/bwd (ratio 4 coff 2, ratio 3 coff 1, odd head_dim), long-window fwd/bwd
(ratio 128), capacity padding rows, N below the true count, T < ratio."""

import torch

import csa_compressor as C
from csa_compressor.bench import make_inputs, parse_shape

for spec, extra in (("37+0+3+64+129+1:128:4:2", 3), ("37+0+3+64+129+1:65:3:1", 2),
                    ("300+0+127+259:64:128:1", 2), ("300+5+260:64:128:2", 1), ("2:64:4:2", 2),
                    ("64+64:128:4:2", -9)):
    s = parse_shape(spec)
    kv, score, ape, cu, cuc, N, _ = make_inputs(s, torch.bfloat16, torch.device("cuda"))
    N = max(0, N + extra)
    leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
    out = C.compress_thd_fused(*leaves, cu, cuc, N, ratio=s.ratio, coff=s.coff)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(spec, "N", N, "ok", bool(torch.isfinite(out).all()), bool(torch.isfinite(leaves[0].grad).all()))
