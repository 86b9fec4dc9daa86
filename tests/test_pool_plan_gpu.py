"""kernel_api.PoolPlan on the GPU: a plan's runs write the bits of pool_forward /
pool_backward on the same pack (with and without an APE, both numerics, an fp32 dscore,
padding rows and tokens, empty packs), run again with new tensors, inside a CUDA graph,
and refuse what does not fit the plan."""

import pytest
import torch

from csa_compressor import compress_thd_fused, compress_thd_fused_packed, kernel_api
from csa_compressor.kernel_api import PoolPlan
from packs import make_pack

pytestmark = pytest.mark.gpu

CASES = [([37, 0, 3, 64, 129], 128, 4, 2, torch.bfloat16, 2, 5),
         ([8192, 8192], 128, 4, 2, torch.bfloat16, 0, 0),
         ([300, 0, 1027], 512, 128, 1, torch.bfloat16, 1, 3),
         ([70, 33], 64, 16, 2, torch.float32, 0, 1),
         ([77, 5], 128, 1, 1, torch.float16, 0, 0)]
IDS = ["-".join(map(str, c[1:4])) for c in CASES]


def _pack(lens, d, ratio, coff, dtype, extra_rows, pad_tokens, seed=0):
    return make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda", extra_rows=extra_rows,
                     pad_tokens=pad_tokens, seed=seed)


def _plan(lens, cu, kv, N, ratio, coff, d, dtype, **kw):
    return PoolPlan(cu.cpu().tolist(), ratio=ratio, coff=coff, head_dim=d, dtype=dtype,
                    num_tokens=kv.shape[0], total_comp=N, **kw)


