"""SBHD on the GPU: compress_sbhd_fused reads the (S, B, coff*d) token rows in place (one
sequence a grid index) and gives, bitwise, what compress_thd_fused gives on the sequences
packed one after another; the packed [kv | score] form bitwise the plain one; torch.compile
and CUDA-graph capture; the module's and Megatron's SBHD paths through it."""

import pytest
import torch

import csa_compressor as C
from csa_compressor import kernel_api

pytestmark = pytest.mark.gpu

CASES = [  # (S, B, d, ratio, coff, dtype)
    (37, 3, 128, 4, 2, torch.bfloat16),  # a tail of one token a sequence
    (8192, 3, 128, 4, 2, torch.bfloat16),  # the large-pack backward (6144 rows in all)
    (1030, 2, 512, 4, 2, torch.bfloat16),
    (4096, 1, 512, 4, 2, torch.bfloat16),  # one sequence: the THD kernels
    (300, 2, 512, 128, 1, torch.bfloat16),  # the slot-parallel kernels, a 44-token tail
    (70, 5, 64, 16, 2, torch.float32),
    (50, 4, 96, 3, 2, torch.float16),
    (129, 2, 64, 1, 1, torch.bfloat16),
    (3, 2, 128, 4, 2, torch.bfloat16),  # S < ratio: no rows, zero gradients
]


