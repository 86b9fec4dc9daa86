"""Packs whose row walks cross many segments inside one CTA, and offsets a caller got wrong.

The many-segment packs exercise what a single ragged pack does not: cached row walks that
leave their segment every few rows, warp segment searches of several rounds (2500
segments), capacity padding and cut-off rows, on buffers pre-filled with NaN so that
every element must be written.
"""

import pytest
import torch

from csa_compressor.kernel_api import pool_backward, pool_forward
from packs import CORRUPT_OFFSETS, make_pack
from test_fused_gpu import _grads, _kernel_level, _ref, assert_forward_contract

pytestmark = pytest.mark.gpu


def _many_segments(seed, n=400, longest=60):
    """n segments of 0..longest tokens: row walks cross segments inside a CTA, and the
    segment searches need several rounds (2500: three of the warp search)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, longest + 1, (n,), generator=gen).tolist()


CASES = [  # (lens, head_dim, ratio, coff, dtype, extra rows: capacity padding or, < 0, a cut)
    ([37, 0, 3, 64, 129, 1, 8, 250], 128, 4, 2, torch.bfloat16, 3),
    ("many", 128, 4, 2, torch.bfloat16, 5),
    ("many", 512, 4, 2, torch.bfloat16, 0),
    ("many", 128, 4, 2, torch.bfloat16, -7),
    ("many", 65, 4, 1, torch.bfloat16, 2),
    ("many", 64, 8, 2, torch.float32, 1),
    ("many", 64, 3, 2, torch.float16, 0),
    ("many", 128, 1, 1, torch.bfloat16, 4),
    ([8192, 1000, 3], 512, 4, 2, torch.bfloat16, 0),
    ("many2500", 128, 4, 2, torch.bfloat16, 2),
    ("many", 512, 128, 1, torch.bfloat16, 3),  # ratio 128: the slot-parallel kernels
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_many_segment_packs_match_the_reference(case):
    lens, d, ratio, coff, dtype, extra = CASES[case]
    if lens == "many":
        lens = _many_segments(case, longest=60 if ratio <= 8 else 400)
    elif lens == "many2500":
        lens = _many_segments(case, n=2500, longest=12)
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=5, extra_rows=max(extra, 0), seed=case)
    N = max(0, N + min(extra, 0))
    g = torch.randn(N, d, device="cuda").to(dtype)
    fused = _kernel_level(kv, score, ape, cu, cuc, N, ratio, coff, g, float("nan"))
    if extra < 0:  # a capacity cut below the true row count is malformed: NaN by default
        assert fused[0].isnan().all() and fused[3].isnan().all()
        return
    ref = _grads(_ref("fp32"), kv, score, ape, cu, cuc, N, ratio, coff, g)
    for name, f in zip(("out", "dkv", "dscore", "dape"), fused):
        assert not torch.isnan(f).any(), f"{name}: elements left unwritten"
    assert_forward_contract(fused[0], ref[0])
    assert torch.equal(fused[1], ref[1]), "dkv not bitwise equal to the fp32 reference"
    assert torch.equal(fused[2], ref[2]), "dscore not bitwise equal to the fp32 reference"
    torch.testing.assert_close(fused[3], ref[3], rtol=0, atol=1e-3)


# Offsets a caller got wrong (packs.CORRUPT_OFFSETS): only staying in bounds and
# terminating count. T = 300 tokens, N = 40 rows.
GUARD = 64  # rows of sentinel before and after every buffer the kernels write


def _guarded(rows, width, dtype, fill):
    buf = torch.full((rows + 2 * GUARD, width), fill, dtype=dtype, device="cuda")
    return buf, buf[GUARD:GUARD + rows]


@pytest.mark.parametrize("ratio,coff", [(4, 2), (1, 1), (3, 2), (128, 1)])
@pytest.mark.parametrize("offsets", range(len(CORRUPT_OFFSETS)))
def test_corrupt_offsets_stay_in_bounds_and_terminate(ratio, coff, offsets):
    T, N, d, dt = 300, 40, 64, torch.bfloat16
    W = coff * d
    gen = torch.Generator(device="cuda").manual_seed(offsets)
    kv = torch.randn(T, W, device="cuda", generator=gen).to(dt)
    score = torch.randn(T, W, device="cuda", generator=gen).to(dt)
    ape = torch.randn(ratio, W, device="cuda", generator=gen)
    cu = torch.tensor(CORRUPT_OFFSETS[offsets][0], dtype=torch.int32, device="cuda")
    cuc = torch.tensor(CORRUPT_OFFSETS[offsets][1], dtype=torch.int32, device="cuda")
    g = torch.randn(N, d, device="cuda", generator=gen).to(dt)
    sentinel = 3.0
    out_buf, out = _guarded(N, d, dt, sentinel)
    dkv_buf, dkv = _guarded(T, W, dt, sentinel)
    dsc_buf, dsc = _guarded(T, W, dt, sentinel)
    dape = torch.empty_like(ape)
    pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)
    pool_backward(kv, score, ape, cu, cuc, g, dkv, dsc, dape, ratio=ratio, coff=coff)
    torch.cuda.synchronize()  # an illegal address or a hang would surface here
    for name, buf in (("out", out_buf), ("dkv", dkv_buf), ("dscore", dsc_buf)):
        for guard in (buf[:GUARD], buf[-GUARD:]):
            assert (guard == sentinel).all(), f"{name}: a write landed outside the buffer"


def _malformed(case, cu, cuc, N, ratio):
    from csa_compressor.layout import compressed_cu_seqlens

    cu, cuc = cu.clone(), cuc.clone()
    if case == "decreasing":
        cu[1], cu[2] = cu[2], cu[1]
    elif case == "first":
        cu[0] = 5
    elif case == "past_T":
        cu[-1] += 4
    elif case == "other_ratio":
        cuc = compressed_cu_seqlens(cu, 2 * ratio)
    elif case == "capacity":
        N = int(cuc[-1]) - 1
    return cu, cuc, N


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1)])
@pytest.mark.parametrize("case", ["decreasing", "first", "past_T", "other_ratio", "capacity"])
def test_malformed_offsets_give_nan_by_default(ratio, coff, case):
    """The default path (no check_offsets, no host sync): the fused op, forward and
    backward, eager and replayed in a CUDA graph, and the reference on the GPU give NaN
    for a malformed pack; the same pack well formed gives finite rows."""
    from csa_compressor import compress_thd_fused, reference

    d = 64
    kv, score, ape, cu, cuc, N = make_pack([5 * ratio + 3, 2 * ratio, 7 * ratio + 1], d, ratio, coff,
                                           dtype=torch.bfloat16, device="cuda")
    bad_cu, bad_cuc, bad_N = _malformed(case, cu, cuc, N, ratio)
    for op in (compress_thd_fused, reference.compress_thd):
        good = op(kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff)
        assert torch.isfinite(good).all()
        a = ape.clone().requires_grad_(True)
        k = kv.clone().requires_grad_(True)
        out = op(k, score, a, bad_cu, bad_cuc, bad_N, ratio=ratio, coff=coff)
        assert out.isnan().any(), (op.__name__, case)
        if op is compress_thd_fused and case in ("other_ratio", "capacity"):
            assert out.isnan().all()  # offsets in range: every row read the NaN copy
        out.float().sum().backward()
        assert a.grad.isnan().all() and k.grad.isnan().any(), (op.__name__, case)
    # captured with well-formed offsets, replayed with malformed ones copied in
    s_cu, s_cuc = cu.clone(), cuc.clone()
    compress_thd_fused(kv, score, ape, s_cu, s_cuc, N, ratio=ratio, coff=coff)  # compile first
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = compress_thd_fused(kv, score, ape, s_cu, s_cuc, N, ratio=ratio, coff=coff)
    g.replay()
    assert torch.isfinite(out).all()
    if case != "capacity":
        s_cu.copy_(bad_cu), s_cuc.copy_(bad_cuc)
        g.replay()
        assert out.isnan().any(), case
