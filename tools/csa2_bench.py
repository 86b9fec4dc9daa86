"""DeepSeek-V4.1 (no APE) on the GPU: the fused pooling with ``ape=None`` against a zero
``ape``, and Megatron-LM's CSA2Compressor step eager against csa_compressor.megatron
installed.

    MEGATRON_LM_PATH=/path/to/Megatron-LM-with-csa2 python tools/csa2_bench.py [--tokens 8x4096]

- Pooling: fp32 ``kv`` / ``score`` (CSA2's fp32 projections), head_dim 512, ratio 2, coff 1,
  forward and forward + backward, 20 calls per CUDA graph with inputs rotated past the L2
  (the bench's method), against the copy floor of the fp32 bytes moved.
- Module: CSA2Compressor (hidden 4096, head_dim 512, ratio 2, bf16 parameters) on SBHD
  ``(L, B, hidden)``, forward + backward a step: wall µs (CUDA events around 10 steps,
  median of 5; eager, no graph) and GPU µs (torch.profiler's kernel durations).
"""

from __future__ import annotations

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True, own_help=True)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from csa_compressor import compress_thd_fused, megatron  # noqa: E402
from csa_compressor.cli.bench import copy_bandwidth, environment, time_graph  # noqa: E402
from csa_compressor.cli.module_bench import profile_steps, steps_us  # noqa: E402

HIDDEN, D, RATIO = 4096, 512, 2


def pooling_rows(B, L, bandwidth):
    """(label, µs, % of floor) of the fused pooling, no APE against a zero one."""
    dev = torch.device("cuda")
    T, N = B * L, B * (L // RATIO)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    set_bytes = 2 * T * D * 4
    n_sets = max(2, -(-2 * l2 // set_bytes))
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = [(torch.randn(T, D, device=dev, generator=gen), torch.randn(T, D, device=dev, generator=gen))
            for _ in range(n_sets)]
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * L
    cuc = torch.arange(B + 1, dtype=torch.int32, device=dev) * (L // RATIO)
    zero = torch.zeros(RATIO, D, device=dev)
    grads = [torch.randn(N, D, device=dev, generator=gen) for _ in range(n_sets)]
    leaves = [(kv.requires_grad_(True), sc.requires_grad_(True)) for kv, sc in sets]
    # fwd: read kv, score, write rows; fwd+bwd: that, then read both and the row gradient
    # again and write dkv, dscore
    floors = {"forward": (2 * T * D + N * D) * 4, "forward + backward": (6 * T * D + 2 * N * D) * 4}
    out = []
    for label, ape in (("ape=None", None), ("zero ape", zero)):
        def fwd(i, ape=ape):
            with torch.no_grad():
                compress_thd_fused(*sets[i], ape, cu, cuc, N, ratio=RATIO, coff=1)

        def step(i, ape=ape):
            kv, sc = leaves[i]
            y = compress_thd_fused(kv, sc, ape, cu, cuc, N, ratio=RATIO, coff=1)
            torch.autograd.grad(y, (kv, sc), grads[i])

        for what, fn in (("forward", fwd), ("forward + backward", step)):
            us = time_graph(fn, n_sets)
            floor = floors[what] / bandwidth * 1e6
            out.append((f"{what}, {label}", us, 100 * floor / us, floor))
    return out


def module_rows(B, L):
    path = os.environ.get("MEGATRON_LM_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    import megatron.core.transformer.experimental_attention_variant.csa2.compressor as csa2
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from csa_compressor.testing import megatron_one_process

    megatron_one_process(tempfile.mkdtemp())
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=32,
                            params_dtype=torch.bfloat16, bf16=True)
    comp = csa2.CSA2Compressor(cfg, csa2.CSA2CompressorSubmodules(norm=WrappedTorchNorm),
                               compress_ratio=RATIO, head_dim=D).cuda()
    comp.norm.to(torch.bfloat16)
    x = torch.randn(L, B, HIDDEN, device="cuda").bfloat16().requires_grad_(True)
    g = {}

    def step():
        x.grad = None
        comp.zero_grad(set_to_none=True)
        out = comp(x)
        out = out[0] if isinstance(out, tuple) else out
        if "g" not in g:
            g["g"] = torch.randn_like(out)
        out.backward(g["g"])

    rows = []
    for label in ("eager", "installed"):
        megatron.clear_fallback_reasons()
        if label == "installed":
            megatron.install()
        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            wall = steps_us(step)
            gpu, launches = profile_steps(step)
            if label == "installed" and megatron.fallback_reasons():
                raise SystemExit(f"fell back: {megatron.fallback_reasons()}")
        finally:
            megatron.uninstall()
        rows.append((label, wall, gpu, launches))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8x4096", help="BxL: B sequences of L tokens")
    B, L = (int(v) for v in ap.parse_args().tokens.split("x"))
    env = environment()
    bw = copy_bandwidth(torch.device("cuda"))
    pool = pooling_rows(B, L, bw)
    mod = module_rows(B, L)
    print(f"GPU {env.get('gpu')}, torch {env['torch']}, CuTe DSL {env['cutlass_dsl']}, commit "
          f"{env['commit']}, {env['date']}; {B}x{L} tokens, head_dim {D}, ratio {RATIO}; copy "
          f"bandwidth {bw / 1e9:.0f} GB/s")
    print("\n| fused pooling, fp32 | µs | floor µs | % of floor |\n|---|---|---|---|")
    for label, us, pct, floor in pool:
        print(f"| {label} | {us:.1f} | {floor:.1f} | {pct:.0f}% |")
    print(f"\n| CSA2Compressor step (hidden {HIDDEN}, bf16, SBHD) | wall µs | GPU µs | kernels |"
          "\n|---|---|---|---|")
    for label, wall, gpu, launches in mod:
        print(f"| {label} | {wall:.0f} | {gpu:.0f} | {launches:.0f} |")


if __name__ == "__main__":
    main()
