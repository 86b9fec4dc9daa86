"""The packed layout on the GPU: compress_thd_fused_packed reads kv and score as the column
halves of one tensor and writes their gradients into one tensor of that layout, bitwise
what compress_thd_fused gives on the halves (the same kernels, compiled for the longer row
stride), under torch.compile too; the module's one projection through it."""

import pytest
import torch

import csa_compressor as C
from csa_compressor import kernel_api
from packs import make_pack

pytestmark = pytest.mark.gpu

CASES = [  # (lens, d, ratio, coff, dtype)
    ([100, 0, 3, 61, 256], 128, 4, 2, torch.bfloat16),
    ([8192, 8192], 128, 4, 2, torch.bfloat16),  # the large-pack backward
    ([300, 0, 257, 9], 512, 4, 2, torch.bfloat16),
    ([300, 0, 127, 520], 512, 128, 1, torch.bfloat16),
    ([37, 5, 64], 64, 4, 1, torch.float16),
    ([70, 33], 64, 16, 2, torch.float32),
    ([50, 1, 77], 96, 3, 2, torch.bfloat16),
]


def _steps(kv, score, ape, cu, cuc, N, ratio, coff, g, packed_fn=C.compress_thd_fused_packed,
           score_first=False):
    leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
    out = C.compress_thd_fused(*leaves, cu, cuc, N, ratio=ratio, coff=coff)
    want = [out.detach(), *torch.autograd.grad(out, leaves, g)]
    kvs = torch.cat((score, kv) if score_first else (kv, score), 1).requires_grad_(True)
    a = ape.detach().clone().requires_grad_(True)
    kw = dict(score_first=True) if score_first else {}
    out = packed_fn(kvs, a, cu, cuc, N, ratio=ratio, coff=coff, **kw)
    dkvs, dape = torch.autograd.grad(out, (kvs, a), g)
    w = kv.shape[1]
    first, second = dkvs[:, :w], dkvs[:, w:]
    return want, [out.detach(), *((second, first) if score_first else (first, second)), dape]


@pytest.mark.parametrize("lens,d,ratio,coff,dtype", CASES)
def test_packed_is_the_plain_op_bitwise(lens, d, ratio, coff, dtype):
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           extra_rows=3)
    g = torch.randn(N, d, device="cuda").to(dtype)
    want, got = _steps(kv, score, ape, cu, cuc, N, ratio, coff, g)
    for name, a, b in zip(("out", "dkv", "dscore", "dape"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("lens,d,ratio,coff,dtype", [CASES[0], CASES[1], CASES[3]])
def test_packed_score_first_is_the_plain_op_bitwise(lens, d, ratio, coff, dtype):
    """``[score | kv]`` (score_first): the same kernels on the swapped views, the gradient
    in the input's layout."""
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           extra_rows=3)
    g = torch.randn(N, d, device="cuda").to(dtype)
    want, got = _steps(kv, score, ape, cu, cuc, N, ratio, coff, g, score_first=True)
    for name, a, b in zip(("out", "dkv", "dscore", "dape"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1)])
def test_packed_sbhd_score_first_is_the_plain_op_bitwise(ratio, coff):
    S, B, d = 4100 if ratio == 4 else 1030, 3, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    kv, score = (torch.randn(S, B, coff * d, device="cuda", generator=gen).bfloat16()
                 for _ in range(2))
    ape = torch.randn(ratio, coff * d, device="cuda", generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
    out = C.compress_sbhd_fused(*leaves, ratio=ratio, coff=coff)
    g = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    want = [out.detach(), *torch.autograd.grad(out, leaves, g)]
    kvs = torch.cat((score, kv), 2).requires_grad_(True)
    a = ape.clone().requires_grad_(True)
    out = C.compress_sbhd_fused_packed(kvs, a, ratio=ratio, coff=coff, score_first=True)
    dkvs, dape = torch.autograd.grad(out, (kvs, a), g)
    w = coff * d
    for name, x, y in zip(("out", "dkv", "dscore", "dape"),
                          (out.detach(), dkvs[..., w:], dkvs[..., :w], dape), want):
        assert torch.equal(x, y), name


def test_packed_under_torch_compile_fullgraph_bitwise():
    import torch._dynamo

    kv, score, ape, cu, cuc, N = make_pack([100, 0, 3, 61, 256], 128, 4, 2, dtype=torch.bfloat16,
                                           device="cuda", extra_rows=2)
    g = torch.randn(N, 128, device="cuda").to(torch.bfloat16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(C.compress_thd_fused_packed, fullgraph=True)
    want, got = _steps(kv, score, ape, cu, cuc, N, 4, 2, g, packed_fn=compiled)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    for name, a, b in zip(("out", "dkv", "dscore", "dape"), got, want):
        assert torch.equal(a, b), name


def test_the_module_projects_once_through_the_packed_kernels(monkeypatch):
    """Compressor's THD step on the GPU takes the packed op (one GEMM), and gives the
    reference pooling's output and gradients within bf16 rounding."""
    from csa_compressor import dispatch

    torch.manual_seed(0)
    m = C.Compressor(256, 128, 4, dtype=torch.bfloat16, device="cuda")
    r = C.Compressor(256, 128, 4, dtype=torch.bfloat16, device="cuda", pooling="reference")
    r.load_state_dict(m.state_dict())
    assert m.one_projection
    launched, fused = [], dispatch.fused_from_validated
    monkeypatch.setattr(dispatch, "fused_from_validated",
                        lambda p, *a, **k: launched.append(p.row_stride) or fused(p, *a, **k))
    cu = torch.tensor([0, 300, 300, 1030], dtype=torch.int32, device="cuda")
    x = torch.randn(1030, 256, device="cuda").to(torch.bfloat16)
    res = []
    for mod in (m, r):
        xi = x.clone().requires_grad_(True)
        out, _ = mod(xi, cu, max_seqlen=730)
        out.float().square().sum().backward()
        res.append([out.float(), xi.grad.float()] + [p.grad.float() for p in mod.parameters()])
    assert launched == [2 * 256]
    for a, b in zip(*res):
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=2e-2)


def test_precompile_packed_then_capture_forward_and_backward():
    """precompile(packed=True) covers the packed kernels: a first packed step inside CUDA-graph
    capture compiles nothing, and the replay gives the eager step's results."""
    kv, score, ape, cu, cuc, N = make_pack([64, 9, 130], 80, 2, 2, dtype=torch.bfloat16,
                                           device="cuda", extra_rows=2)
    kernel_api.precompile(torch.bfloat16, 2, 2, 80, packed=True)
    kvs = torch.cat((kv, score), 1).requires_grad_(True)
    a = ape.clone().requires_grad_(True)
    g = torch.randn(N, 80, device="cuda").to(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm the side stream up on the plain op's step
        leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
        torch.autograd.grad(C.compress_thd_fused(*leaves, cu, cuc, N, ratio=2, coff=2), leaves, g)
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        out = C.compress_thd_fused_packed(kvs, a, cu, cuc, N, ratio=2, coff=2)
        dkvs, dape = torch.autograd.grad(out, (kvs, a), g)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    want = C.compress_thd_fused_packed(kvs, a, cu, cuc, N, ratio=2, coff=2)
    wkvs, wdape = torch.autograd.grad(want, (kvs, a), g)
    assert torch.equal(out, want) and torch.equal(dkvs, wkvs) and torch.equal(dape, wdape)
