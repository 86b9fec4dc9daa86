"""compress_grouped on the fused kernels: the THD contract on grouped rows (GPU)."""

import pytest
import torch

from csa_compressor import compress_grouped
from csa_compressor.grouped import compress_grouped_reference
from test_fused_gpu import assert_forward_contract

pytestmark = pytest.mark.gpu

IDS = [0, 1, 2, 0, -1, -1, 0, 1, 2, 3] * 40 + [7, 8]


@pytest.mark.parametrize("ratio,coff,d,dtype", [(4, 2, 128, torch.bfloat16), (4, 2, 512, torch.bfloat16),
                                                (2, 2, 64, torch.float32), (128, 1, 512, torch.bfloat16)])
def test_grouped_fused_is_the_reference_bitwise(ratio, coff, d, dtype):
    ids = torch.tensor(IDS[: 64 if ratio == 128 else None], device="cuda")
    G = ids.numel()
    gen = torch.Generator("cuda").manual_seed(ratio + d)
    leaves = [torch.randn(G * ratio, coff * d, device="cuda", generator=gen).to(dtype),
              (2 * torch.randn(G * ratio, coff * d, device="cuda", generator=gen)).to(dtype),
              torch.randn(ratio, coff * d, device="cuda", generator=gen)]
    g = torch.randn(G, d, device="cuda", generator=gen).to(dtype)
    outs = []
    for fn in (compress_grouped, compress_grouped_reference):
        xs = [t.clone().requires_grad_(True) for t in leaves]
        out = fn(*xs, ids, ratio=ratio, coff=coff)
        outs.append((out.detach(), *torch.autograd.grad(out, xs, g)))
    fused, ref = outs
    assert_forward_contract(fused[0], ref[0])
    assert torch.equal(fused[1], ref[1]) and torch.equal(fused[2], ref[2])
    torch.testing.assert_close(fused[3], ref[3], rtol=0, atol=1e-3)


def test_kernel_level_grouped_is_the_op():
    from csa_compressor.grouped import pool_backward_grouped, pool_forward_grouped

    ids = torch.tensor(IDS, device="cuda")
    G, ratio, coff, d = ids.numel(), 4, 2, 128
    gen = torch.Generator("cuda").manual_seed(7)
    kv = torch.randn(G * ratio, coff * d, device="cuda", generator=gen).to(torch.bfloat16)
    score = torch.randn(G * ratio, coff * d, device="cuda", generator=gen).to(torch.bfloat16)
    ape = torch.randn(ratio, coff * d, device="cuda", generator=gen)
    g = torch.randn(G, d, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.full((G, d), float("nan"), device="cuda").to(torch.bfloat16)
    pool_forward_grouped(kv, score, ape, ids, out, ratio=ratio, coff=coff)
    grads = [torch.full_like(kv, float("nan")), torch.full_like(score, float("nan")),
             torch.full_like(ape, float("nan"))]
    pool_backward_grouped(kv, score, ape, ids, g, *grads, ratio=ratio, coff=coff)
    xs = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
    want = compress_grouped(*xs, ids, ratio=ratio, coff=coff)
    assert torch.equal(out, want.detach())
    for got, ref in zip(grads, torch.autograd.grad(want, xs, g)):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_grouped_offsets_kernel_is_the_torch_ops(dtype, ratio):
    """The one-launch offsets (kernels.grouped_offsets) give the torch ops' integers, for
    group counts around the CTA's 1024 threads and ids with no starts, all starts, halos and
    padding."""
    from csa_compressor.grouped import _torch_grouped_offsets
    from csa_compressor.kernels.grouped_offsets import grouped_offsets as launched

    gen = torch.Generator().manual_seed(ratio)
    cases = [torch.tensor(IDS), torch.zeros(5, dtype=torch.int64), torch.tensor([3, 4, 5]),
             torch.tensor([-1]), torch.tensor([0])]
    for G in (1023, 1024, 1025, 4099, 70001):
        ids = torch.randint(-2, 6, (G,), generator=gen)
        cases.append(ids)
    cases.append(torch.zeros(3000, dtype=torch.int64))
    for ids in cases:
        ids = ids.to(dtype).cuda()
        got = launched(ids, ratio)
        assert got is not None
        want = _torch_grouped_offsets(ids, ratio)
        for g, w in zip(got, want):
            assert g.dtype == torch.int32 and torch.equal(g, w), (ids.numel(), g, w)
