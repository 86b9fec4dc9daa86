"""The fused gradients against torch's own autograd of the eager fp32 region, on the GPU.

The region (tests/eager_region.py) is what a user writes with torch; ``dkv`` and
``dscore`` must equal its gradients bit for bit on every shape, ``dape`` within 1e-3 and
bitwise run to run. Packs are ragged (empty and short segments, tails), carry token
padding and static-capacity padding rows whose incoming gradient is non-zero.
"""

import pytest
import torch

from csa_compressor import compress_thd_fused, reference
from eager_region import eager_fp32_region
from packs import make_pack
from test_fused_gpu import RAGGED, _grads, assert_forward_contract

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _region(kv, score, ape, cu, cuc, N, *, ratio, coff):
    return eager_fp32_region(kv, score, ape, cu, N, ratio=ratio, coff=coff)


def _explicit(kv, score, ape, cu, cuc, N, *, ratio, coff):
    return reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff,
                                  mode="fp32_explicit")


# Every ratio 1-16 with both coff (bf16, d 128); every dtype at head_dim 33, 64, 96, 512,
# 576 on the production-like ratios; long windows in fp16 / fp32; windows that torch's
# softmax splits into lanes (d <= 64, 64 slots or more); ratio 128 coff 1 at d 128, 512.
GRID = ([(128, r, c, BF16) for r in range(1, 17) for c in (1, 2)]
        + [(d, r, 2, dt) for d in (33, 64, 96, 512, 576) for r in (2, 4) for dt in (BF16, FP16, FP32)]
        + [(d, 4, 1, dt) for d in (33, 96, 576) for dt in (BF16, FP32)]
        + [(64, r, c, dt) for r in (12, 16) for c in (1, 2) for dt in (FP16, FP32)]
        + [(33, r, c, BF16) for r in (3, 9, 16) for c in (1, 2)]
        + [(64, 128, 1, BF16), (33, 64, 1, FP32), (32, 32, 2, BF16), (8, 128, 2, FP32)]
        + [(128, 128, 1, BF16), (512, 128, 1, BF16), (512, 128, 1, FP32)])


@pytest.mark.parametrize("d,ratio,coff,dtype", GRID,
                         ids=[f"d{a}-r{b}-c{c}-{str(e)[6:]}" for a, b, c, e in GRID])
def test_gradients_are_torch_autograd_of_the_eager_region(d, ratio, coff, dtype):
    lens = RAGGED if ratio <= 16 else [3 * ratio + 5, ratio - 1, 0, 2 * ratio, 1]
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=5, extra_rows=3, seed=ratio * 10 + coff + d)
    g = torch.randn(N, d, device="cuda").to(dtype)  # non-zero on the padding rows too
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, ratio, coff, g)
    region = _grads(_region, kv, score, ape, cu, cuc, N, ratio, coff, g)
    assert_forward_contract(fused[0], region[0])
    assert torch.equal(fused[1], region[1]), "dkv differs from torch's autograd of the region"
    assert torch.equal(fused[2], region[2]), "dscore differs from torch's autograd of the region"
    torch.testing.assert_close(fused[3], region[3], rtol=0, atol=1e-3)
    again = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, ratio, coff, g)
    assert torch.equal(fused[3], again[3]), "dape not bitwise reproducible"
    # The package's references say the same: "fp32" is the region, "fp32_explicit" its
    # arithmetic spelled out.
    ref = _grads(lambda *a, **k: reference.compress_thd(*a, mode="fp32", **k), kv, score, ape,
                 cu, cuc, N, ratio, coff, g)
    explicit = _grads(_explicit, kv, score, ape, cu, cuc, N, ratio, coff, g)
    for i in (0, 1, 2):
        assert torch.equal(ref[i], region[i]) and torch.equal(explicit[i], region[i]), i


@pytest.mark.parametrize("ratio,coff,d", [(4, 2, 512), (4, 2, 128), (128, 1, 512)])
def test_large_pack_gradients_are_torch_autograd(ratio, coff, d):
    """A pack large enough for the large-pack backward variant at ratio 4 (and the long
    kernels' full grid at ratio 128)."""
    kv, score, ape, cu, cuc, N = make_pack([8192, 3000, 3, 0, 77], d, ratio, coff, dtype=BF16,
                                           device="cuda", pad_tokens=5, extra_rows=3, seed=d)
    g = torch.randn(N, d, device="cuda").to(BF16)
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, ratio, coff, g)
    region = _grads(lambda *a, **k: reference.compress_thd(*a, mode="fp32", **k), kv, score,
                    ape, cu, cuc, N, ratio, coff, g)
    assert_forward_contract(fused[0], region[0])
    assert torch.equal(fused[1], region[1]) and torch.equal(fused[2], region[2])
    torch.testing.assert_close(fused[3], region[3], rtol=0, atol=2e-3)


@pytest.mark.parametrize("d", [8, 32, 33, 34, 64, 96, 128, 512, 576])
@pytest.mark.parametrize("n", [4, 6, 8, 16, 32, 64, 128, 256])
def test_torch_sums_windows_in_the_order_the_kernels_do(n, d):
    """torch's CUDA ``x.sum(dim=1)`` of a contiguous fp32 ``(rows, n, d)`` tensor is the
    explicit reference's _output_sum (softmax_order.torch_sum_lanes, which the forward
    kernels follow) bit for bit, for row counts from one row up."""
    gen = torch.Generator(device="cuda").manual_seed(n * 1000 + d)
    for rows in (1, 2, 3, 5, 16, 31, 300):
        x = (torch.randn(rows, n, d, device="cuda", generator=gen)
             * torch.exp2(torch.randint(-20, 20, (rows, n, d), device="cuda", generator=gen).float()))
        assert torch.equal(x.sum(dim=1), reference._output_sum(x)), (rows, n, d)
