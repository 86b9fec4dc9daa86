"""softmax_order.ordered_sum, through which the kernels (unrolled at trace time, here on
numpy fp32 scalars) and the explicit reference (on tensors) sum, groups its terms as an
independent emulation of torch's CUDA softmax and reduce kernels does.
tests/test_torch_region_gpu.py checks the reference's grouping against torch's own sum on
the GPU."""

import numpy as np
import pytest
import torch

from csa_compressor import reference
from csa_compressor.softmax_order import (SUM_ACCUMULATORS, ordered_sum, torch_softmax_lanes,
                                          torch_sum_lanes, torch_sum_lanes_by_rows)


def _emulated(x, lanes, accumulators):
    """Sum over dim 1 of ``(N, K, d)``: lane j adds slots j, j + lanes, ... into
    ``accumulators`` in turn and meets them in order; the lanes meet level by level in a
    halving tree."""
    K = x.shape[1]
    part = []
    for j in range(min(lanes, K)):
        acc = []
        for m, k in enumerate(range(j, K, lanes)):
            if m < accumulators:
                acc.append(x[:, k])
            else:
                acc[m % accumulators] = acc[m % accumulators] + x[:, k]
        total = acc[0]
        for a in acc[1:]:
            total = total + a
        part.append(total)
    while len(part) > 1:
        half = len(part) // 2
        part = [part[j] + part[j + half] for j in range(half)]
    return part[0]


@pytest.mark.parametrize("n,d", [(18, 128), (64, 64), (128, 33), (128, 64), (256, 8), (256, 1),
                                 (64, 32), (128, 512)])
def test_kernel_sum_order_is_the_reference_order(n, d):
    lanes = torch_softmax_lanes(n, d)
    gen = torch.Generator().manual_seed(n + d)
    # Terms of very different magnitudes, so any regrouping changes the rounded sum.
    x = (torch.randn(64, n, d, generator=gen)
         * torch.exp2(torch.randint(-30, 30, (64, n, d), generator=gen).float()))
    want = _emulated(x, lanes, 1)[:, 0]  # (rows, n, d): the lanes follow d
    assert torch.equal(reference._window_sum(x)[:, 0], want)
    cols = x[:, :, 0].numpy()
    got = [ordered_sum(lambda k: np.float32(row[k]), n, lanes, 8) for row in cols]
    assert np.array_equal(np.array(got, dtype=np.float32), want.numpy())
    if lanes > 1:  # and the grouping matters: a serial sum gives other bits
        serial = [ordered_sum(lambda k: np.float32(row[k]), n, 1, 8) for row in cols]
        assert not np.array_equal(np.array(serial, dtype=np.float32), want.numpy())


def _spread(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen)
            * torch.exp2(torch.randint(-30, 30, shape, generator=gen).float()))


@pytest.mark.parametrize("rows,n,d", [(64, 8, 128), (64, 6, 65), (64, 16, 64), (64, 32, 96),
                                      (64, 128, 128), (64, 256, 65), (1, 128, 64), (2, 128, 32),
                                      (64, 256, 512), (3, 200, 34)])
def test_kernel_output_sum_is_the_reference_order(rows, n, d):
    """The forward's output sum (4 accumulators a lane, torch_sum_lanes lanes) as the
    explicit reference's _output_sum groups it, for the row count that decides the lanes."""
    lanes = torch_sum_lanes(rows, n, d)
    x = _spread((rows, n, d), rows * n + d)
    want = _emulated(x, lanes, SUM_ACCUMULATORS)[:, 0]
    assert torch.equal(reference._output_sum(x)[:, 0], want)
    got = [ordered_sum(lambda k: np.float32(row[k]), n, lanes, 8, SUM_ACCUMULATORS)
           for row in x[:, :, 0].numpy()]
    assert np.array_equal(np.array(got, dtype=np.float32), want.numpy())
    if n > SUM_ACCUMULATORS:  # the grouping matters: the serial sum gives other bits
        serial = [ordered_sum(lambda k: np.float32(row[k]), n, 1, 8)
                  for row in x[:, :, 0].numpy()]
        assert not np.array_equal(np.array(serial, dtype=np.float32), want.numpy())


# (rows, slots, head_dim) -> lanes, as torch 2.11's sum grouped them on the H200.
MEASURED = [((300, 8, 128), 1), ((8192, 63, 512), 1), ((3, 64, 64), 4), ((1, 64, 64), 1),
            ((1, 128, 64), 8), ((1, 128, 96), 8), ((7, 128, 128), 4), ((1, 128, 128), 4),
            ((300, 255, 65), 1), ((300, 256, 65), 16), ((8192, 512, 576), 4)]


@pytest.mark.parametrize("shape,lanes", MEASURED)
def test_torch_sum_lanes_as_measured(shape, lanes):
    assert torch_sum_lanes(*shape) == lanes


@pytest.mark.parametrize("n,d", [(8, 128), (64, 64), (128, 32), (256, 65), (256, 34), (64, 96)])
def test_lanes_by_rows_cover_every_row_count(n, d):
    ranges = torch_sum_lanes_by_rows(n, d)
    assert ranges[-1][0] is None
    for rows in range(1, 300):
        lanes = next(lanes for most, lanes in ranges if most is None or rows <= most)
        assert lanes == torch_sum_lanes(rows, n, d), rows
