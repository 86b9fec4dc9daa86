"""``ape=None`` on the GPU: the kernels without an APE (no APE read, no dape partials or
sum) give the bits of a zero ``ape`` on every entry, forward and backward, eager and in a
CUDA graph; malformed offsets still give NaN."""

import pytest
import torch

from csa_compressor import (Epilogue, compress_grouped, compress_sbhd_fused,
                            compress_sbhd_fused_packed, compress_thd_fused,
                            compress_thd_fused_packed, kernel_api)
from packs import make_pack

pytestmark = pytest.mark.gpu

CASES = [(2, 1, 512, torch.float32, [4096, 4096, 33]), (4, 2, 128, torch.bfloat16, [8192, 8191, 3]),
         (4, 2, 512, torch.bfloat16, [300, 0, 1027]), (128, 1, 512, torch.bfloat16, [4100, 300]),
         (1, 1, 128, torch.float16, [77, 5])]
IDS = ["-".join(map(str, c[:4])) for c in CASES]


def _both(fn, leaves, shape):
    """fn's output and leaf gradients with ape None and with a zero ape."""
    outs = []
    for ape in (None, torch.zeros(shape, device="cuda", requires_grad=True)):
        xs = [t.clone().requires_grad_(True) for t in leaves]
        out = fn(*xs, ape)
        g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
        outs.append((out.detach(), *torch.autograd.grad(out, xs, g.to(out.dtype))))
    return outs


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("numerics", ["fp32", "eager"])
@pytest.mark.parametrize("ratio,coff,d,dtype,lens", CASES, ids=IDS)
def test_thd_and_packed_without_an_ape_are_a_zero_ape_bitwise(numerics, ratio, coff, d, dtype, lens):
    kv, score, _, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                         pad_tokens=3, extra_rows=2)
    shape = (ratio, coff * d)
    _equal(*_both(lambda k, s, a: compress_thd_fused(k, s, a, cu, cuc, N, ratio=ratio, coff=coff,
                                                     numerics=numerics), [kv, score], shape))
    kvs = torch.cat([kv, score], 1)
    _equal(*_both(lambda x, a: compress_thd_fused_packed(x, a, cu, cuc, N, ratio=ratio, coff=coff,
                                                         numerics=numerics), [kvs], shape))


@pytest.mark.parametrize("ratio,coff,d,dtype", [(2, 1, 512, torch.float32), (4, 2, 128, torch.bfloat16),
                                                (128, 1, 512, torch.bfloat16)])
def test_sbhd_grouped_and_epilogue_without_an_ape_are_a_zero_ape_bitwise(ratio, coff, d, dtype):
    gen = torch.Generator("cuda").manual_seed(ratio)
    S, B, W = 4 * ratio + 3, 3, coff * d
    kv = torch.randn(S, B, W, device="cuda", generator=gen).to(dtype)
    score = torch.randn(S, B, W, device="cuda", generator=gen).to(dtype)
    shape = (ratio, W)
    _equal(*_both(lambda k, s, a: compress_sbhd_fused(k, s, a, ratio=ratio, coff=coff), [kv, score], shape))
    _equal(*_both(lambda x, a: compress_sbhd_fused_packed(x, a, ratio=ratio, coff=coff),
                  [torch.cat([kv, score], 2)], shape))
    ids = torch.tensor([0, 1, 2, 0, -1, 0, 1], device="cuda")
    G = ids.numel()
    kg, sg = kv.reshape(-1, W)[:G * ratio], score.reshape(-1, W)[:G * ratio]
    _equal(*_both(lambda k, s, a: compress_grouped(k, s, a, ids, ratio=ratio, coff=coff), [kg, sg], shape))
    kt, st = kv.reshape(-1, W), score.reshape(-1, W)
    cu = torch.tensor([0, 5 * ratio + 1, kt.shape[0]], dtype=torch.int32, device="cuda")
    w = torch.randn(d, device="cuda", generator=gen)
    ep = Epilogue(rope_dim=64)
    _equal(*_both(lambda k, s, a: compress_thd_fused(k, s, a, cu, None, kt.shape[0] // ratio,
                                                     ratio=ratio, coff=coff, epilogue=ep,
                                                     norm_weight=w), [kt, st], shape))


def test_the_kernel_level_api_takes_no_ape_and_no_ape_gradient():
    ratio, coff, d = 2, 1, 512
    kv, score, ape, cu, cuc, N = make_pack([4096, 77], d, ratio, coff, device="cuda")
    zero = torch.zeros_like(ape)
    g = torch.randn(N, d, device="cuda")
    outs = []
    for a in (None, zero):
        out = torch.full((N, d), float("nan"), device="cuda")
        kernel_api.pool_forward(kv, score, a, cu, cuc, out, ratio=ratio, coff=coff)
        dkv, dsc = torch.full_like(kv, float("nan")), torch.full_like(score, float("nan"))
        kernel_api.pool_backward(kv, score, a, cu, cuc, g, dkv, dsc,
                                 None if a is None else torch.empty_like(ape), ratio=ratio, coff=coff)
        outs.append((out, dkv, dsc))
    _equal(*outs)
    with pytest.raises(ValueError, match="grad_ape"):
        kernel_api.pool_backward(kv, score, None, cu, cuc, g, dkv, dsc, torch.empty_like(ape),
                                 ratio=ratio, coff=coff)


@pytest.mark.parametrize("ratio,coff", [(2, 1), (128, 1)])
def test_malformed_offsets_without_an_ape_give_nan_also_replayed(ratio, coff):
    d = 64
    kv, score, _, cu, cuc, N = make_pack([5 * ratio + 3, 2 * ratio], d, ratio, coff,
                                         dtype=torch.bfloat16, device="cuda")
    k = kv.clone().requires_grad_(True)
    bad = cu.clone()
    bad[0] = 3
    out = compress_thd_fused(k, score, None, bad, cuc, N, ratio=ratio, coff=coff)
    out.float().sum().backward()
    assert out.isnan().all() and k.grad.isnan().any()
    s_cu = cu.clone()
    compress_thd_fused(kv, score, None, s_cu, cuc, N, ratio=ratio, coff=coff)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compress_thd_fused(kv, score, None, s_cu, cuc, N, ratio=ratio, coff=coff)
    graph.replay()
    assert torch.isfinite(out).all()
    s_cu.copy_(bad)
    graph.replay()
    assert out.isnan().all()
