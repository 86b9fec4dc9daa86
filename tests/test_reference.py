"""The three plain-PyTorch references against the independent naive oracle (CPU)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from csa_compressor import reference
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


@pytest.mark.parametrize("mode,tol", [("fp64", 1e-12), ("fp32", 2e-5), ("upstream", 2e-5)])
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
