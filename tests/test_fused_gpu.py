"""Fused kernels against the references on the GPU (docs/contract.md)."""

import pytest
import torch

from csa_compressor import compress_thd_fused, reference
from csa_compressor.kernel_api import pool_backward, pool_forward
from packs import make_pack

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
RAGGED = [37, 0, 3, 64, 129, 1, 8, 250]  # empty, short, tails, long


def _grads(fn, kv, score, ape, cu, cuc, N, ratio, coff, g):
    kv = kv.clone().requires_grad_(True)
    score = score.clone().requires_grad_(True)
    ape = ape.clone().requires_grad_(True)
    out = fn(kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff)
    if out.requires_grad:
        out.backward(g.to(out.dtype))
    z = torch.zeros_like
    return (out.detach(), kv.grad if kv.grad is not None else z(kv),
            score.grad if score.grad is not None else z(score),
            ape.grad if ape.grad is not None else z(ape))


@pytest.fixture
def large_variant_always():
    """Every pack takes the large-pack backward where a kernel has one (a launch-only
    tuning: nothing recompiles)."""
    from csa_compressor.kernels import tuning

    return tuning.replace(tuning.current(), BWD_LARGE_PACK_ROWS=0, BWD_LARGE_GUESS_PACK_ROWS=0)


def _ref(mode):
    return lambda *a, **k: reference.compress_thd(*a, mode=mode, **k)


def _oracle(kv, score, ape, cu, cuc, N, ratio, coff, g):
    """fp64 oracle; fp32 copies of the inputs (exact) keep its gradients from being rounded
    to the input dtype."""
    return _grads(_ref("fp64"), kv.float(), score.float(), ape, cu, cuc, N, ratio, coff, g.float())


def _ulp_diff(a, b):
    """|a-b| in units of the last place of a's dtype, elementwise (0 where equal)."""
    dt = a.dtype
    diff = (a.double() - b.double()).abs()
    scale = torch.maximum(a.double().abs(), b.double().abs())
    ulp = torch.finfo(dt).eps * torch.exp2(torch.floor(torch.log2(scale.clamp_min(torch.finfo(dt).tiny))))
    return torch.where(diff == 0, torch.zeros_like(diff), diff / ulp)


