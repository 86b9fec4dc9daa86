"""The package's Compressor module (fused pooling, megatron_layout, Megatron's parameters
loaded) against Megatron-LM's own Compressor at scale: how many bf16 ulps apart the output
and every gradient are, in two pairings: the module's default numerics ("fp32") against
Megatron's eager region (which rounds its softmax weights and products to bf16), and
numerics="megatron" against Megatron with csa_compressor.megatron installed (its pooling
fused, in fp32, as Megatron's own fused path computes it).

    MEGATRON_LM_PATH=/path/to/Megatron-LM python tools/module_vs_megatron.py [--tokens 3x8192]

Per tensor: the largest ulp distance, the share of elements more than 1 and more than 2
ulps apart, and the largest difference relative to the tensor's largest magnitude.
"""

from __future__ import annotations

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True, own_help=True)


import argparse
import contextlib
import itertools
import os
import sys
import tempfile

import torch


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 ulp distance (sign-magnitude bits mapped to a monotone integer line)."""
    ia, ib = (t.bfloat16().view(torch.int16).to(torch.int32) for t in (a, b))
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="3x8192")
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args(argv)
    path = os.environ.get("MEGATRON_LM_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    import megatron.core.transformer.experimental_attention_variant.csa as csa
    from megatron.core.packed_seq_params import PackedSeqParams

    from csa_compressor import Compressor, megatron
    from csa_compressor.testing import megatron_compressor, megatron_one_process

    megatron_one_process(tempfile.mkdtemp())
    b, n = (int(v) for v in args.tokens.split("x"))
    lens = [n] * b
    dev = torch.device("cuda")
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n,
                          max_seqlen_kv=n)

    print("| config | module numerics vs Megatron | tensor | max ulps | > 1 ulp | > 2 ulps | "
          "max |diff| / max |ref| |")
    print("|---|---|---|---|---|---|---|")
    for (d, ratio), numerics in itertools.product(((512, 4), (512, 128), (128, 4)),
                                                  ("fp32", "megatron")):
        mg = megatron_compressor(csa, args.hidden, d, ratio, 64, dtype=torch.bfloat16).to(dev)
        ours = Compressor(args.hidden, d, ratio, rope_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                          dtype=torch.bfloat16, device=dev, megatron_layout=True, pooling="fused",
                          numerics=numerics)
        with torch.no_grad():  # what Float16Module leaves it: the dtype (and not all ones)
            mg.norm.weight.data = (1 + 0.1 * torch.randn(d, device=dev)).bfloat16()
        ours.load_megatron_state_dict(mg.state_dict())
        x = torch.randn(sum(lens), 1, args.hidden, device=dev).bfloat16()
        against = "eager" if numerics == "fp32" else "installed"
        res = []
        for which in ("megatron", "ours"):
            xi = x.clone().requires_grad_(True)
            with megatron.installed() if which == "megatron" and against == "installed" \
                    else contextlib.nullcontext():
                out, cuc = mg(xi, psp) if which == "megatron" else ours(xi, cu, max_seqlen=n)
            g = torch.randn(out.shape, device=dev, generator=torch.Generator(dev).manual_seed(1))
            g = g.bfloat16()
            g[int(cuc[-1]):] = 0
            out.backward(g)
            params = mg.named_parameters() if which == "megatron" else (
                (k, dict(ours.named_parameters())[v]) for k, v in Compressor.MEGATRON_KEYS.items())
            res.append({"out": out.detach(), "x.grad": xi.grad,
                        **{k: p.grad for k, p in params}})
        for key in res[0]:
            a, ref = res[1][key].float(), res[0][key].float()
            u = ulps(a, ref)
            rel = ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            print(f"| d{d} r{ratio} | {numerics} vs {against} | {key} | {int(u.max())} | {(u > 1).float().mean().item():.2e} | "
                  f"{(u > 2).float().mean().item():.2e} | {rel:.2e} |", flush=True)
        del mg, ours
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