def _inputs(S, B, d, ratio, coff, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    W = coff * d
    kv = torch.randn(S, B, W, generator=gen).to(dtype).cuda()
    score = (2 * torch.randn(S, B, W, generator=gen)).to(dtype).cuda()
    ape = torch.randn(ratio, W, generator=gen).cuda()
    g = torch.randn(S // ratio, B, d, generator=gen).to(dtype).cuda()
    return kv, score, ape, g


def _thd_step(kv, score, ape, g, ratio, coff):
    """compress_thd_fused on the B sequences packed one after another, in SBHD shapes."""
    S, B, W = kv.shape
    n = S // ratio
    leaves = [t.detach().transpose(0, 1).reshape(B * S, W).requires_grad_(True)
              for t in (kv, score)] + [ape.detach().clone().requires_grad_(True)]
    steps = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    out = C.compress_thd_fused(*leaves, steps * S, steps * n, B * n, ratio=ratio, coff=coff)
    grads = torch.autograd.grad(out, leaves, g.transpose(0, 1).reshape(B * n, -1))
    unpack = lambda t: t.view(B, S, W).transpose(0, 1)  # noqa: E731
    return [out.view(B, n, -1).transpose(0, 1), unpack(grads[0]), unpack(grads[1]), grads[2]]


def _sbhd_step(kv, score, ape, g, ratio, coff, fn=C.compress_sbhd_fused):
    leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
    out = fn(*leaves, ratio=ratio, coff=coff)
    if out.numel() == 0:
        out.sum().backward()
        return [out.detach()] + [t.grad for t in leaves]
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


@pytest.mark.parametrize("S,B,d,ratio,coff,dtype", CASES)
def test_sbhd_is_the_thd_op_on_the_packed_sequences_bitwise(S, B, d, ratio, coff, dtype):
    kv, score, ape, g = _inputs(S, B, d, ratio, coff, dtype)
    got = _sbhd_step(kv, score, ape, g, ratio, coff)
    assert got[0].shape == (S // ratio, B, d)
    if S < ratio:
        assert all(torch.equal(t, torch.zeros_like(t)) for t in got[1:])
        return
    want = _thd_step(kv, score, ape, g, ratio, coff)
    for name, a, b in zip(("out", "dkv", "dscore", "dape"), got, want):
        if name == "dape":  # the partial sums are grouped by sequence: another fixed order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("S,B,d,ratio,coff,dtype", [CASES[0], CASES[2], CASES[4], CASES[6]])
def test_sbhd_packed_is_the_plain_op_bitwise(S, B, d, ratio, coff, dtype):
    kv, score, ape, g = _inputs(S, B, d, ratio, coff, dtype)
    want = _sbhd_step(kv, score, ape, g, ratio, coff)
    kvs = torch.cat((kv, score), 2).requires_grad_(True)
    a = ape.clone().requires_grad_(True)
    out = C.compress_sbhd_fused_packed(kvs, a, ratio=ratio, coff=coff)
    dkvs, dape = torch.autograd.grad(out, (kvs, a), g)
    W = kv.shape[2]
    for name, x, y in zip(("out", "dkv", "dscore", "dape"),
                          (out, dkvs[..., :W], dkvs[..., W:], dape), want):
        assert torch.equal(x, y), name


def test_sbhd_reruns_are_bitwise_and_dape_is_the_reference_sum():
    kv, score, ape, g = _inputs(1030, 3, 512, 4, 2, torch.bfloat16)
    first = _sbhd_step(kv, score, ape, g, 4, 2)
    again = _sbhd_step(kv, score, ape, g, 4, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    a = ape.detach().clone().requires_grad_(True)
    ref = C.reference.compress_sbhd(kv, score, a, ratio=4, coff=2, mode="fp64")
    (dape,) = torch.autograd.grad(ref, a, g.to(ref.dtype))
    torch.testing.assert_close(first[3].double(), dape.double(), rtol=1e-4, atol=1e-3)


def test_sbhd_under_torch_compile_fullgraph_and_graph_capture_bitwise():
    import torch._dynamo

    S, B, d, ratio, coff = 257, 3, 128, 4, 2
    kv, score, ape, g = _inputs(S, B, d, ratio, coff, torch.bfloat16)
    want = _sbhd_step(kv, score, ape, g, ratio, coff)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(C.compress_sbhd_fused, fullgraph=True)
    got = _sbhd_step(kv, score, ape, g, ratio, coff, fn=compiled)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    for name, a, b in zip(("out", "dkv", "dscore", "dape"), got, want):
        assert torch.equal(a, b), name

    kernel_api.precompile(torch.bfloat16, ratio, coff, d, sbhd_batch=B)
    leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up the side stream
        _sbhd_step(kv, score, ape, g, ratio, coff)
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        out = C.compress_sbhd_fused(*leaves, ratio=ratio, coff=coff)
        grads = torch.autograd.grad(out, leaves, g)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dkv", "dscore", "dape"), (out, *grads), want):
        assert torch.equal(a, b), name


def test_sbhd_rejects_what_the_kernels_cannot_read_and_the_dispatch_transposes_it():
    kv, score, ape, _ = _inputs(64, 2, 128, 4, 2, torch.bfloat16)
    with pytest.raises(ValueError, match="kv: expected contiguous"):
        C.compress_sbhd_fused(kv.transpose(0, 1).contiguous().transpose(0, 1), score, ape,
                              ratio=4, coff=2)
    kv, score, ape, _ = _inputs(64, 2, 60, 4, 2, torch.bfloat16)  # 120-byte rows
    with pytest.raises(ValueError, match="multiples of 16"):
        C.compress_sbhd_fused(kv, score, ape, ratio=4, coff=2)
    from csa_compressor.dispatch import fused_sbhd_or_reason

    # the dispatch: one transposed copy, the THD op on it
    out, reason = fused_sbhd_or_reason(kv, score, ape, ratio=4, coff=2)
    assert reason is None and out.shape == (16, 2, 60)
    want = _thd_step(kv, score, ape, torch.zeros(16, 2, 60, dtype=torch.bfloat16, device="cuda"),
                     4, 2)[0]
    assert torch.equal(out, want)


def test_the_module_sbhd_path_reads_the_projection_in_place(monkeypatch):
    """Compressor's SBHD step takes the packed SBHD op (one GEMM, no transposed copy) and
    gives the reference pooling's output and gradients within bf16 rounding."""
    from csa_compressor import dispatch

    torch.manual_seed(0)
    m = C.Compressor(256, 128, 4, dtype=torch.bfloat16, device="cuda")
    r = C.Compressor(256, 128, 4, dtype=torch.bfloat16, device="cuda", pooling="reference")
    r.load_state_dict(m.state_dict())
    launched, unavailable = [], dispatch.unavailable

    def spy(*a, **k):
        reason, p = unavailable(*a, **k)
        launched.append((p.batch, p.row_stride) if p is not None else reason)
        return reason, p

    monkeypatch.setattr(dispatch, "unavailable", spy)
    x = torch.randn(203, 3, 256, device="cuda").to(torch.bfloat16)
    res = []
    for mod in (m, r):
        xi = x.clone().requires_grad_(True)
        out = mod(xi)
        assert out.shape == (50, 3, 128)
        out.float().square().sum().backward()
        res.append([out.float(), xi.grad.float()] + [p.grad.float() for p in mod.parameters()])
    assert launched == [(3, 3 * 2 * 256)]
    for a, b in zip(*res):
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=2e-2)
