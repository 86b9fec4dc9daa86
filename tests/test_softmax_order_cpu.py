"""The long kernels' window sums group their terms as the explicit reference does, which
is how torch's CUDA softmax groups them (CPU: the kernels' sum is unrolled at trace time,
so it can run here on numpy fp32 scalars)."""

import numpy as np
import pytest
import torch

from csa_compressor import reference
from csa_compressor.softmax_order import torch_softmax_lanes

pool_long = pytest.importorskip("csa_compressor.kernels.pool_long")


@pytest.mark.parametrize("n,d", [(18, 128), (64, 64), (128, 33), (128, 64), (256, 8), (256, 1),
                                 (64, 32), (128, 512)])
def test_kernel_sum_order_is_the_reference_order(n, d):
    lanes = torch_softmax_lanes(n, d)
    gen = torch.Generator().manual_seed(n + d)
    # Terms of very different magnitudes, so any regrouping changes the rounded sum.
    x = (torch.randn(64, n, d, generator=gen)
         * torch.exp2(torch.randint(-30, 30, (64, n, d), generator=gen).float()))
    want = reference._window_sum(x)[:, 0]  # (rows, n, d): the lanes follow d
    cols = x[:, :, 0].numpy()
    got = [pool_long.ordered_sum(lambda k: np.float32(row[k]), n, lanes, 8) for row in cols]
    assert np.array_equal(np.array(got, dtype=np.float32), want.numpy())
    if lanes > 1:  # and the grouping matters: a serial sum gives other bits
        serial = [pool_long.ordered_sum(lambda k: np.float32(row[k]), n, 1, 8) for row in cols]
        assert not np.array_equal(np.array(serial, dtype=np.float32), want.numpy())
