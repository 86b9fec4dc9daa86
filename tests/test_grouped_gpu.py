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
