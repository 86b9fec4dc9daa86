"""torch.compile, CUDA graphs, dispatch, the Compressor module and streams on the GPU."""

import pytest
import torch

import csa_compressor as C
from csa_compressor import kernel_api
from csa_compressor import reference
from packs import make_pack

pytestmark = pytest.mark.gpu


def pack(**kw):
    return make_pack([100, 0, 3, 61, 256], 128, 4, 2, dtype=torch.bfloat16, device="cuda", **kw)


def fwd_bwd(fn, kv, score, ape, cu, cuc, N, g):
    leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
    out = fn(*leaves, cu, cuc, N)
    grads = torch.autograd.grad(out, leaves, g)
    return (out.detach(), *grads)


def fused(kv, score, ape, cu, cuc, N):
    return C.compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2)


def test_torch_compile_fullgraph_no_break_bitwise():
    import torch._dynamo

    kv, score, ape, cu, cuc, N = pack(extra_rows=2)
    g = torch.randn(N, 128, device="cuda").to(torch.bfloat16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fused, fullgraph=True)
    got = fwd_bwd(compiled, kv, score, ape, cu, cuc, N, g)
    want = fwd_bwd(fused, kv, score, ape, cu, cuc, N, g)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_cuda_graph_capture_replay_with_smaller_true_count():
    kv, score, ape, cu, cuc, N = pack(extra_rows=4)
    g = torch.randn(N, 128, device="cuda").to(torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
    s_cu, s_cuc = cu.clone(), cuc.clone()
    fwd_bwd(fused, kv, score, ape, cu, cuc, N, g)  # warm-up compiles
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fused(*leaves, s_cu, s_cuc, N)
        torch.autograd.grad(out, leaves, g)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = fused(*leaves, s_cu, s_cuc, N)
        grads = torch.autograd.grad(out, leaves, g)
    # New contents, and offsets with fewer true rows than at capture.
    new = make_pack([41, 23, 7, 0, 349], 128, 4, 2, dtype=torch.bfloat16, device="cuda", seed=9)
    assert new[0].shape == kv.shape
    for dst, src in zip(leaves, new[:3]):
        dst.data.copy_(src)
    s_cu.copy_(new[3])
    s_cuc.copy_(new[4])
    assert int(new[4][-1]) < int(cuc[-1])
    graph.replay()
    torch.cuda.synchronize()
    want = fwd_bwd(fused, *new[:5], N, g)
    for a, b in zip((out, *grads), want):
        assert torch.equal(a.detach(), b)


def test_compile_during_capture_raises_and_context_survives():
    kv, score, ape, cu, cuc, N = make_pack([64], 96, 4, 2, dtype=torch.float16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up call"):
        with torch.cuda.graph(graph):
            C.compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    torch.cuda.synchronize()
    out = C.compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2)  # usable afterwards
    ref = reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    assert (out != ref).sum() <= 1


def test_precompile_then_capture():
    kv, score, ape, cu, cuc, N = make_pack([64, 9], 80, 2, 2, dtype=torch.bfloat16, device="cuda")
    kernel_api.precompile(torch.bfloat16, 2, 2, 80)
    out = torch.empty(N, 80, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel_api.pool_forward(kv, score, ape, cu, cuc, out, ratio=2, coff=2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, C.compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=2, coff=2))


def test_dispatch_engages_and_refuses(monkeypatch):
    kv, score, ape, cu, cuc, N = pack()
    assert C.fused_unavailable_reason(kv, score, ape, cu, cuc, N, ratio=4, coff=2) is None
    out = C.maybe_compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    assert out is not None and torch.equal(out, fused(kv, score, ape, cu, cuc, N))
    assert C.maybe_compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2, enabled=False) is None
    r = C.fused_unavailable_reason(kv.double(), score.double(), ape, cu, cuc, N, ratio=4, coff=2)
    assert "kv: expected dtype" in r
    big = torch.empty(kv.numel() + 8, dtype=kv.dtype, device="cuda")
    r = C.fused_unavailable_reason(big[1:kv.numel() + 1].view_as(kv), score, ape, cu, cuc, N, ratio=4, coff=2)
    assert "aligned" in r
    r = C.fused_unavailable_reason(kv.t().contiguous().t(), score, ape, cu, cuc, N, ratio=4, coff=2)
    assert "contiguous" in r
    monkeypatch.setenv("CSA_COMPRESSOR_FUSED", "0")
    assert C.maybe_compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2) is None


