"""kernels.column_sum against torch's own ``x.sum(0)`` on the GPU (bitwise: the kernels add in
the order softmax_order.torch_colsum_order models), and against that order replayed with
torch ops (softmax_order.colsum_in_order); the epilogue's backward takes it where its
once-a-geometry check finds it torch's."""

import pytest
import torch
from csa_compressor import epilogue_op

from csa_compressor import Epilogue, apply_epilogue, epilogue
from csa_compressor.kernels import column_sum
from csa_compressor.kernels.hardware import sm_count, threads_per_sm
from csa_compressor.softmax_order import colsum_in_order, torch_colsum_order

pytestmark = pytest.mark.gpu


def _rows(n, d, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, d, device="cuda", generator=gen)
            * (10 * torch.rand(n, 1, device="cuda", generator=gen)))


# one thread a column (rows < 16 lanes' worth), one CTA of lanes, many CTAs with a
# partial last round, the Compressor's 6144 rows, a CTA count past the lanes' multiples
@pytest.mark.parametrize("rows", [1, 16, 63, 64, 100, 192, 1000, 1024, 6144, 6150, 24576])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 512])
def test_column_sum_is_torchs_sum_bitwise(rows, d):
    x = _rows(rows, d, rows * 7 + d)
    dev = x.device
    lanes, ctas = torch_colsum_order(rows, d, sm_count(dev.index), threads_per_sm(dev.index))
    got = column_sum.column_sum(x, lanes, ctas)
    assert got.shape == (d,) and got.dtype == torch.float32
    assert torch.equal(got, colsum_in_order(x, lanes, ctas)), (lanes, ctas)
    assert torch.equal(got, x.sum(0)), (lanes, ctas)


def test_signed_zeros_and_infinities_as_torch():
    x = torch.zeros(6144, 128, device="cuda")
    x[:, 1] = -0.0
    x[5, 2], x[4000, 3], x[17, 4], x[18, 4] = float("inf"), float("-inf"), float("inf"), float("-inf")
    dev = x.device
    lanes, ctas = torch_colsum_order(6144, 128, sm_count(dev.index), threads_per_sm(dev.index))
    got, want = column_sum.column_sum(x, lanes, ctas), x.sum(0)
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(got[fin], want[fin]) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("rows,d", [(6144, 128), (6144, 512), (192, 512), (40, 128)])
def test_the_epilogue_backward_takes_the_kernel_on_this_gpu(rows, d):
    """The norm weight's gradient through the node is the eager composition's, and the
    geometry's check found the kernel torch's (so the kernel ran, not torch's sum)."""
    ep = Epilogue(rope_dim=64, rotate=d == 128)
    x = _rows(rows, d, 3).bfloat16().requires_grad_(True)
    w = (1 + 0.1 * _rows(1, d, 4)[0]).bfloat16().requires_grad_(True)
    pos = torch.arange(rows, device="cuda") * 4
    g = _rows(rows, d, 5).bfloat16()
    got = torch.autograd.grad(apply_epilogue(x, w, pos, ep), (x, w), g)
    want = torch.autograd.grad(epilogue.eager_epilogue(x, w, pos, ep), (x, w), g)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    dev = x.device
    lanes, ctas = torch_colsum_order(rows, d, sm_count(dev.index), threads_per_sm(dev.index))
    assert epilogue_op._COLSUM_AGREES.get((dev, d, lanes, ctas)) is True