def assert_forward_contract(out, ref):
    """At most max(1, 0.1%) elements differ from the fp32 reference, by one unit in the
    last place; fp32 outputs, whose last place lies below torch's regrouping of the
    window sum, every element within 4 units."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    neq = out != ref
    n_diff = int(neq.sum())
    if out.dtype == torch.float32:
        if n_diff:
            assert _ulp_diff(out[neq], ref[neq]).max() <= 4.0
        return
    assert n_diff <= max(1, int(0.001 * out.numel())), f"{n_diff} of {out.numel()} elements differ"
    if n_diff:
        assert _ulp_diff(out[neq], ref[neq]).max() <= 1.0


def assert_never_worse_than_upstream(fused, up, oracle):
    for name, f, u, o in zip(("out", "dkv", "dscore", "dape"), fused, up, oracle):
        ef = (f.double() - o.double()).abs()
        eu = (u.double() - o.double()).abs()
        assert ef.sum() <= eu.sum() * (1 + 1e-9) + 1e-30, f"{name}: fused L1 error above upstream"


# Every ratio 1-8 and both coff in bf16 at head_dim 128 and at an odd head_dim; fp16 and
# fp32 at head_dim 64; head_dim 512 at the production ratios, and in bf16 at the wide
# windows whose kernels differ there (ratios 5-8 coff 2: register-fitted grids, the
# backward held to 4 CTAs, FWD_MAX_WINDOW_ELEMS).
GRID = ([(128, r, c, torch.bfloat16) for r in range(1, 9) for c in (1, 2)]
        + [(65, r, c, torch.bfloat16) for r in range(1, 9) for c in (1, 2)]
        + [(64, r, c, dt) for r in range(1, 9) for c in (1, 2) for dt in (torch.float16, torch.float32)]
        + [(512, r, 2, dt) for r in (2, 4) for dt in DTYPES]
        + [(512, r, 2, torch.bfloat16) for r in (5, 6, 7, 8)])


@pytest.mark.parametrize("d,ratio,coff,dtype", GRID, ids=[f"d{a}-r{b}-c{c}-{str(e)[6:]}" for a, b, c, e in GRID])
def test_numerics_contract(d, ratio, coff, dtype):
    kv, score, ape, cu, cuc, N = make_pack(RAGGED, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=5, seed=ratio * 10 + coff)
    g = torch.randn(N, d, device="cuda").to(dtype)
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, ratio, coff, g)
    ref = _grads(_ref("fp32"), kv, score, ape, cu, cuc, N, ratio, coff, g)
    assert_forward_contract(fused[0], ref[0])
    assert torch.equal(fused[1], ref[1]), "dkv not bitwise equal to the fp32 reference"
    assert torch.equal(fused[2], ref[2]), "dscore not bitwise equal to the fp32 reference"
    torch.testing.assert_close(fused[3], ref[3], rtol=0, atol=1e-3)
    if dtype != torch.float32:
        up = _grads(_ref("upstream"), kv, score, ape, cu, cuc, N, ratio, coff, g)
        oracle = _oracle(kv, score, ape, cu, cuc, N, ratio, coff, g)
        assert_never_worse_than_upstream(fused, up, oracle)


def test_large_pack_backward_variant():
    """A pack of BWD_LARGE_PACK_ROWS rows or more takes the backward's large-pack variant
    (cooperative copies with stacked row lanes): same contract as the small one."""
    from csa_compressor.kernels import launch, tuning

    kv, score, ape, cu, cuc, N = make_pack([8192, 8192, 1000, 3, 0, 77], 128, 4, 2,
                                           dtype=torch.bfloat16, device="cuda", pad_tokens=5,
                                           extra_rows=3, seed=17)
    assert N >= tuning.current().BWD_LARGE_PACK_ROWS
    kernel = launch.backward_kernel(kv.device, torch.bfloat16, 4, 2, 128, N).kernel
    assert kernel.coop and kernel.row_lanes > 1  # the large variant on sm_90
    g = torch.randn(N, 128, device="cuda").to(torch.bfloat16)
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, 4, 2, g)
    ref = _grads(_ref("fp32"), kv, score, ape, cu, cuc, N, 4, 2, g)
    assert_forward_contract(fused[0], ref[0])
    assert torch.equal(fused[1], ref[1]) and torch.equal(fused[2], ref[2])
    torch.testing.assert_close(fused[3], ref[3], rtol=0, atol=2e-3)


LARGE_GRID = ([(128, r, c, torch.bfloat16) for r in range(1, 9) for c in (1, 2)]
              + [(64, r, 2, dt) for r in (1, 2, 3, 5, 8) for dt in (torch.float16, torch.float32)]
              + [(64, r, 1, torch.float32) for r in (1, 3, 5, 6, 7)])


@pytest.mark.parametrize("d,ratio,coff,dtype", LARGE_GRID,
                         ids=[f"d{a}-r{b}-c{c}-{str(e)[6:]}" for a, b, c, e in LARGE_GRID])
def test_large_pack_variant_on_ragged_packs(large_variant_always, d, ratio, coff, dtype):
    """The large-pack backward forced onto the ragged packs of test_numerics_contract (the
    threshold is read at launch): dkv/dscore bitwise equal to the fp32 reference, padding
    rows ignored, NaN-filled buffers fully written."""
    kv, score, ape, cu, cuc, N = make_pack(RAGGED, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=5, extra_rows=2, seed=ratio * 10 + coff)
    g = torch.randn(N, d, device="cuda").to(dtype)
    ref = _grads(_ref("fp32"), kv, score, ape, cu, cuc, N, ratio, coff, g)
    t = large_variant_always  # handed to the kernel-level API: the variant on every pack
    a = _kernel_level(kv, score, ape, cu, cuc, N, ratio, coff, g, float("nan"), t)
    b = _kernel_level(kv, score, ape, cu, cuc, N, ratio, coff, g, 0.0, t)
    assert torch.equal(a[1], ref[1]) and torch.equal(a[2], ref[2])
    torch.testing.assert_close(a[3], ref[3], rtol=0, atol=1e-3)
    for x, y in zip(a, b):
        assert not torch.isnan(x).any() and torch.equal(x, y)


@pytest.mark.parametrize("ratio,coff,d", [(128, 1, 512), (128, 1, 256), (128, 2, 64),
                                          (16, 2, 128), (12, 1, 65)])
def test_long_windows(ratio, coff, d):
    lens = [3 * ratio + 5, ratio - 1, 0, 2 * ratio]
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=torch.bfloat16, device="cuda",
                                           extra_rows=2, seed=ratio)
    g = torch.randn(N, d, device="cuda").to(torch.bfloat16)
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, ratio, coff, g)
    ref = _grads(_ref("fp32"), kv, score, ape, cu, cuc, N, ratio, coff, g)
    assert_forward_contract(fused[0], ref[0])
    for name, f, r in (("dkv", fused[1], ref[1]), ("dscore", fused[2], ref[2])):
        assert_forward_contract(f, r)
        # The slot-parallel kernels sum the softmax in torch's order (pool_long.py), so
        # long windows are bitwise too.
        assert torch.equal(f, r), f"{name} not bitwise equal to the fp32 reference"
    torch.testing.assert_close(fused[3], ref[3], rtol=0, atol=1e-3)
    up = _grads(_ref("upstream"), kv, score, ape, cu, cuc, N, ratio, coff, g)
    oracle = _oracle(kv, score, ape, cu, cuc, N, ratio, coff, g)
    assert_never_worse_than_upstream(fused, up, oracle)


@pytest.mark.parametrize("coff", [1, 2])
def test_capacity_padding_rows_ignore_their_gradient(coff):
    kv, score, ape, cu, cuc, N = make_pack([40, 7, 0, 21], 128, 4, coff, dtype=torch.bfloat16,
                                           device="cuda", pad_tokens=3, extra_rows=6, seed=5)
    g = torch.randn(N, 128, device="cuda").to(torch.bfloat16)  # non-zero on padding rows too
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, 4, coff, g)
    ref = _grads(_ref("fp32"), kv, score, ape, cu, cuc, N, 4, coff, g)
    assert_forward_contract(fused[0], ref[0])
    assert torch.equal(fused[1], ref[1]) and torch.equal(fused[2], ref[2])
    torch.testing.assert_close(fused[3], ref[3], rtol=0, atol=1e-3)


def _kernel_level(kv, score, ape, cu, cuc, N, ratio, coff, g, fill, tuning=None):
    d = kv.shape[1] // coff
    out = torch.full((N, d), fill, dtype=kv.dtype, device="cuda")
    pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff, tuning=tuning)
    dkv = torch.full_like(kv, fill)
    dsc = torch.full_like(score, fill)
    dape = torch.full_like(ape, fill)
    pool_backward(kv, score, ape, cu, cuc, g, dkv, dsc, dape, ratio=ratio, coff=coff, tuning=tuning)
    return out, dkv, dsc, dape


@pytest.mark.parametrize("ratio,coff", [(4, 2), (1, 1), (128, 1), (3, 2)])
def test_nan_prefilled_buffers_are_fully_written(ratio, coff):
    kv, score, ape, cu, cuc, N = make_pack([5 * ratio + 1, 2, 0, 3 * ratio], 64, ratio, coff,
                                           dtype=torch.bfloat16, device="cuda", pad_tokens=7,
                                           extra_rows=3, seed=11)
    g = torch.randn(N, 64, device="cuda").to(torch.bfloat16)
    a = _kernel_level(kv, score, ape, cu, cuc, N, ratio, coff, g, float("nan"))
    b = _kernel_level(kv, score, ape, cu, cuc, N, ratio, coff, g, 0.0)
    for x, y in zip(a, b):
        assert not torch.isnan(x).any()
        assert torch.equal(x, y)


def test_repeated_runs_are_bitwise_identical():
    kv, score, ape, cu, cuc, N = make_pack([8192, 1000, 3], 512, 4, 2, dtype=torch.bfloat16,
                                           device="cuda", seed=2)
    g = torch.randn(N, 512, device="cuda").to(torch.bfloat16)
    first = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, 4, 2, g)
    for _ in range(3):
        again = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, 4, 2, g)
        for x, y in zip(first, again):
            assert torch.equal(x, y)


@pytest.mark.parametrize("d", [128, 512])
def test_caller_workspace_gives_the_same_gradients(d):
    """pool_backward with a workspace of backward_workspace_shape (NaN-filled: every
    partial is written before it is summed) equals its own allocation bitwise, and a
    workspace of another shape is refused."""
    from csa_compressor import backward_workspace_shape

    kv, score, ape, cu, cuc, N = make_pack([8192, 1000, 3, 77], d, 4, 2, dtype=torch.bfloat16,
                                           device="cuda", seed=5)
    g = torch.randn(N, d, device="cuda").to(torch.bfloat16)
    bufs = lambda: (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))  # noqa: E731
    want = pool_backward(kv, score, ape, cu, cuc, g, *bufs(), ratio=4, coff=2)
    shape = backward_workspace_shape(N, kv.shape[0], 4, 2, d, torch.bfloat16, "cuda")
    ws = torch.full(shape, float("nan"), device="cuda")
    got = pool_backward(kv, score, ape, cu, cuc, g, *bufs(), ratio=4, coff=2, workspace=ws)
    for x, y in zip(want, got):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="workspace"):
        pool_backward(kv, score, ape, cu, cuc, g, *bufs(), ratio=4, coff=2,
                      workspace=torch.empty(shape[0] + 4, shape[1], device="cuda"))


def test_capacity_below_true_count_gives_nan():
    """A capacity below the pack's true row count (an understated max_seqlen) is a
    malformed pack: by default every row and the APE gradient are NaN, the fused op's and
    the reference's on the GPU alike, and nothing is written out of bounds."""
    kv, score, ape, cu, cuc, N = make_pack([64, 64], 128, 4, 2, dtype=torch.bfloat16, device="cuda")
    n = N - 9  # a caller error: fewer rows than the pack holds
    g = torch.randn(n, 128, device="cuda").to(torch.bfloat16)
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, n, 4, 2, g)
    ref = _grads(_ref("fp32"), kv, score, ape, cu, cuc, n, 4, 2, g)
    torch.cuda.synchronize()
    assert fused[0].shape == (n, 128) and fused[0].isnan().all() and ref[0].isnan().any()
    assert fused[3].isnan().all() and fused[1].isnan().any() and ref[1].isnan().any()


