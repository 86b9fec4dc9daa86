"""kernels.offsets on the GPU: compressed_cu_seqlens' one launch gives the integers of the
torch ops it stands in for, on ragged packs (empty and sub-ratio segments, more segments
than the CTA has threads, none at all) and on corrupt offsets alike (decreasing, negative,
sums that wrap int32); the kill switch keeps the torch ops."""

import pytest
import torch

from csa_compressor import layout
from csa_compressor.kernels import offsets

from packs import CORRUPT_OFFSETS

pytestmark = pytest.mark.gpu

LENS = [
    [],
    [3],
    [8192, 0, 3, 1003, 15378],
    [1] * 37 + [900],
    [(i * 7919) % 700 for i in range(1, 2049)],  # 2 segments a thread
    [(i * 104729) % 5000 for i in range(1, 5001)],  # 5 a thread, the last threads idle
]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(),
                        dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("lens", LENS, ids=lambda v: f"{len(v)}segs")
@pytest.mark.parametrize("ratio", [1, 3, 4, 128])
def test_offsets_are_torchs(lens, ratio):
    cu = _cu(lens)
    got = offsets.compressed_offsets(cu, ratio)
    want = layout._torch_compressed_cu_seqlens(cu, ratio)
    assert got.dtype == want.dtype == torch.int32
    assert torch.equal(got, want)
    assert torch.equal(layout.compressed_cu_seqlens(cu, ratio), want)


@pytest.mark.parametrize("cu", [c for c, _ in CORRUPT_OFFSETS]
                         + [[0, 2**31 - 1, -2**31, 2**31 - 1, 0, 2**31 - 1, 2**31 - 1]])
@pytest.mark.parametrize("ratio", [1, 4])
def test_corrupt_offsets_give_torchs_integers(cu, ratio):
    cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
    assert torch.equal(offsets.compressed_offsets(cu, ratio),
                       layout._torch_compressed_cu_seqlens(cu, ratio))


def test_the_kill_switch_keeps_the_torch_ops(monkeypatch):
    monkeypatch.setenv("CSA_COMPRESSOR_FUSED", "0")
    monkeypatch.setattr(offsets, "compressed_offsets", lambda *a: pytest.fail("kernel ran"))
    cu = _cu([5, 9, 0, 13])
    assert torch.equal(layout.compressed_cu_seqlens(cu, 4),
                       layout._torch_compressed_cu_seqlens(cu, 4))
