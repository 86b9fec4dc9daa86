"""`python -m csa_compressor bench --sbhd`: the pooling of SBHD inputs ``(S, B, coff*d)``.

Three ways to the same rows, timed as the op bench times them (CUDA graphs of 20 calls over
inputs rotated past the L2), forward and forward + backward: compress_sbhd_fused (the
kernels read the strided rows in place), a transposed copy into the THD layout then
compress_thd_fused (what the SBHD paths did before; its backward copies the gradients
back), and the eager reference region.
"""

from __future__ import annotations

import torch

from .. import reference
from .bench import CALLS_PER_GRAPH, input_sets, time_graph

# (S, B, head_dim, ratio, coff)
CONFIGS = ((8192, 3, 512, 4, 2), (8192, 3, 128, 4, 2), (8192, 3, 512, 128, 1),
           (4096, 8, 512, 4, 2))


def _ways():
    from ..ops import compress_sbhd_fused, compress_thd_fused

    def transposed(kv, score, ape, ratio, coff):
        S, B, W = kv.shape
        n = S // ratio
        steps = torch.arange(B + 1, dtype=torch.int32, device=kv.device)
        out = compress_thd_fused(kv.transpose(0, 1).reshape(B * S, W),
                                 score.transpose(0, 1).reshape(B * S, W), ape, steps * S,
                                 steps * n, B * n, ratio=ratio, coff=coff)
        return out.view(B, n, -1).transpose(0, 1)

    def eager(kv, score, ape, ratio, coff):
        return reference.compress_sbhd(kv, score, ape, ratio=ratio, coff=coff, mode="upstream")

    return {"sbhd fused": lambda kv, score, ape, ratio, coff: compress_sbhd_fused(
                kv, score, ape, ratio=ratio, coff=coff),
            "transposed + thd fused": transposed, "eager": eager}


def run(configs=CONFIGS, dtype=torch.bfloat16, progress=print):
    dev = torch.device("cuda")
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rows = []
    for S, B, d, ratio, coff in configs:
        W = coff * d
        n_sets = input_sets(2 * S * B * W * torch.tensor([], dtype=dtype).element_size(), l2)
        gen = torch.Generator(device=dev).manual_seed(0)
        sets = [[torch.randn(S, B, W, device=dev, generator=gen).to(dtype).requires_grad_(True),
                 (2 * torch.randn(S, B, W, device=dev, generator=gen)).to(dtype).requires_grad_(True),
                 torch.randn(ratio, W, device=dev, generator=gen).requires_grad_(True)]
                for _ in range(n_sets)]
        g = torch.randn(S // ratio, B, d, device=dev, generator=gen).to(dtype)
        row = {"config": f"{S}x{B} d{d} r{ratio} c{coff}"}
        for name, fn in _ways().items():
            progress(f"{row['config']} {name} ...")

            def fwd(i, fn=fn):
                return fn(*sets[i], ratio, coff)

            def fwdbwd(i):
                return torch.autograd.grad(fwd(i), sets[i], g)

            try:
                row[name] = (time_graph(fwd, n_sets), time_graph(fwdbwd, n_sets))
            except Exception as exc:  # report, never hide
                row[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row)
        sets = None  # free them before the next shape
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    names = list(_ways())
    lines = ["| S x B, config | " + " | ".join(f"{n} fwd / fwd+bwd µs" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r[n][0]:.1f} / {r[n][1]:.1f}" if isinstance(r[n], tuple) else r[n]
                 for n in names]
        lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(env) -> str:
    return (f"GPU {env.get('gpu')}, driver {env.get('driver')}, torch {env['torch']}, CuTe DSL "
            f"{env['cutlass_dsl']}, commit {env['commit']}, {env['date']}; bf16, "
            f"{CALLS_PER_GRAPH} calls per CUDA graph over inputs rotated past the L2")
