"""`python -m csa_compressor check`: the numerics gate over a grid of packs.

Every output of the fused op against torch's eager fp32 region (reference mode "fp32")
on the same GPU: dkv and dscore bitwise, the forward within one unit in the last place on
at most 0.1% of elements (fp32 outputs: within 4 units), dape within 1e-3, and no output
further from the fp64 oracle than the upstream (Megatron) region's. Then the same clauses
for numerics="eager" against the upstream region it rounds as. Then the epilogue
node (apply_epilogue) against the composition of torch ops it stands for
(eager_epilogue): its output and both gradients bitwise. Then the pooling with the
epilogue as one op (``epilogue=``) against the pooling op followed by that composition,
with each direction in one kernel, by parts, and as set: the output and every gradient
bitwise."""

from __future__ import annotations

import torch

from .. import reference
from ..shapes import parse_shape
from ..testing import make_inputs
from ..numerics import compare

# Ragged packs: an empty segment, one shorter than ratio, tails, token padding via the
# static capacity; one odd head_dim; each ratio family (short overlapping, long).
GRID = [
    "37+0+3+64+129+1+250:128:1:1", "37+0+3+64+129+1+250:128:2:2", "37+0+3+64+129+1+250:128:4:2",
    "37+0+3+64+129+1+250:512:4:2", "37+0+3+64+129+1+250:65:3:2", "37+0+3+64+129+1+250:64:8:1",
    "37+0+3+64+129+1+250:96:16:2", "37+0+3+64+129+1+250:576:4:2",
    "300+0+127+520:128:128:1", "300+0+127+520:64:128:2", "300+0+127+520:512:128:1",
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _run(fn, kv, score, ape, cu, cuc, N, g, ratio, coff):
    return _step(lambda kv, score, ape: fn(kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff),
                 (kv, score, ape), g)


def run(grid=GRID, dtypes=("bf16", "fp16", "fp32"), out=print) -> int:
    from ..ops import compress_thd_fused

    failures = 0
    out("| pack:d:ratio:coff | dtype | output | bitwise | differ | max ulp | L1 err fp32 ref | "
        "L1 err upstream | L1 err fused | verdict |")
    out("|" + "---|" * 10)
    for spec in grid:
        shape = parse_shape(spec)
        for dname in dtypes:
            dt = DTYPES[dname]
            kv, score, ape, cu, cuc, N, g = make_inputs(shape, dt, torch.device("cuda"), seed=1)
            N += 3  # static-capacity padding rows, with non-zero gradient arriving on them
            g = torch.cat([g, torch.randn(3, shape.d, device="cuda").to(dt)])

            def ref(mode):
                return lambda *a, **k: reference.compress_thd(*a, mode=mode, **k)

            fused = _run(compress_thd_fused, kv, score, ape, cu, cuc, N, g, shape.ratio, shape.coff)
            r32 = _run(ref("fp32"), kv, score, ape, cu, cuc, N, g, shape.ratio, shape.coff)
            up = _run(ref("upstream"), kv, score, ape, cu, cuc, N, g, shape.ratio, shape.coff)
            ora = _run(ref("fp64"), kv.float(), score.float(), ape, cu, cuc, N, g.float(),
                       shape.ratio, shape.coff)
            clauses = ("ulp", "bitwise", "bitwise", "atol")
            for i, (name, clause) in enumerate(zip(("out", "dkv", "dscore", "dape"), clauses)):
                rep = compare(name, fused[i], r32[i], up[i], ora[i], clause=clause,
                              against_upstream=dt != torch.float32)
                failures += len(rep.failures)
                verdict = "ok" if not rep.failures else "FAIL: " + "; ".join(rep.failures)
                out(f"| {spec} | {dname} | {name} | {'yes' if rep.bitwise else 'no'} | "
                    f"{rep.n_diff}/{rep.numel} | {rep.max_ulp:.2f} | {rep.err_fp32:.4g} | "
                    f"{rep.err_upstream:.4g} | {rep.err_fused:.4g} | {verdict} |")
    out("")
    failures += run_eager(grid, dtypes, out)
    out("")
    failures += run_epilogue(torch.device("cuda"), dtypes, out)
    out("")
    failures += run_pool_epilogue(torch.device("cuda"), dtypes, out)
    out(f"\n{'PASS' if failures == 0 else 'FAIL'}: {failures} contract clause(s) failed")
    return 1 if failures else 0


def run_eager(grid=GRID, dtypes=("bf16", "fp16", "fp32"), out=print, device=None) -> int:
    """The fused op with numerics="eager" against the region it rounds as (reference mode
    "upstream", Megatron-LM's eager pooling) on the same GPU, under the fp32 clauses: dkv
    and dscore bitwise, the forward within one ulp on at most 0.1% of elements, dape
    within 1e-3. Returns the number of failing outputs."""
    from ..ops import compress_thd_fused

    failures = 0
    out("| eager numerics pack:d:ratio:coff | dtype | output | bitwise | differ | max ulp | verdict |")
    out("|" + "---|" * 7)
    for spec in grid:
        shape = parse_shape(spec)
        for dname in dtypes:
            dt = DTYPES[dname]
            kv, score, ape, cu, cuc, N, g = make_inputs(shape, dt, device or torch.device("cuda"),
                                                        seed=2)
            args = (kv, score, ape, cu, cuc, N, g, shape.ratio, shape.coff)
            fused = _run(lambda *a, **k: compress_thd_fused(*a, numerics="eager", **k), *args)
            up = _run(lambda *a, **k: reference.compress_thd(*a, mode="upstream", **k), *args)
            for i, (name, clause) in enumerate(zip(("out", "dkv", "dscore", "dape"),
                                                   ("ulp", "bitwise", "bitwise", "atol"))):
                rep = compare(name, fused[i], up[i], up[i], up[i], clause=clause,
                              against_upstream=False, reference="the upstream region")
                failures += len(rep.failures)
                verdict = "ok" if not rep.failures else "FAIL: " + "; ".join(rep.failures)
                out(f"| {spec} | {dname} | {name} | {'yes' if rep.bitwise else 'no'} | "
                    f"{rep.n_diff}/{rep.numel} | {rep.max_ulp:.2f} | {verdict} |")
    return failures


# (head_dim, rope_dim, interleaved pairs, rotate): the Compressor's geometries (d512 with
# RoPE, d128 with RoPE and the rotation, in both pair layouts) and one without RoPE; rows:
# a pack's worth below the column sum's split and 3x8192 tokens at ratio 4 plus padding.
EPILOGUE_GRID = [(512, 64, True, False), (128, 64, True, True), (128, 64, False, True),
                 (64, 0, True, False)]
EPILOGUE_ROWS = (37, 6147)


def run_epilogue(device, dtypes=("bf16", "fp16", "fp32"), out=print, grid=EPILOGUE_GRID,
                 rows=EPILOGUE_ROWS) -> int:
    """The epilogue node against eager_epilogue on ``device``: output, d pooled and d
    norm_weight bitwise. Returns the number of failing outputs."""
    from .. import epilogue, epilogue_op

    failures = 0
    out("| epilogue d:rope:interleaved:rotate | rows | dtype | output | bitwise | differ | verdict |")
    out("|" + "---|" * 7)
    for d, rope, inter, rot in grid:
        ep = epilogue.Epilogue(rope_dim=rope, rope_interleaved=inter, rotate=rot)
        for n in rows:
            for dname in dtypes:
                dt = DTYPES[dname]
                gen = torch.Generator(device=device).manual_seed(n + d)
                x = (torch.randn(n, d, device=device, generator=gen)
                     * (4 * torch.rand(n, 1, device=device, generator=gen))).to(dt)
                w = (1 + 0.1 * torch.randn(d, device=device, generator=gen)).to(dt)
                g = torch.randn(n, d, device=device, generator=gen).to(dt)
                pos = torch.arange(n, device=device) * 4
                got = _epilogue_step(epilogue_op.apply_epilogue, x, w, pos, ep, g)
                want = _epilogue_step(epilogue.eager_epilogue, x, w, pos, ep, g)
                failures += _bitwise_rows(out, f"{d}:{rope}:{int(inter)}:{int(rot)} | {n} | {dname}",
                                          ("out", "d pooled", "d norm_weight"), got, want,
                                          "the composition")
    return failures


def _bitwise_rows(out, prefix, names, got, want, what) -> int:
    """A table row an output (``prefix`` its leading cells): bitwise or not, how many
    elements differ. Returns the failures."""
    failures = 0
    for name, a, b in zip(names, got, want):
        same = a.shape == b.shape and torch.equal(a, b)
        failures += not same
        n_diff = int((a != b).sum()) if a.shape == b.shape else a.numel()
        out(f"| {prefix} | {name} | {'yes' if same else 'no'} | {n_diff}/{a.numel()} | "
            f"{'ok' if same else 'FAIL: not bitwise ' + what} |")
    return failures


def _epilogue_step(fn, x, w, pos, ep, g):
    return _step(lambda x, w: fn(x, w, pos, ep), (x, w), g)


# (pack:d:ratio:coff, rope_dim, interleaved pairs, rotate): the Compressor's geometries on
# ragged packs with capacity padding, one below and one above the d=128 backward's
# large-pack variant, and a long window.
POOL_EPILOGUE_GRID = [("37+0+3+64+129+1+250:128:4:2", 64, True, True),
                      ("37+0+3+64+129+1+250:512:4:2", 64, True, False),
                      ("300+0+127+520:512:128:1", 64, False, False),
                      ("5000+0+3+2003:128:4:2", 64, False, True),
                      ("8192+8192+37:128:4:2", 128, True, True)]
# Which directions run in one kernel (the ops' epilogue_inside): the default, all, none.
KERNEL_CHOICES = (("default", None), ("one kernel", ("fwd", "bwd")), ("by parts", ()))


def run_pool_epilogue(device, dtypes=("bf16", "fp16", "fp32"), out=print,
                      grid=POOL_EPILOGUE_GRID) -> int:
    """compress_thd_fused(..., epilogue=) against compress_thd_fused followed by
    eager_epilogue on ``device``, each of KERNEL_CHOICES: the output and the gradients of
    kv, score, the APE and the norm weight bitwise. Returns the number of failing outputs."""
    from .. import epilogue, ops

    failures = 0
    out("| pooling + epilogue pack:d:ratio:coff | rope:interleaved:rotate | dtype | kernels | "
        "output | bitwise | differ | verdict |")
    out("|" + "---|" * 8)
    names = ("out", "dkv", "dscore", "dape", "dweight")
    for spec, rope, inter, rot in grid:
        shape = parse_shape(spec)
        ep = epilogue.Epilogue(rope_dim=rope, rope_interleaved=inter, rotate=rot)
        for dname in dtypes:
            dt = DTYPES[dname]
            kv, score, ape, cu, cuc, N, g = make_inputs(shape, dt, device, seed=3)
            gen = torch.Generator(device=device).manual_seed(4)
            w = 1 + 0.1 * torch.randn(shape.d, device=device, generator=gen)
            pos = epilogue.rope_positions(cuc, N, shape.ratio)
            kw = dict(ratio=shape.ratio, coff=shape.coff)

            def composed(kv, score, ape, w):
                pooled = ops.compress_thd_fused(kv, score, ape, cu, cuc, N, **kw)
                return epilogue.eager_epilogue(pooled, w, pos, ep)

            def one_op(kv, score, ape, w, inside=None):
                return ops.compress_thd_fused(kv, score, ape, cu, cuc, N, **kw, epilogue=ep,
                                              norm_weight=w, positions=pos,
                                              epilogue_inside=inside)

            want = _step(composed, (kv, score, ape, w), g)
            for label, inside in KERNEL_CHOICES:
                got = _step(lambda *t, inside=inside: one_op(*t, inside=inside),
                            (kv, score, ape, w), g)
                failures += _bitwise_rows(
                    out, f"{spec} | {rope}:{int(inter)}:{int(rot)} | {dname} | {label}", names,
                    got, want, "the pooling then the composition")
    return failures


def _step(fn, tensors, g):
    """``fn``'s output and its gradients in ``tensors`` (fresh leaves) for the output's
    gradient ``g`` (in the output's dtype)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    y = fn(*leaves)
    return (y.detach(), *torch.autograd.grad(y, leaves, g.to(y.dtype)))
