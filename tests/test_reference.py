"""The three plain-PyTorch references against the independent naive oracle (CPU)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from csa_compressor import reference
from eager_region import eager_fp32_region
from naive import naive_forward_backward
from packs import make_pack

# name: (lens, d, ratio, coff, pad_tokens, extra_rows)
BOUNDARY_CASES = {
    "first_block_of_each_segment": ([8, 12, 4], 3, 4, 2, 0, 0),
    "empty_segment": ([8, 0, 9, 0], 3, 4, 2, 0, 0),
    "segment_shorter_than_ratio": ([3, 8, 1], 2, 4, 2, 0, 0),
    "tails": ([9, 10, 11], 2, 4, 2, 0, 0),
    "token_padding_beyond_last_offset": ([8, 6], 2, 4, 2, 5, 0),
    "static_capacity_padding_rows": ([8, 5], 2, 4, 2, 0, 3),
    "static_capacity_padding_rows_coff1": ([8, 5], 2, 4, 1, 0, 3),
    "tokens_fewer_than_ratio": ([2], 2, 4, 2, 0, 2),
    "total_comp_zero": ([3], 2, 4, 2, 0, 0),
    "odd_head_dim": ([8, 13], 5, 4, 2, 0, 0),
}
for _r in (1, 2, 3, 4, 8, 128):
    for _c in (1, 2):
        lens = [2 * _r + 1, 3 * _r, _r - 1 if _r > 1 else 0]
        BOUNDARY_CASES[f"ratio{_r}_coff{_c}"] = (lens, 2 if _r == 128 else 3, _r, _c, 1, 1)


def _run(mode, kv, score, ape, cu, cuc, N, ratio, coff, g):
    kv = kv.clone().requires_grad_(True)
    score = score.clone().requires_grad_(True)
    ape = ape.clone().requires_grad_(True)
    out = reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff, mode=mode)
    if out.requires_grad:  # an all-padding output depends on no input
        out.backward(g.to(out.dtype))
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (kv, score, ape)]
    else:
        grads = [torch.zeros_like(t) for t in (kv, score, ape)]
    return out.detach(), grads


@pytest.mark.parametrize("mode,tol", [("fp64", 1e-12), ("fp32", 2e-5), ("fp32_explicit", 2e-5),
                                      ("upstream", 2e-5)])
@pytest.mark.parametrize("case", sorted(BOUNDARY_CASES))
def test_reference_matches_naive_oracle(case, mode, tol):
    lens, d, ratio, coff, pad, extra = BOUNDARY_CASES[case]
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, pad_tokens=pad, extra_rows=extra, seed=len(case))
    g = torch.randn(N, d, generator=torch.Generator().manual_seed(7))
    out, (dkv, dsc, dape) = _run(mode, kv, score, ape, cu, cuc, N, ratio, coff, g)
    want = naive_forward_backward(kv, score, ape, cu, N, ratio, coff, grad_out=g.double())
    assert out.shape == (N, d)
    torch.testing.assert_close(out.double(), want[0], rtol=tol, atol=tol, msg=f"{case} {mode} out")
    # Gradients land in the fp32 input dtype whatever the mode: fp32 rounding tolerance.
    gtol = max(tol, 2e-6)
    for name, got, ref in (("dkv", dkv, want[1]), ("dscore", dsc, want[2]), ("dape", dape, want[3])):
        torch.testing.assert_close(got.double(), ref, rtol=gtol, atol=gtol, msg=f"{case} {mode} {name}")


def test_tokens_fewer_than_ratio_gives_zero_padding_rows():
    kv, score, ape, cu, cuc, N = make_pack([2], 3, 4, 2, extra_rows=3)
    out = reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    assert N == 3 and torch.equal(out, torch.zeros(3, 3))


def test_padding_rows_take_no_gradient():
    kv, score, ape, cu, cuc, N = make_pack([8], 2, 4, 2, extra_rows=2)
    kv.requires_grad_(True)
    out = reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    g = torch.zeros(N, 2)
    g[2:] = 1.0  # gradient only on the padding rows
    out.backward(g)
    assert torch.equal(kv.grad, torch.zeros_like(kv))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_modes_round_as_specified(dtype):
    kv, score, ape, cu, cuc, N = make_pack([64, 37], 16, 4, 2, dtype=dtype)
    oracle = naive_forward_backward(kv, score, ape, cu, N, 4, 2)[0]
    fp32 = reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=4, coff=2, mode="fp32")
    up = reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=4, coff=2, mode="upstream")
    assert fp32.dtype == dtype and up.dtype == dtype
    # fp32 has a single final rounding: within half an ulp (plus fp32 noise) of the oracle.
    ulp = torch.finfo(dtype).eps * oracle.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((fp32.double() - oracle).abs() <= 0.5 * ulp * 2 + 1e-6).all()
    # upstream rounds the weights and products too: never better than fp32 on the whole.
    assert (up.double() - oracle).abs().sum() >= (fp32.double() - oracle).abs().sum()


def test_sbhd_matches_per_column_thd():
    S, B, d, ratio, coff = 18, 3, 4, 4, 2
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(S, B, coff * d, generator=gen)
    score = torch.randn(S, B, coff * d, generator=gen)
    ape = torch.randn(ratio, coff * d, generator=gen)
    out = reference.compress_sbhd(kv, score, ape, ratio=ratio, coff=coff, mode="fp64")
    assert out.shape == (S // ratio, B, d)
    for b in range(B):
        cu = torch.tensor([0, S], dtype=torch.int32)
        want = naive_forward_backward(kv[:, b], score[:, b], ape, cu, S // ratio, ratio, coff)[0]
        torch.testing.assert_close(out[:, b], want, rtol=1e-12, atol=1e-12)


def test_mode_is_checked():
    kv, score, ape, cu, cuc, N = make_pack([8], 2, 4, 2)
    with pytest.raises(ValueError, match="mode"):
        reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=4, coff=2, mode="fp16")


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    ratio=st.sampled_from([1, 2, 3, 4, 8]),
    coff=st.sampled_from([1, 2]),
    d=st.integers(1, 4),
    pad=st.integers(0, 3),
    extra=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_random_packs_match_oracle(lens, ratio, coff, d, pad, extra, seed):
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, pad_tokens=pad, extra_rows=extra, seed=seed)
    g = torch.randn(N, d, generator=torch.Generator().manual_seed(seed + 1))
    out, (dkv, dsc, dape) = _run("fp64", kv, score, ape, cu, cuc, N, ratio, coff, g)
    want = naive_forward_backward(kv, score, ape, cu, N, ratio, coff, grad_out=g.double())
    torch.testing.assert_close(out, want[0], rtol=1e-12, atol=1e-12)
    for got, ref in zip((dkv, dsc, dape), want[1:]):
        torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=2e-6)


def _region_grads(fn, kv, score, ape, g):
    leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
    out = fn(*leaves)
    if not out.requires_grad:
        return [out] + [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(out, leaves, g.to(out.dtype), allow_unused=True)
    return [out.detach()] + [x if x is not None else torch.zeros_like(t) for x, t in zip(grads, leaves)]


REGION_CASES = [(lens, d, r, c, dt) for lens, d in (([37, 0, 3, 64, 29, 1, 8], 5), ([9, 40], 16))
                for r in (1, 2, 3, 4, 8) for c in (1, 2)
                for dt in (torch.float32, torch.bfloat16, torch.float16)]
REGION_CASES += [([300, 0, 127, 260], 4, 128, 1, torch.bfloat16), ([70, 33, 64], 3, 32, 2, torch.float32)]


@pytest.mark.parametrize("lens,d,ratio,coff,dtype", REGION_CASES)
def test_fp32_reference_is_the_eager_torch_region_bitwise(lens, d, ratio, coff, dtype):
    """mode="fp32" is the eager region a user writes with torch's ops (tests/eager_region.py:
    its windows built row by row on the host): output and every gradient bitwise equal,
    with token padding and static-capacity padding rows that receive gradient."""
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, pad_tokens=3,
                                           extra_rows=2, seed=ratio * 7 + coff)
    g = torch.randn(N, d, generator=torch.Generator().manual_seed(1))
    ref = _region_grads(lambda a, b, c: reference.compress_thd(a, b, c, cu, cuc, N, ratio=ratio,
                                                                coff=coff, mode="fp32"),
                        kv, score, ape, g)
    region = _region_grads(lambda a, b, c: eager_fp32_region(a, b, c, cu, N, ratio=ratio, coff=coff),
                           kv, score, ape, g)
    for name, x, y in zip(("out", "dkv", "dscore", "dape"), ref, region):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), f"{name} differs from the eager torch region"


def _fma_exact(a, b, c):
    """round_fp32(a*b + c) from exact rational arithmetic, ties to even."""
    import numpy as np
    from fractions import Fraction

    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    best = None
    for cand in (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))):
        err = abs(Fraction(float(cand)) - exact)
        even = (np.array(cand).view(np.int32) & 1) == 0
        if best is None or err < best[0] or (err == best[0] and even):
            best = (err, cand)
    return float(best[1])


def test_fma_f32_rounds_once():
    """reference.fma_f32 against exact arithmetic: random operands, and sums one fp64 ulp
    off an fp32 rounding midpoint (where rounding to fp64 first would land on the midpoint
    and round to even the wrong way)."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(4000, generator=gen) * torch.exp2(torch.randint(-20, 20, (4000,), generator=gen).float())
    b = torch.randn(4000, generator=gen)
    c = torch.randn(4000, generator=gen) * torch.exp2(torch.randint(-20, 20, (4000,), generator=gen).float())
    one = 1.0 + 2.0 ** -23
    # a*b = 2^-24 (1 - 2^-46): 1 + 2^-23 + a*b lies 2^-70 below a midpoint of fp32.
    a = torch.cat([a, torch.tensor([2.0 ** -24 * (1 + 2.0 ** -23), -(2.0 ** -24) * (1 + 2.0 ** -23)])])
    b = torch.cat([b, torch.tensor([1 - 2.0 ** -23, 1 - 2.0 ** -23])])
    c = torch.cat([c, torch.tensor([one, -one])])
    got = reference.fma_f32(a, b, c)
    want = torch.tensor([_fma_exact(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())])
    assert torch.equal(got, want)
    assert got[-2].item() == one and got[-1].item() == -one
    naive = (a[-2:].double() * b[-2:].double() + c[-2:].double()).float()
    assert not torch.equal(naive, got[-2:])  # the case a plain fp64 detour gets wrong


@pytest.mark.parametrize("K,d,lanes", [(32, 8, 1), (63, 1, 1), (64, 64, 16), (64, 65, 1),
                                       (128, 33, 16), (128, 32, 32), (256, 1, 256), (128, 512, 1)])
def test_torch_softmax_lanes(K, d, lanes):
    assert reference.torch_softmax_lanes(K, d) == lanes


def test_sbhd_shorter_than_ratio_gives_no_rows():
    kv = torch.randn(3, 2, 8)
    out = reference.compress_sbhd(kv, torch.randn(3, 2, 8), torch.randn(4, 8), ratio=4, coff=2)
    assert out.shape == (0, 2, 4)
