"""softmax_order.ordered_sum, through which the kernels (unrolled at trace time, here on
numpy fp32 scalars) and the explicit reference (on tensors) sum, groups its terms as an
independent emulation of torch's CUDA softmax and reduce kernels does.
tests/test_torch_region_gpu.py checks the reference's grouping against torch's own sum on
the GPU."""

import numpy as np
import pytest
import torch

from csa_compressor import reference
from csa_compressor.softmax_order import (SUM_ACCUMULATORS, colsum_in_order, ordered_sum,
                                          torch_colsum_order, torch_softmax_lanes,
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


# torch_colsum_order as tools/torch_colsum_order_probe.py measured it on the H200 (132 SMs,
# 2048 threads an SM; torch 2.11): (rows, head_dim) -> (lanes, ctas)
@pytest.mark.parametrize("shape,order", [
    ((16, 64), (1, 1)), ((100, 64), (1, 1)), ((192, 64), (8, 1)), ((1024, 96), (8, 1)),
    ((6144, 64), (8, 48)), ((6150, 96), (8, 49)), ((24576, 64), (8, 192)),
    ((63, 128), (1, 1)), ((64, 128), (4, 1)), ((1000, 512), (4, 1)), ((1024, 128), (4, 16)),
    ((6144, 128), (4, 96)), ((6150, 512), (4, 97)), ((24576, 512), (4, 384))])
def test_torch_colsum_order_as_measured(shape, order):
    assert torch_colsum_order(*shape, 132, 2048) == order


def test_torch_colsum_order_rejects_what_it_does_not_model():
    for shape in ((0, 64), (16, 0), (16, 66)):
        with pytest.raises(ValueError, match="torch_colsum_order"):
            torch_colsum_order(*shape, 132, 2048)


@pytest.mark.parametrize("rows", [1, 5, 64, 200, 1000, 6150])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_colsum_in_order_adds_every_row_once(rows, head_dim):
    """On small integers every order gives the exact sum: a row skipped or added twice
    would show, at every order the GPU gives these shapes."""
    gen = torch.Generator().manual_seed(rows + head_dim)
    x = torch.randint(-8, 9, (rows, head_dim), generator=gen).float()
    lanes, ctas = torch_colsum_order(rows, head_dim, 132, 2048)
    assert torch.equal(colsum_in_order(x, lanes, ctas), x.sum(0))
    for lanes, ctas in ((1, 1), (4, 1), (8, 3), (4, 97)):
        assert torch.equal(colsum_in_order(x, lanes, ctas), x.sum(0)), (lanes, ctas)
