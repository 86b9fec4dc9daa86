"""Each direction of the pooling + epilogue node timed both ways on the module's shapes: the
kernels with the epilogue inside (kernels.pool_epilogue) against the pooling kernels and
the epilogue's own kernels in turn (the same bits), so a direction's choice rests on its
own time.

    python tools/pool_epilogue_probe.py

Timed as the bench times (CUDA graphs of 20 calls over inputs rotated past the L2, the
variants' graphs replayed in turn). The packed layout of the module's one projection, 3 x
8192 tokens, bf16, capacity padding rows as the module has them. Prints one line a
config and a markdown table.
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import sys

import torch

sys.path.insert(0, "src")

from csa_compressor import epilogue as E  # noqa: E402
from csa_compressor import fused_epilogue as FE  # noqa: E402
from csa_compressor.cli.bench import capture_graph, input_sets, time_graphs_interleaved  # noqa: E402
from csa_compressor.layout import compressed_cu_seqlens  # noqa: E402
from csa_compressor.checks import halves  # noqa: E402
from csa_compressor.pooling import forward as pool_forward, launch_backward_into  # noqa: E402
from csa_compressor.validation import validate_packed  # noqa: E402

INSIDE = FE.EpilogueInside(("fwd", "bwd"), ("fwd", "bwd"))  # the "inside" steps, whatever the default

CONFIGS = (("d512 r4", 512, 4, 2, False), ("d128 r4 rotate", 128, 4, 2, True),
           ("d512 r128", 512, 128, 1, False))


def main():
    dev = torch.device("cuda")
    lens = (8192, 8192, 8192)
    T = sum(lens)
    cu = torch.tensor([0, 8192, 16384, 24576], dtype=torch.int32, device=dev)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    lines = ["| config | forward: parts | forward: inside | backward: parts | backward: inside |",
             "|---|---|---|---|---|"]
    for name, d, ratio, coff, rotate in CONFIGS:
        cuc = compressed_cu_seqlens(cu, ratio)
        n = T // ratio + 3  # capacity padding rows
        ep = E.Epilogue(rope_dim=64, rotate=rotate)
        sets = input_sets(T * 2 * coff * d * 2, l2)
        w = torch.ones(d, device=dev, dtype=torch.bfloat16)
        pos = E.rope_positions(cuc, n, ratio, 8192)
        inv = E.rope_inv_freq(64, ep.rope_theta, device=dev)
        probs, fins, saved, grads = [], [], [], []
        for i in range(sets):
            kvs = torch.randn(T, 2 * coff * d, device=dev).to(torch.bfloat16)
            ape = 0.02 * torch.randn(ratio, coff * d, device=dev)
            p = validate_packed(kvs, ape, cu, cuc, n, ratio=ratio, coff=coff, for_kernel=True)
            f = FE.Finish(ep, w, pos, inv, inside=INSIDE).check(p)
            probs.append(p)
            fins.append(f)
            saved.append(FE._forward(p, f))  # inside: pooled, r, cos, sin for the backwards
            grads.append(torch.randn(n, d, device=dev).to(torch.bfloat16))
        for direction in ("fwd", "bwd"):
            assert FE._in_kernels(probs[0], fins[0], saved[0][1], direction), direction

        def fwd_parts(i):
            pooled = pool_forward(probs[i])
            return E._forward(pooled, w, pos, inv, ep)

        def fwd_inside(i):
            return FE._forward(probs[i], fins[i])

        def bwd_parts(i):
            p, (_, pooled, r, cos, sin) = probs[i], saved[i]
            gx, gw = E._backward(grads[i], pooled, w, cos, sin, r, ep)
            dkvs = torch.empty_like(p.kvs)
            return dkvs, launch_backward_into(gx, p, halves(dkvs)), gw

        def bwd_inside(i):
            _, pooled, r, cos, sin = saved[i]
            return FE._backward(probs[i], fins[i], grads[i], pooled, r, cos, sin)

        steps = {"fwd_parts": fwd_parts, "fwd_inside": fwd_inside, "bwd_parts": bwd_parts,
                 "bwd_inside": bwd_inside}
        for step in steps.values():
            step(0)
        torch.cuda.synchronize()
        # the two ways agree, bit for bit
        a, b = fwd_parts(0)[0], fwd_inside(0)[0]
        assert torch.equal(a, b.view(a.shape)), name
        a, b = bwd_parts(0), bwd_inside(0)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), name  # dkvs, dape, dweight
        graphs = {k: capture_graph(s, sets) for k, s in steps.items()}
        us = time_graphs_interleaved(graphs)
        print(name, {k: round(v, 1) for k, v in us.items()}, flush=True)
        lines.append(f"| {name} | {us['fwd_parts']:.1f} | {us['fwd_inside']:.1f} | "
                     f"{us['bwd_parts']:.1f} | {us['bwd_inside']:.1f} |")
    print(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}; µs a call")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
