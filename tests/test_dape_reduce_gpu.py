"""The dape partials' reduction (kernels/dape_reduce.py) against its fixed order replayed
with torch on the CPU: bitwise, since fp32 additions in one order round the same anywhere."""

import pytest
import torch

from csa_compressor.kernels.tuning import current
from csa_compressor.kernels.compile import get_kernel

pytestmark = pytest.mark.gpu


def fixed_order_sum(work: torch.Tensor, lanes: int) -> torch.Tensor:
    """Row lane y sums rows y, y + lanes, ... in turn; then the lanes' sums in lane order."""
    P, C = work.shape
    sums = []
    for y in range(lanes):
        acc = torch.zeros(C, dtype=torch.float32)
        for r in range(y, P, lanes):
            acc = acc + work[r]
        sums.append(acc)
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return total


# (ratio, coff, head_dim): 16-byte vectors (C = 1024, 260), 8-byte (C = 2*3*7 = 42),
# scalars (C = 195), fewer column vectors than a CTA's lanes (C = 28), ratio 128's many
# columns (C = 16,384), which also have the wide layout (REDUCE_WIDE_*)
SHAPES = [(4, 2, 128), (4, 1, 65), (3, 2, 7), (3, 1, 65), (2, 2, 7), (128, 1, 128)]
CASES = [(r, c, d, layout) for r, c, d in SHAPES
         for layout in (("dape", "dape_wide") if current().dape_has_wide(r * c * d) else ("dape",))]


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 65, 257, 1000])
@pytest.mark.parametrize("ratio,coff,d,layout", CASES)
def test_reduction_is_the_fixed_order_sum(ratio, coff, d, layout, rows):
    C = ratio * coff * d
    gen = torch.Generator().manual_seed(rows * 7 + C)
    # Wide exponent spread, so a different order would round differently.
    work = torch.randn(rows, C, generator=gen) * torch.exp2(torch.randint(-20, 20, (rows, C), generator=gen).float())
    c = get_kernel(layout, torch.device("cuda", torch.cuda.current_device()), torch.bfloat16,
                   ratio, coff, d)
    kernel, fn = c.kernel, c.fn
    assert kernel.row_lanes == (current().REDUCE_WIDE_ROW_LANES if layout == "dape_wide"
                                else current().REDUCE_ROW_LANES)
    out = torch.full((1, C), float("nan"), device="cuda")
    fn(work.cuda(), out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu()[0], fixed_order_sum(work, kernel.row_lanes))
