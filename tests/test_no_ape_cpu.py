"""``ape=None`` (no position bias, DeepSeek-V4.1) on every pooling entry: the same bits as
a zero ``ape``, forward and gradients, and no ``ape`` gradient to take."""

import pytest
import torch

from csa_compressor import (compress_grouped, compress_sbhd_fused, compress_thd_fused,
                            compressed_cu_seqlens, reference, streaming)
from csa_compressor.grouped import compress_grouped_reference


def _thd(dtype, ratio, coff, d=32):
    g = torch.Generator().manual_seed(ratio)
    big = ratio > 8  # every length past a few windows
    cu = torch.tensor([0, 130, 130, 300, 400] if big else [0, 7, 7, 30, 41], dtype=torch.int32)
    T = 404 if big else 44  # 4 sequences of T / 4 tokens for the SBHD view
    kv = torch.randn(T, coff * d, generator=g).to(dtype)
    score = (2 * torch.randn(T, coff * d, generator=g)).to(dtype)
    return kv, score, cu, compressed_cu_seqlens(cu, ratio)


def _both(f, kv, score, ape_shape):
    """f's output and kv / score gradients with ape None and with a zero ape."""
    outs = []
    for ape in (None, torch.zeros(ape_shape, requires_grad=True)):
        k, s = kv.clone().requires_grad_(), score.clone().requires_grad_()
        out = f(k, s, ape)
        gk, gs = torch.autograd.grad(out.float().square().sum(), (k, s))
        outs.append((out, gk, gs))
    return outs


@pytest.mark.parametrize("ratio,coff", [(2, 1), (4, 2), (1, 1), (128, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["fp32", "upstream", "fp32_explicit"])
def test_reference_thd_and_sbhd(ratio, coff, dtype, mode):
    kv, score, cu, cuc = _thd(dtype, ratio, coff)
    n = int(cuc[-1]) + 1
    a, b = _both(lambda k, s, ape: reference.compress_thd(k, s, ape, cu, cuc, n, ratio=ratio,
                                                         coff=coff, mode=mode),
                 kv, score, (ratio, kv.shape[1]))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    a, b = _both(lambda k, s, ape: reference.compress_sbhd(k.view(-1, 2, k.shape[1]), s.view(-1, 2, k.shape[1]),
                                                          ape, ratio=ratio, coff=coff, mode=mode),
                 kv, score, (ratio, kv.shape[1]))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("numerics", ["fp32", "eager"])
def test_fused_entries_take_no_ape(fused_on_cpu, numerics):
    ratio, coff = 2, 1
    kv, score, cu, cuc = _thd(torch.float32, ratio, coff)
    n = int(cuc[-1])
    shape = (ratio, kv.shape[1])
    for f in (lambda k, s, ape: compress_thd_fused(k, s, ape, cu, cuc, n, ratio=ratio, coff=coff,
                                                  numerics=numerics),
              lambda k, s, ape: compress_sbhd_fused(k.view(11, 4, -1), s.view(11, 4, -1), ape,
                                                   ratio=ratio, coff=coff, numerics=numerics)):
        a, b = _both(f, kv, score, shape)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    ids = torch.tensor([0, 1, 2, 0, 1, -1])
    kvg, sg = kv[:12], score[:12]
    a = compress_grouped(kvg, sg, None, ids, ratio=ratio, coff=coff)
    b = compress_grouped_reference(kvg, sg, torch.zeros(shape), ids, ratio=ratio, coff=coff)
    assert torch.equal(a, b)


def test_streaming_takes_no_ape():
    st1 = streaming.StreamState(1, 16, ratio=2, coff=1, dtype=torch.float32)
    st2 = streaming.StreamState(1, 16, ratio=2, coff=1, dtype=torch.float32)
    kv, sc = torch.randn(9, 16), torch.randn(9, 16)
    a = streaming.prefill(st1, kv, sc, None, [0, 9], [0])
    b = streaming.prefill(st2, kv, sc, torch.zeros(2, 16), [0, 9], [0])
    assert torch.equal(a.rows, b.rows) and a.rows.shape == (4, 16)


def test_a_non_tensor_ape_is_named():
    kv, score, cu, cuc = _thd(torch.float32, 2, 1)
    with pytest.raises(TypeError, match="ape: expected a torch.Tensor"):
        reference.compress_thd(kv, score, [[0.0]], cu, cuc, 3, ratio=2, coff=1)


@pytest.mark.compile
@pytest.mark.parametrize("arch,cfg", [("sm_90a", ("fwd", "float32", 2, 1, 512)),
                                      ("sm_90a", ("bwd", "float32", 2, 1, 512)),
                                      ("sm_100a", ("bwd", "bfloat16", 128, 1, 512)),
                                      ("sm_90a", ("bwd_large", "bfloat16", 4, 2, 128))],
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else c)
def test_the_kernels_without_an_ape_compile_as_the_design_with_one(arch, cfg):
    """ape=None's kernels (plan.KernelSpec.ape False): the same design (copies, staging,
    CTAs an SM), no spills or local memory; a backward stores less (no dape partials)."""
    pytest.importorskip("cutlass")
    from test_compile_cpu import probe

    with_ape = probe(arch, cfg)
    none = probe(arch, (*cfg, 0, 0, "fp32", "", 0, "noape"))
    assert none["local"] == 0 and all(s == 0 for s in none["spills"] + none["stack"]), none
    for key in ("coop", "async_copies_by_bytes", "target_ctas", "grid_ctas", "smem_asked",
                "pdl_wait_first", "vec", "chunk_slots"):
        assert none[key] == with_ape[key], (key, none[key], with_ape[key])
    loads = lambda i: sum(int(b) * n for b, n in i["loads_by_bytes"].items())  # noqa: E731
    assert loads(none) < loads(with_ape), (none["loads_by_bytes"], with_ape["loads_by_bytes"])
    if cfg[0] != "fwd":
        stores = lambda i: sum(int(b) * n for b, n in i["stores_by_bytes"].items())  # noqa: E731
        assert stores(none) < stores(with_ape), (none["stores_by_bytes"], with_ape["stores_by_bytes"])