@pytest.mark.parametrize("lens,extra", [([2], 3), ([3], 0), ([], 2)])
def test_degenerate_packs(lens, extra):
    kv, score, ape, cu, cuc, N = make_pack(lens, 64, 4, 2, dtype=torch.bfloat16, device="cuda",
                                           extra_rows=extra)
    g = torch.randn(N, 64, device="cuda").to(torch.bfloat16)
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, 4, 2, g)
    assert fused[0].shape == (N, 64)
    assert torch.equal(fused[0], torch.zeros_like(fused[0]))  # T < ratio: zero padding rows
    for x in fused[1:]:
        assert torch.equal(x, torch.zeros_like(x))


def test_three_dim_view_and_int64_offsets():
    kv, score, ape, cu, cuc, N = make_pack([33, 17], 128, 4, 2, dtype=torch.bfloat16, device="cuda")
    a = compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    b = compress_thd_fused(kv.unsqueeze(1), score.unsqueeze(1), ape, cu.long(), cuc.long(), N,
                           ratio=4, coff=2)
    assert torch.equal(a, b)


def test_non_finite_inputs_propagate_like_the_reference():
    kv, score, ape, cu, cuc, N = make_pack([16, 16], 64, 4, 2, dtype=torch.float32, device="cuda")
    score[3, 5] = float("nan")
    kv[20, 70] = float("inf")
    fused = compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    ref = reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=4, coff=2, mode="fp32")
    assert torch.equal(torch.isnan(fused), torch.isnan(ref))
    assert torch.equal(torch.isinf(fused), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert_forward_contract(fused[fin], ref[fin])


@pytest.mark.parametrize("ratio,coff,scale", [(4, 2, 30.0), (8, 2, 60.0), (128, 1, 30.0)])
def test_wide_score_spread_hits_the_exact_division_fallback(ratio, coff, scale):
    """Scores spread so wide that many softmax numerators fall below the shared-reciprocal
    fast path (softmax.DIV_FAST_MIN = 2^-64), underflow to subnormals or to zero: the
    kernels' quotients must still be the IEEE ones (dkv = g*p bitwise)."""
    kv, score, ape, cu, cuc, N = make_pack(RAGGED, 64, ratio, coff, dtype=torch.float32,
                                           device="cuda", seed=11)
    score = score * scale
    e = torch.exp(score - score.max())
    assert (e < 2.0 ** -64).float().mean() > 0.05 and ((e > 0) & (e < 2.0 ** -126)).any()
    g = torch.randn(N, 64, device="cuda")
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, ratio, coff, g)
    ref = _grads(_ref("fp32"), kv, score, ape, cu, cuc, N, ratio, coff, g)
    assert_forward_contract(fused[0], ref[0])
    assert torch.equal(fused[1], ref[1]), "dkv not bitwise equal to the fp32 reference"
    assert torch.equal(fused[2], ref[2]), "dscore not bitwise equal to the fp32 reference"


def test_bad_offsets_are_caught_on_request_by_the_fused_entries():
    """compress_thd_fused / pool_forward / pool_backward with check_offsets=True refuse the
    offsets the CPU tests refuse (tests/test_offsets_check_cpu.py), naming the argument."""
    from test_offsets_check_cpu import BAD, RATIO, COFF, _i32

    from csa_compressor import compressed_cu_seqlens

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(40, 8, generator=gen).cuda()
    score, ape = torch.randn(40, 8, generator=gen).cuda(), torch.randn(RATIO, 8).cuda()
    for cu, cuc, N, name, _ in BAD:
        cu_t = _i32(cu).cuda()
        cuc_t = _i32(cuc).cuda() if cuc is not None else compressed_cu_seqlens(cu_t, RATIO)
        with pytest.raises(ValueError, match=name):
            compress_thd_fused(kv, score, ape, cu_t, cuc_t, N, ratio=RATIO, coff=COFF,
                               check_offsets=True)
        out = torch.empty(N, 4, device="cuda")
        with pytest.raises(ValueError, match=name):
            pool_forward(kv, score, ape, cu_t, cuc_t, out, ratio=RATIO, coff=COFF,
                         check_offsets=True)
