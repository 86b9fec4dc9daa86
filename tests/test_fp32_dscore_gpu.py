"""pool_backward into a float32 grad_score (bf16 / fp16 inputs): dscore before its
rounding. Rounded, it is the narrow grad_score bit for bit; every other output is the
same; rows no window reads are exact zeros."""

import pytest
import torch

from csa_compressor import kernel_api
from packs import make_pack

pytestmark = pytest.mark.gpu


def _backward(kv, score, ape, cu, cuc, g, ratio, coff, numerics, score_dtype):
    dkv = torch.full_like(kv, float("nan"))
    dsc = torch.full(kv.shape, float("nan"), dtype=score_dtype, device=kv.device)
    dape = torch.full_like(ape, float("nan"))
    kernel_api.pool_backward(kv, score, ape, cu, cuc, g, dkv, dsc, dape, ratio=ratio, coff=coff,
                             numerics=numerics)
    return dkv, dsc, dape


@pytest.mark.parametrize("numerics", ["eager", "fp32"])
@pytest.mark.parametrize("ratio,coff,d,dtype,lens", [
    (4, 2, 128, torch.bfloat16, [37, 0, 640, 129]),
    (4, 2, 128, torch.bfloat16, [8192, 8191, 3]),  # the large-pack backward
    (4, 2, 512, torch.float16, [300, 5, 1027]),
    (128, 1, 128, torch.bfloat16, [1300, 127, 2048]),
    (128, 1, 512, torch.bfloat16, [4100, 300]),
    (16, 1, 64, torch.bfloat16, [100, 333])])
def test_an_fp32_grad_score_is_dscore_before_its_rounding(numerics, ratio, coff, d, dtype, lens):
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=5, extra_rows=3)
    g = torch.randn(N, d, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(dtype)
    narrow = _backward(kv, score, ape, cu, cuc, g, ratio, coff, numerics, dtype)
    wide = _backward(kv, score, ape, cu, cuc, g, ratio, coff, numerics, torch.float32)
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[2], narrow[2])
    assert torch.equal(wide[1].to(dtype), narrow[1])
    assert torch.isfinite(wide[1]).all()  # every element written (the buffers start NaN)
    # not the narrow values widened: the fp32 values carry bits the rounding dropped
    assert not torch.equal(wide[1], narrow[1].float())


def test_an_fp32_grad_score_of_another_shape_or_device_is_refused():
    kv, score, ape, cu, cuc, N = make_pack([64], 128, 4, 2, dtype=torch.bfloat16, device="cuda")
    g = torch.zeros(N, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="grad_score"):
        kernel_api.pool_backward(kv, score, ape, cu, cuc, g, torch.empty_like(kv),
                                 torch.empty(64, 255, device="cuda"), torch.empty_like(ape),
                                 ratio=4, coff=2)
