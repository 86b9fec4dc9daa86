"""kernels.rope_angles on the GPU: the THD positions and the fp32 angles are bitwise the
torch compositions they stand in for, over ragged packs (empty and sub-ratio segments,
capacity padding rows, a capped table, no segment at all), and corrupt row offsets stay
in bounds and terminate."""

import pytest
import torch

from csa_compressor import compressed_cu_seqlens
from csa_compressor import epilogue as E
from csa_compressor.epilogue import YaRN, rope_inv_freq
from csa_compressor.kernels import rope_angles

from packs import CORRUPT_OFFSETS

pytestmark = pytest.mark.gpu

LENS = [
    [],  # no segment: every row is padding of segment 0
    [3],  # one segment shorter than a block
    [8192],
    [8192, 0, 3, 1003, 15378],  # empty and sub-ratio segments
    [1] * 37 + [900],  # many segments without a row, then one
    [(i * 7919) % 700 for i in range(1, 2049)],  # 2048 ragged segments
]


@pytest.mark.parametrize("lens", LENS, ids=lambda v: f"{len(v)}segs")
@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("extra,max_seqlen", [(0, None), (7, None), (7, "max"), (50, 40)])
def test_thd_positions_are_torchs(lens, ratio, extra, max_seqlen):
    dev = torch.device("cuda")
    cu = torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(),
                      dtype=torch.int32, device=dev)
    cuc = compressed_cu_seqlens(cu, ratio)
    total = sum(n // ratio for n in lens) + extra
    if max_seqlen == "max":
        max_seqlen = max(lens, default=0)
    cap = None if max_seqlen is None else max(max_seqlen // ratio - 1, 0)
    got = rope_angles.positions(cuc, total, ratio, cap)
    want = E._torch_rope_positions(cuc, total, ratio, cap)
    assert got.dtype == want.dtype == torch.int64
    assert torch.equal(got, want)
    assert torch.equal(E.rope_positions(cuc, total, ratio, max_seqlen), want)


@pytest.mark.parametrize("cu,cuc", CORRUPT_OFFSETS)
def test_corrupt_row_offsets_stay_in_bounds(cu, cuc):
    """Offsets are never read on the host; whatever they hold, the segment the kernel
    reads lies inside them and it terminates (compute-sanitizer runs this file in the
    sanitize step)."""
    cuc = torch.tensor(cuc, dtype=torch.int32, device="cuda")
    pos = rope_angles.positions(cuc, 40, 4, None)
    torch.cuda.synchronize()
    assert pos.shape == (40,)


@pytest.mark.parametrize("pairs,theta,yarn", [
    (32, 160000.0, None), (32, 10000.0, YaRN(16.0, 65536, 32.0, 1.0)), (3, 10000.0, None),
    (1, 500.0, None), (256, 160000.0, None)])
def test_angles_are_torchs(pairs, theta, yarn):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(pairs)
    pos = torch.cat((torch.arange(0, 70000, 4, device=dev),
                     torch.randint(0, 2**40, (4099,), device=dev, generator=gen),
                     torch.tensor([2**53 - 1, -5, 0], device=dev)))
    inv = rope_inv_freq(2 * pairs, theta, yarn, device=dev)
    got = rope_angles.angles(pos, inv)
    want = (pos.to(torch.float64)[:, None] * inv[None, :]).to(torch.float32)
    assert torch.equal(got, want)
    for a, b in zip(E._cos_sin(pos, inv), E.torch_cos_sin(pos, inv)):
        assert torch.equal(a, b)
    # cosines and sines in the angles' launch: the once-a-device check found the kernel's
    # cosf / sinf to be torch's (on the H200 with torch 2.11), and they are here too
    cs = rope_angles.cos_sin(pos, inv)
    assert cs is not None and rope_angles._TRIG_AGREES[pos.device]
    assert torch.equal(cs[0], torch.cos(want)) and torch.equal(cs[1], torch.sin(want))


def test_the_module_takes_the_kernels_and_captures(monkeypatch):
    """The module's THD step reaches both kernels (positions; angles with their cosines and
    sines) and, warmed up, runs them inside a CUDA graph to the eager step's bits."""
    import csa_compressor as C

    calls = []
    for name in ("positions", "cos_sin"):
        fn = getattr(rope_angles, name)
        monkeypatch.setattr(rope_angles, name, lambda *a, _f=fn, _n=name: calls.append(_n) or _f(*a))
    torch.manual_seed(0)
    m = C.Compressor(512, 128, 4, rotate=True, device="cuda")
    cu = torch.tensor([0, 300, 300, 1030], dtype=torch.int32, device="cuda")
    x = torch.randn(1030, 512, device="cuda").bfloat16()
    want = m(x, cu, max_seqlen=730)[0]
    assert calls == ["positions", "cos_sin"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        got = m(x, cu, max_seqlen=730)[0]
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
