"""The fused kernels with ``numerics="eager"`` on the GPU: Megatron-LM's eager rounding (the
softmax weights and each product in the input dtype) against the "upstream" reference,
torch's autograd of that region, on ragged packs with padding rows whose incoming gradient
is non-zero: dkv and dscore bit for bit, the output within the forward contract, dape
within 1e-3; the packed and SBHD layouts and torch.compile give the same bits."""

import pytest
import torch

from csa_compressor import (compress_sbhd_fused, compress_thd_fused, compress_thd_fused_packed,
                            reference)
from packs import make_pack
from test_fused_gpu import RAGGED, _grads, assert_forward_contract

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# The production shapes (ratio 4 coff 2, ratio 128 coff 1 at head_dim 128 and 512), every
# kernel family (short windows, long windows, the odd head_dim that loads unstaged, the
# large-pack backward), fp16 and fp32 (where the rounding is the identity).
GRID = [(512, 4, 2, BF16), (128, 4, 2, BF16), (128, 4, 1, BF16), (512, 128, 1, BF16),
        (128, 128, 1, BF16), (33, 4, 2, BF16), (64, 8, 2, FP16), (64, 128, 1, FP16),
        (96, 16, 2, BF16), (128, 4, 2, FP32)]


def _eager(*a, **k):
    return compress_thd_fused(*a, numerics="eager", **k)


def _upstream(*a, **k):
    return reference.compress_thd(*a, mode="upstream", **k)


@pytest.mark.parametrize("d,ratio,coff,dtype", GRID,
                         ids=[f"d{a}-r{b}-c{c}-{str(e)[6:]}" for a, b, c, e in GRID])
def test_eager_numerics_are_torch_autograd_of_the_upstream_region(d, ratio, coff, dtype):
    lens = RAGGED if ratio <= 16 else [3 * ratio + 5, ratio - 1, 0, 2 * ratio, 1]
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=5, extra_rows=3, seed=ratio * 7 + coff + d)
    g = torch.randn(N, d, device="cuda").to(dtype)
    fused = _grads(_eager, kv, score, ape, cu, cuc, N, ratio, coff, g)
    region = _grads(_upstream, kv, score, ape, cu, cuc, N, ratio, coff, g)
    assert_forward_contract(fused[0], region[0])
    assert torch.equal(fused[1], region[1]), "dkv differs from the upstream region's"
    assert torch.equal(fused[2], region[2]), "dscore differs from the upstream region's"
    torch.testing.assert_close(fused[3], region[3], rtol=0, atol=1e-3)
    fp32 = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, ratio, coff, g)
    if dtype == FP32:  # nothing to round: the two numerics are one
        assert all(torch.equal(a, b) for a, b in zip(fused, fp32))
    else:  # the flag reaches the kernels in both directions
        assert not torch.equal(fused[0], fp32[0])
        assert not torch.equal(fused[1], fp32[1])
        assert not torch.equal(fused[2], fp32[2])


@pytest.mark.parametrize("ratio,coff,d", [(4, 2, 512), (128, 1, 128)])
def test_eager_numerics_on_the_packed_and_sbhd_layouts(ratio, coff, d):
    """One projection's [kv | score] and (S, B, ...) inputs read in place: the bits of the
    THD op on the same rows."""
    kv, score, ape, cu, cuc, N = make_pack(RAGGED if ratio == 4 else [600, 0, 300], d, ratio,
                                           coff, dtype=BF16, device="cuda", extra_rows=2, seed=5)
    g = torch.randn(N, d, device="cuda").to(BF16)
    want = _grads(_eager, kv, score, ape, cu, cuc, N, ratio, coff, g)
    kvs = torch.cat([kv, score], 1).requires_grad_(True)
    a = ape.clone().requires_grad_(True)
    out = compress_thd_fused_packed(kvs, a, cu, cuc, N, ratio=ratio, coff=coff, numerics="eager")
    out.backward(g)
    W = kv.shape[1]
    assert torch.equal(out, want[0])
    assert torch.equal(kvs.grad[:, :W], want[1]) and torch.equal(kvs.grad[:, W:], want[2])
    assert torch.equal(a.grad, want[3])

    S, B = 4 * ratio + 3, 3
    x = torch.randn(S, B, 2 * coff * d, device="cuda").to(BF16)
    kv3, sc3 = x[..., :coff * d].contiguous(), x[..., coff * d:].contiguous()
    sb = compress_sbhd_fused(kv3, sc3, ape, ratio=ratio, coff=coff, numerics="eager")
    ref = reference.compress_sbhd(kv3, sc3, ape, ratio=ratio, coff=coff, mode="upstream")
    assert_forward_contract(sb.reshape(-1, d), ref.reshape(-1, d))


def test_eager_numerics_under_torch_compile():
    kv, score, ape, cu, cuc, N = make_pack(RAGGED, 128, 4, 2, dtype=BF16, device="cuda", seed=9)
    g = torch.randn(N, 128, device="cuda").to(BF16)
    compiled = torch.compile(_eager, fullgraph=True)
    got = _grads(compiled, kv, score, ape, cu, cuc, N, 4, 2, g)
    want = _grads(_eager, kv, score, ape, cu, cuc, N, 4, 2, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