@pytest.mark.parametrize("with_ape", [True, False])
@pytest.mark.parametrize("numerics", ["fp32", "eager"])
@pytest.mark.parametrize("lens,d,ratio,coff,dtype,extra_rows,pad_tokens", CASES, ids=IDS)
def test_a_plan_writes_the_kernel_apis_bits(lens, d, ratio, coff, dtype, extra_rows, pad_tokens,
                                             numerics, with_ape):
    kv, score, ape, cu, cuc, N = _pack(lens, d, ratio, coff, dtype, extra_rows, pad_tokens)
    ape = ape if with_ape else None
    plan = _plan(lens, cu, kv, N, ratio, coff, d, dtype, ape=with_ape, numerics=numerics)
    kw = dict(ratio=ratio, coff=coff, numerics=numerics)
    want = kernel_api.pool_forward(kv, score, ape, cu, cuc, torch.empty(N, d, dtype=dtype,
                                                                        device="cuda"), **kw)
    got = torch.full_like(want, float("nan"))
    assert plan.forward(kv, score, ape, got) is got
    assert torch.equal(got, want)
    g = torch.randn(N, d, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(dtype)

    def grads():
        return (torch.full_like(kv, float("nan")), torch.full_like(score, float("nan")),
                torch.full_like(ape, float("nan")) if with_ape else None)
    want_g = kernel_api.pool_backward(kv, score, ape, cu, cuc, g, *grads(), **kw)
    got_g = plan.backward(kv, score, ape, g, *grads())
    assert torch.equal(got_g[0], want_g[0]) and torch.equal(got_g[1], want_g[1])
    assert torch.equal(got_g[2], want_g[2]) if with_ape else got_g[2] is None
    # new tensors of the same shapes: the same plan, the new values
    kv2, score2, ape2 = _pack(lens, d, ratio, coff, dtype, extra_rows, pad_tokens, seed=7)[:3]
    ape2 = ape2 if with_ape else None
    want2 = kernel_api.pool_forward(kv2, score2, ape2, cu, cuc, torch.empty_like(want), **kw)
    assert torch.equal(plan.forward(kv2, score2, ape2, torch.empty_like(want)), want2)


def test_an_fp32_grad_score_is_the_kernel_apis():
    lens, d, ratio, coff = [300, 77, 1027], 128, 4, 2
    kv, score, ape, cu, cuc, N = _pack(lens, d, ratio, coff, torch.bfloat16, 0, 0)
    plan = _plan(lens, cu, kv, N, ratio, coff, d, torch.bfloat16)
    g = torch.randn(N, d, device="cuda").bfloat16()
    bufs = [torch.empty_like(kv), torch.empty_like(score, dtype=torch.float32),
            torch.empty_like(ape)]
    want = kernel_api.pool_backward(kv, score, ape, cu, cuc, g, *[torch.empty_like(b) for b in bufs],
                                    ratio=ratio, coff=coff)
    for a, b in zip(plan.backward(kv, score, ape, g, *bufs), want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_an_empty_pack_gives_zeros():
    plan = PoolPlan([0, 3, 3], ratio=4, coff=2, head_dim=128, dtype=torch.bfloat16)
    assert plan.total_comp == 0 and plan.num_tokens == 3
    kv = torch.randn(3, 256, device="cuda").bfloat16()
    ape = torch.randn(4, 256, device="cuda")
    out = torch.empty(0, 128, device="cuda", dtype=torch.bfloat16)
    assert plan.forward(kv, kv, ape, out).shape == (0, 128)
    bufs = (torch.full_like(kv, 5), torch.full_like(kv, 5), torch.full_like(ape, 5))
    for t in plan.backward(kv, kv, ape, out, *bufs):
        assert not t.any()


def test_a_plan_runs_inside_a_cuda_graph():
    lens, d, ratio, coff = [129, 64, 1000], 128, 4, 2
    kv, score, ape, cu, cuc, N = _pack(lens, d, ratio, coff, torch.bfloat16, 0, 0)
    plan = _plan(lens, cu, kv, N, ratio, coff, d, torch.bfloat16)
    out, g = torch.empty(N, d, device="cuda", dtype=torch.bfloat16), torch.randn(N, d, device="cuda").bfloat16()
    bufs = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up compiles
        plan.forward(kv, score, ape, out)
        plan.backward(kv, score, ape, g, *bufs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.forward(kv, score, ape, out)
        plan.backward(kv, score, ape, g, *bufs)
    kv.copy_(torch.randn_like(kv))
    graph.replay()
    want = kernel_api.pool_forward(kv, score, ape, cu, cuc, torch.empty_like(out), ratio=ratio, coff=coff)
    want_g = kernel_api.pool_backward(kv, score, ape, cu, cuc, g, *[torch.empty_like(b) for b in bufs],
                                      ratio=ratio, coff=coff)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    for a, b in zip(bufs, want_g):
        assert torch.equal(a, b)


def test_what_does_not_fit_the_plan_is_refused():
    lens, d, ratio, coff = [300, 77], 128, 4, 2
    kv, score, ape, cu, cuc, N = _pack(lens, d, ratio, coff, torch.bfloat16, 0, 0)
    plan = _plan(lens, cu, kv, N, ratio, coff, d, torch.bfloat16)
    out = torch.empty(N, d, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv: expected shape"):
        plan.forward(kv[:-1], score, ape, out)
    with pytest.raises(TypeError, match="score: expected dtype"):
        plan.forward(kv, score.half(), ape, out)
    with pytest.raises(ValueError, match="out: expected contiguous"):
        plan.forward(kv, score, ape, torch.empty(d, N, device="cuda", dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="ape: expected device"):
        plan.forward(kv, score, ape.cpu(), out)
    with pytest.raises(ValueError, match="out: shares memory with kv"):
        plan.forward(kv, score, ape, kv.view(-1)[:N * d].view(N, d))
    g = torch.randn(N, d, device="cuda").bfloat16()
    dkv, dape = torch.empty_like(kv), torch.empty_like(ape)
    with pytest.raises(ValueError, match="grad_kv: shares memory with grad_score"):
        plan.backward(kv, score, ape, g, dkv, dkv, dape)
    with pytest.raises(ValueError, match="grad_kv: shares memory with kv"):
        plan.backward(kv, score, ape, g, kv, torch.empty_like(score), dape)
    with pytest.raises(ValueError, match="ape: expected None"):
        PoolPlan(cu.cpu(), ratio=ratio, coff=coff, head_dim=d, dtype=torch.bfloat16,
                 ape=False).forward(kv, score, ape, out)
    # kv given as score too: inputs may share memory
    plan.forward(kv, kv, ape, out)


def test_device_offsets_are_read_once_and_checked():
    cu = torch.tensor([0, 8, 4], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing"):
        PoolPlan(cu, ratio=4, coff=1, head_dim=128, dtype=torch.bfloat16)
    plan = PoolPlan(torch.tensor([0, 8, 12], device="cuda"), ratio=4, coff=1, head_dim=128,
                    dtype=torch.bfloat16)
    assert (plan.num_tokens, plan.total_comp) == (12, 3)


def _step(fn, leaves, seed=3):
    xs = [t.clone().requires_grad_(True) if t is not None else None for t in leaves]
    out = fn(*xs)
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    live = [x for x in xs if x is not None]
    return (out.detach(), *torch.autograd.grad(out, live, g.to(out.dtype)))


@pytest.mark.parametrize("score_first", [False, True])
@pytest.mark.parametrize("with_ape", [True, False])
@pytest.mark.parametrize("numerics", ["fp32", "eager"])
@pytest.mark.parametrize("lens,d,ratio,coff,dtype,extra_rows,pad_tokens", CASES, ids=IDS)
def test_a_plans_ops_are_the_ops_bitwise(lens, d, ratio, coff, dtype, extra_rows, pad_tokens,
                                          numerics, with_ape, score_first):
    kv, score, ape, cu, cuc, N = _pack(lens, d, ratio, coff, dtype, extra_rows, pad_tokens)
    ape = ape if with_ape else None
    plan = _plan(lens, cu, kv, N, ratio, coff, d, dtype, ape=with_ape, numerics=numerics)
    kw = dict(ratio=ratio, coff=coff, numerics=numerics)
    kvs = torch.cat((score, kv) if score_first else (kv, score), 1)
    want = _step(lambda k, a: compress_thd_fused_packed(k, a, cu, cuc, N, score_first=score_first,
                                                         **kw), (kvs, ape))
    got = _step(lambda k, a: plan.pool_packed(k, a, score_first=score_first), (kvs, ape))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if score_first:
        return
    want = _step(lambda k, s, a: compress_thd_fused(k, s, a, cu, cuc, N, **kw), (kv, score, ape))
    got = _step(plan.pool, (kv, score, ape))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(plan.pool_packed(kvs, ape), want[0])


def test_a_plans_op_compiles_to_the_same_bits():
    lens, d, ratio, coff = [300, 77, 1027], 128, 4, 2
    kv, score, ape, cu, cuc, N = _pack(lens, d, ratio, coff, torch.bfloat16, 0, 0)
    plan = _plan(lens, cu, kv, N, ratio, coff, d, torch.bfloat16)
    kvs = torch.cat((kv, score), 1)
    want = _step(plan.pool_packed, (kvs, ape))
    got = _step(torch.compile(lambda k, a: plan.pool_packed(k, a) * 1), (kvs, ape))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # compiled, a run the plan was not made for raises its error: without the plan's check
    # the traced op pooled an absent APE as no position bias
    torch._dynamo.reset()
    run = torch.compile(lambda k, a: plan.pool_packed(k, a) * 1)
    with pytest.raises(TypeError, match="the plan was made with ape=True"):
        run(kvs, None)
    with pytest.raises(ValueError, match="kvs: expected shape"):
        run(kvs[:-1], ape)