def test_side_stream():
    kv, score, ape, cu, cuc, N = pack()
    want = fused(kv, score, ape, cu, cuc, N)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = fused(kv, score, ape, cu, cuc, N)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_non_default_device():
    kv, score, ape, cu, cuc, N = pack()
    want = fused(kv, score, ape, cu, cuc, N)
    with torch.cuda.device(0):
        got = fused(*(t.to("cuda:1") for t in (kv, score, ape, cu, cuc)), N)
    assert got.device == torch.device("cuda:1") and torch.equal(got.cpu(), want.cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_devices_alternate_in_one_process():
    """Issue 6: forward + backward on cuda:0 and cuda:1 in turn, each with the other device
    current and on a side stream of its own device: a kernel compiled and cached per
    device, launched on the tensors' device and its current stream, results bitwise those
    of cuda:0 alone. ratio 128 too: the slot-parallel kernels and their own schedule."""
    from csa_compressor.kernels import compile as cc, plan

    for ratio, coff in ((4, 2), (128, 1)):
        kv, score, ape, cu, cuc, N = make_pack([3 * ratio + 5, 0, 2 * ratio, 61], 128, ratio,
                                               coff, dtype=torch.bfloat16, device="cuda:0",
                                               extra_rows=2, seed=ratio)
        g = torch.randn(N, 128, device="cuda:0").to(torch.bfloat16)

        def call(*a):
            return C.compress_thd_fused(*a, ratio=ratio, coff=coff)

        want = [t.cpu() for t in fwd_bwd(call, kv, score, ape, cu, cuc, N, g)]
        for step in range(4):
            dev = torch.device("cuda", step % 2)
            args = [t.to(dev) for t in (kv, score, ape, cu, cuc)]
            gd = g.to(dev)
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            # Stream first: entering a stream context makes its device current.
            with torch.cuda.stream(side), torch.cuda.device(1 - dev.index):
                assert torch.cuda.current_device() != dev.index
                assert torch.cuda.current_stream(dev) == side
                got = fwd_bwd(call, *args, N, gd)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            for a, b in zip(got, want):
                assert a.device == dev and torch.equal(a.cpu(), b)
        for index in (0, 1):
            for direction in ("fwd", "bwd", "dape"):
                spec = plan.spec(direction, torch.bfloat16, ratio, coff, 128)
                assert ("cuda", index, spec) in cc._CACHE, spec


@pytest.mark.parametrize("ratio", [4, 128])
def test_module_fused_matches_reference_pooling(ratio):
    torch.manual_seed(0)
    m_f = C.Compressor(256, 128, ratio, device="cuda", pooling="fused")
    m_r = C.Compressor(256, 128, ratio, device="cuda", pooling="reference")
    m_r.load_state_dict(m_f.state_dict())
    lens = [3 * ratio + 5, 0, 2 * ratio, ratio - 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = torch.randn(sum(lens), 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for m in (m_f, m_r):
        xi = x.clone().requires_grad_(True)
        y, _ = m(xi, cu, max_seqlen=max(lens))
        y.float().square().sum().backward()
        outs.append((y.detach(), xi.grad, [p.grad for p in m.parameters()]))
    (yf, gxf, gpf), (yr, gxr, gpr) = outs
    torch.testing.assert_close(yf, yr, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gxf, gxr, rtol=2e-2, atol=2e-2)
    for a, b in zip(gpf, gpr):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    # SBHD
    xs = torch.randn(4 * ratio, 2, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(m_f(xs), m_r(xs), rtol=2e-2, atol=2e-2)


def test_module_training_step_compiles_without_breaks_and_with_checkpoint_autocast():
    import torch._dynamo
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = C.Compressor(256, 128, 4, device="cuda")
    cu = torch.tensor([0, 300, 301, 512], dtype=torch.int32, device="cuda")
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)

    def step(mod, x):
        y, _ = mod(x, cu, total_comp=128)
        return y.float().square().mean()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    loss_c = compiled(m, x)
    loss_c.backward()
    g_c = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    loss_e = step(m, x)
    loss_e.backward()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    # Inductor fuses the RMSNorm/RoPE around the op and may round differently there; the
    # pooling op itself is bitwise equal under compile (test above).
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-3, atol=1e-5)
    for a, p in zip(g_c, m.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=2e-2, atol=1e-4)
    m.zero_grad()
    xf = x.float().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = checkpoint(lambda t: step(m, t), xf, use_reentrant=False)
    loss.backward()
    assert torch.isfinite(xf.grad).all() and all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_module_training_step_under_cuda_graph():
    """Issue 4 §2 for the whole module: a Compressor forward + backward captured once and
    replayed with new activations and offsets (fewer true rows) equals a direct call."""
    import copy

    torch.manual_seed(0)
    m = C.Compressor(256, 128, 4, device="cuda", pooling="fused")
    m_ref = copy.deepcopy(m)

    def offsets(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                            device="cuda")

    lens, new_lens = [100, 0, 3, 61, 256], [41, 23, 7, 0, 349]
    T = sum(lens)
    assert sum(new_lens) == T
    N = C.layout.compressed_capacity(T, len(lens), max(max(lens), max(new_lens)), 4)
    static_x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    static_cu = offsets(lens)

    def step(model, x, cu):
        y, _ = model(x, cu, total_comp=N)
        y.float().square().sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, settles the allocator
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            step(m, static_x, static_cu)
    torch.cuda.current_stream().wait_stream(side)
    m.zero_grad(set_to_none=True)  # gradients get allocated inside the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step(m, static_x, static_cu)

    new_x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    new_cu = offsets(new_lens)
    static_x.copy_(new_x)
    static_cu.copy_(new_cu)
    graph.replay()
    torch.cuda.synchronize()
    y_ref = step(m_ref, new_x, new_cu)
    assert int(C.compressed_cu_seqlens(new_cu, 4)[-1]) < int(C.compressed_cu_seqlens(offsets(lens), 4)[-1])
    assert torch.equal(static_y.detach(), y_ref.detach())
    for (name, p), q in zip(m.named_parameters(), m_ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
