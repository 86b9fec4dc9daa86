"""The pooling with the epilogue inside its kernels (``epilogue=`` on the fused ops) on the
GPU: bitwise the pooling op followed by the epilogue node (itself bitwise the composition of
torch ops), the output and every gradient (kv, score or the packed tensor, APE, the norm
weight), on ragged THD packs with capacity padding rows, grouped rows, SBHD, packed and
separate inputs; rotation on and off, rope_dim 0, 64 and head_dim; and that the kernels with
the epilogue are what ran (or, where they do not take the geometry, that nothing did)."""

import pytest
import torch

import csa_compressor as C
from csa_compressor.epilogue import Epilogue, eager_epilogue, grouped_positions
from csa_compressor.epilogue_op import apply_epilogue
from csa_compressor.grouped import grouped_offsets
from csa_compressor.kernels.tuning import current

pytestmark = pytest.mark.gpu

DEV = "cuda"


def record(monkeypatch, inside=("fwd", "bwd")):
    """The launches of the kernels with the epilogue inside from here on ("fwd" / "bwd"),
    the directions ``inside`` asked to run there whatever the package's default."""
    from csa_compressor import fused_epilogue
    from csa_compressor.kernels import launch

    if inside is not None:  # None: as the caller's epilogue_inside says
        monkeypatch.setattr(fused_epilogue, "DEFAULT_INSIDE",
                            fused_epilogue.EpilogueInside(inside, inside))
    seen = []
    fwd, bwd = launch.launch_forward, launch.launch_backward

    def launch_forward(p, out, epilogue=None, extra=()):
        if epilogue is not None:
            seen.append("fwd")
        return fwd(p, out, epilogue, extra)

    def launch_backward(p, *grads, workspace=None, epilogue=None, extra=()):
        if epilogue is not None:
            seen.append("bwd")
        return bwd(p, *grads, workspace=workspace, epilogue=epilogue, extra=extra)

    monkeypatch.setattr(launch, "launch_forward", launch_forward)
    monkeypatch.setattr(launch, "launch_backward", launch_backward)
    return seen


def thd_pack(ratio, T=24576 + 37):
    """Ragged offsets: a long segment, an empty one, one shorter than the ratio, a tail, and
    tokens past the last offset; plus capacity padding rows."""
    cu = torch.tensor([0, 8192, 8192, 8195, 9198, T - 37], dtype=torch.int32, device=DEV)
    cuc = C.compressed_cu_seqlens(cu, ratio)
    return T, cu, cuc, int(cuc[-1]) + 7


def inputs(T, width, d, ratio, coff, dtype, wdtype, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    kv = torch.randn(T, width, device=DEV, generator=gen).to(dtype)
    score = (2 * torch.randn(T, width, device=DEV, generator=gen)).to(dtype)
    ape = 0.5 * torch.randn(ratio, coff * d, device=DEV, generator=gen)
    w = (1 + 0.1 * torch.randn(d, device=DEV, generator=gen)).to(wdtype)
    return kv, score, ape, w


def run(fn, tensors, g):
    """(out, grads of ``tensors``) of ``fn(*leaves)``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves]


def assert_same(a, b, names):
    for name, x, y in zip(names, a, b):
        assert torch.equal(x, y), name


def thd_both_ways(monkeypatch, T, cu, cuc, n, d, ratio, coff, ep, seed, inside=("fwd", "bwd")):
    """(got, want, seen, fused, tensors): forward and backward of ``compress_thd_fused(...,
    epilogue=ep)`` (got, the directions ``inside`` asked to run in the kernels with the
    epilogue, seen) and of the pooling op then the epilogue node (want) on the same THD
    inputs (``tensors``: kv, score, ape, norm weight; ``fused``: the op on them)."""
    kv, score, ape, w = inputs(T, coff * d, d, ratio, coff, torch.bfloat16, torch.float32, seed)
    g = torch.randn(n, d, device=DEV).to(torch.bfloat16)
    kw = dict(ratio=ratio, coff=coff)
    pos = C.epilogue.rope_positions(cuc, n, ratio)

    def composed(kv, score, ape, w):
        return apply_epilogue(C.compress_thd_fused(kv, score, ape, cu, cuc, n, **kw), w, pos, ep)

    def fused(kv, score, ape, w):
        return C.compress_thd_fused(kv, score, ape, cu, cuc, n, **kw, epilogue=ep, norm_weight=w)

    tensors = (kv, score, ape, w)
    want = run(composed, tensors, g)
    seen = record(monkeypatch, inside)
    got = run(fused, tensors, g)
    return got, want, seen, fused, tensors


EPILOGUES = [
    Epilogue(rope_dim=64, rope_interleaved=True, rotate=True),
    Epilogue(rope_dim=64, rope_interleaved=False, rotate=False),
    Epilogue(rope_dim=0, rotate=True),
]


@pytest.mark.parametrize("inside", [("fwd", "bwd"), ("fwd",), ("bwd",)], ids="-".join)
@pytest.mark.parametrize("d,ratio,coff", [(128, 4, 2), (512, 4, 2), (64, 8, 1)])
@pytest.mark.parametrize("ep", EPILOGUES, ids=["rope64-rotate", "halves64", "rope0-rotate"])
def test_thd_is_the_pooling_then_the_epilogue(monkeypatch, d, ratio, coff, ep, inside):
    """Either direction inside after either forward (each direction's choice is its
    own: fused_epilogue.DEFAULT_INSIDE)."""
    T, cu, cuc, n = thd_pack(ratio)
    got, want, seen, _, (kv, score, ape, w) = thd_both_ways(monkeypatch, T, cu, cuc, n, d, ratio,
                                                            coff, ep, d, inside)
    assert seen == list(inside)
    assert_same(got, want, ("out", "dkv", "dscore", "dape", "dweight"))
    # and the composition of torch ops, forward
    pooled = C.compress_thd_fused(kv, score, ape, cu, cuc, n, ratio=ratio, coff=coff)
    pos = C.epilogue.rope_positions(cuc, n, ratio)
    assert torch.equal(got[0], eager_epilogue(pooled, w, pos, ep))


def test_packs_below_the_large_pack_variant(monkeypatch):
    """A pack of ~1750 rows takes the default d=128 backward, not the large-pack variant
    (BWD_LARGE_GUESS_PACK_ROWS); its kernel with the epilogue inside takes more registers
    than the plain one (2 CTAs an SM against 3 on the H200), yet runs the plain backward's
    row CTAs (launch.backward_plan), so the APE gradient's sum of their partials is the
    pooling op's bit for bit."""
    d, ratio, coff, T = 128, 4, 2, 7037
    cu = torch.tensor([0, 4096, 4096, 4099, 5000, T - 37], dtype=torch.int32, device=DEV)
    cuc = C.compressed_cu_seqlens(cu, ratio)
    n = int(cuc[-1]) + 7
    assert 16 <= n < current().BWD_LARGE_GUESS_PACK_ROWS
    ep = Epilogue(rope_dim=64, rotate=True)
    got, want, seen, _, _ = thd_both_ways(monkeypatch, T, cu, cuc, n, d, ratio, coff, ep, 2)
    assert seen == ["fwd", "bwd"]
    assert_same(got, want, ("out", "dkv", "dscore", "dape", "dweight"))


@pytest.mark.parametrize("d,rope_dim", [(128, 128), (512, 0), (256, 64)])
@pytest.mark.parametrize("score_first", [False, True])
def test_packed_and_grouped_are_the_pooling_then_the_epilogue(monkeypatch, d, rope_dim,
                                                              score_first):
    ratio, coff, G = 4, 2, 3 * 2048 + 5
    ids = torch.arange(G, device=DEV) % 2048 - (torch.arange(G, device=DEV) >= 3 * 2048).long() * 4096
    cu, cuc = grouped_offsets(ids.to(torch.int32), ratio)
    kv, score, ape, w = inputs(G * ratio, 2 * coff * d, d, ratio, coff, torch.bfloat16,
                               torch.bfloat16, rope_dim)
    kvs = kv  # (T, 2*coff*d): both halves
    g = torch.randn(G, d, device=DEV).to(torch.bfloat16)
    pos = grouped_positions(ids, ratio)
    ep = Epilogue(rope_dim=rope_dim, rotate=d != 256)
    kw = dict(ratio=ratio, coff=coff, score_first=score_first)

    def composed(kvs, ape, w):
        return apply_epilogue(C.compress_thd_fused_packed(kvs, ape, cu, cuc, G, **kw), w, pos, ep)

    want = run(composed, (kvs, ape, w), g)
    seen = record(monkeypatch)
    got = run(lambda kvs, ape, w: C.compress_thd_fused_packed(kvs, ape, cu, cuc, G, **kw,
                                                              epilogue=ep, norm_weight=w,
                                                              positions=pos),
              (kvs, ape, w), g)
    assert seen == ["fwd", "bwd"]
    assert_same(got, want, ("out", "dkvs", "dape", "dweight"))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("d,ratio,coff,ep,wdtype", [
    (128, 4, 2, Epilogue(rope_dim=64, rotate=True), torch.float32),
    (512, 4, 2, Epilogue(rope_dim=512, rotate=False), torch.float32),
    (512, 128, 1, Epilogue(rope_dim=64, rotate=False), torch.bfloat16),
], ids=["d128-rope64-rotate", "d512-rope512", "d512-r128-rope64"])
def test_sbhd_is_the_pooling_then_the_epilogue(monkeypatch, packed, d, ratio, coff, ep, wdtype):
    """One grid.z a sequence: flat rows (and, at ratio 128, the rows' counts) interleave
    the sequences."""
    S, B = 4100, 3
    kv, score, ape, w = inputs(S * B, coff * d, d, ratio, coff, torch.bfloat16, wdtype, 7)
    kv, score = kv.view(S, B, -1), score.view(S, B, -1)
    n = S // ratio
    g = torch.randn(n, B, d, device=DEV).to(torch.bfloat16)
    kw = dict(ratio=ratio, coff=coff)
    pos = C.epilogue.sbhd_positions(n, B, ratio, device=DEV)
    if packed:
        joint = torch.cat((kv, score), -1)

        def composed(kvs, ape, w):
            out = C.compress_sbhd_fused_packed(kvs, ape, **kw)
            return apply_epilogue(out.reshape(n * B, d), w, pos, ep).view(n, B, d)

        def fused(kvs, ape, w):
            return C.compress_sbhd_fused_packed(kvs, ape, **kw, epilogue=ep, norm_weight=w)

        tensors = (joint, ape, w)
    else:
        def composed(kv, score, ape, w):
            out = C.compress_sbhd_fused(kv, score, ape, **kw)
            return apply_epilogue(out.reshape(n * B, d), w, pos, ep).view(n, B, d)

        def fused(kv, score, ape, w):
            return C.compress_sbhd_fused(kv, score, ape, **kw, epilogue=ep, norm_weight=w)

        tensors = (kv, score, ape, w)
    want = run(composed, tensors, g)
    seen = record(monkeypatch)
    got = run(fused, tensors, g)
    assert seen == ["fwd", "bwd"]
    assert_same(got, want, ("out",) + ("d",) * (len(tensors) + 1))


@pytest.mark.parametrize("inside", [("fwd", "bwd"), ("fwd",), ("bwd",)], ids="-".join)
@pytest.mark.parametrize("d,ratio,coff,ep", [
    (512, 128, 1, Epilogue(rope_dim=64, rope_interleaved=False, rotate=False)),
    (128, 128, 2, Epilogue(rope_dim=64, rope_interleaved=True, rotate=True)),
    (512, 32, 1, Epilogue(rope_dim=512, rope_interleaved=False, rotate=True)),
], ids=["d512-r128-halves64", "d128-r128c2-rope64-rotate", "d512-r32-rope512-rotate"])
def test_long_windows_are_the_pooling_then_the_epilogue(monkeypatch, d, ratio, coff, ep, inside):
    """The slot-parallel kernels (a row over several CTAs): the forward's last CTA of a
    row runs its epilogue, every backward CTA its rows' whole epilogue backward; the same
    bits as the pooling then the epilogue node, and a CUDA graph's replays give them again
    (the rows' counts start from zero each replay)."""
    T, cu, cuc, n = thd_pack(ratio)
    got, want, seen, fused, tensors = thd_both_ways(monkeypatch, T, cu, cuc, n, d, ratio, coff,
                                                    ep, d + 1, inside)
    assert seen == list(inside)
    assert_same(got, want, ("out", "dkv", "dscore", "dape", "dweight"))
    if inside != ("fwd", "bwd"):
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        fused(*tensors)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = fused(*tensors)
    for _ in range(3):
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, want[0])


@pytest.mark.parametrize("ratio,coff,d,T", [(4, 2, 128, 40), (128, 1, 512, 1500)])
def test_where_the_kernels_do_not_take_it_the_composition_runs(monkeypatch, ratio, coff, d, T):
    """Packs of fewer rows than the norm's in-kernel statistics take: the pooling op and
    the epilogue node, the same bits."""
    cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    cuc = C.compressed_cu_seqlens(cu, ratio)
    n = int(cuc[-1])
    got, want, seen, _, _ = thd_both_ways(monkeypatch, T, cu, cuc, n, d, ratio, coff,
                                          Epilogue(rope_dim=64, rotate=True), 3)
    assert seen == []
    assert_same(got, want, ("out", "dkv", "dscore", "dape", "dweight"))


def test_the_module_runs_the_kernels_with_the_epilogue_and_graphs_capture_them(monkeypatch):
    torch.manual_seed(0)
    m = C.Compressor(1024, 128, 4, rope_dim=64, rotate=True, pooling="fused",
                     epilogue_inside=("fwd", "bwd")).cuda()
    T = 8192 + 37
    cu = torch.tensor([0, 4096, 4096, 4099, 5000, 8192], dtype=torch.int32, device=DEV)
    x = torch.randn(T, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    seen = record(monkeypatch)
    out, _ = m(x, cu, max_seqlen=4096)
    out.float().square().sum().backward()
    assert seen == ["fwd", "bwd"]
    # the same step, the pooling and the epilogue as two nodes
    ref = C.Compressor(1024, 128, 4, rope_dim=64, rotate=True, pooling="fused").cuda()
    ref.load_state_dict(m.state_dict())
    monkeypatch.setattr(ref, "_in_kernel_finish", lambda pos: None)
    x2 = x.detach().clone().requires_grad_(True)
    out2, _ = ref(x2, cu, max_seqlen=4096)
    out2.float().square().sum().backward()
    assert torch.equal(out, out2)
    assert torch.equal(x.grad, x2.grad)
    for (name, a), b in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), name
    # captured in a CUDA graph: the same output
    static_x = x.detach().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        m(static_x, cu, max_seqlen=4096)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out, _ = m(static_x, cu, max_seqlen=4096)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, out.detach())


def test_epilogue_inside_runs_the_modules_backward_in_one_kernel(monkeypatch):
    """The module's epilogue_inside: its step with the backward inside as well (the default
    runs it by parts), the same bits, and the kernels that ran the ones it names."""
    torch.manual_seed(1)
    m = C.Compressor(1024, 128, 4, rope_dim=64, rotate=True, pooling="fused").cuda()
    state = m.state_dict()
    T = 8192 + 37
    cu = torch.tensor([0, 4096, 4096, 4099, 5000, 8192], dtype=torch.int32, device=DEV)
    x = torch.randn(T, 1024, device=DEV, dtype=torch.bfloat16)
    results = []
    for short in (("fwd",), ("fwd", "bwd"), ()):
        m = C.Compressor(1024, 128, 4, rope_dim=64, rotate=True, pooling="fused",
                         epilogue_inside=C.EpilogueInside(short=short)).cuda()
        m.load_state_dict(state)
        seen = record(monkeypatch, inside=None)
        xi = x.clone().requires_grad_(True)
        out, _ = m(xi, cu, max_seqlen=4096)
        out.float().square().sum().backward()
        torch.cuda.synchronize()
        assert seen == list(short), (short, seen)
        results.append((out.detach(), xi.grad, [p.grad.clone() for p in m.parameters()]))
    for got in results[1:]:
        assert torch.equal(got[0], results[0][0]) and torch.equal(got[1], results[0][1])
        assert all(torch.equal(a, b) for a, b in zip(got[2], results[0][2]))


@pytest.mark.parametrize("packed", [False, True])
def test_under_torch_compile_the_same_kernels_and_bits(monkeypatch, packed):
    """fullgraph torch.compile: the node's directions as custom ops run the kernels with
    the epilogue inside, bit for bit the eager call."""
    ratio, coff, d = 4, 2, 128
    T, cu, cuc, n = thd_pack(ratio)
    kv, score, ape, w = inputs(T, 2 * coff * d, d, ratio, coff, torch.bfloat16, torch.float32, 5)
    g = torch.randn(n, d, device=DEV).to(torch.bfloat16)
    pos = C.epilogue.rope_positions(cuc, n, ratio)
    ep = Epilogue(rope_dim=64, rotate=True)
    kw = dict(ratio=ratio, coff=coff, epilogue=ep)
    if packed:
        def fn(kvs, ape, w):
            return C.compress_thd_fused_packed(kvs, ape, cu, cuc, n, **kw, norm_weight=w,
                                               positions=pos)
        tensors = (kv, ape, w)
    else:
        half = kv[:, : coff * d].contiguous()

        def fn(kv, score, ape, w):
            return C.compress_thd_fused(kv, score, ape, cu, cuc, n, **kw, norm_weight=w,
                                        positions=pos)
        tensors = (half, score[:, : coff * d].contiguous(), ape, w)
    want = run(fn, tensors, g)
    torch._dynamo.reset()
    seen = record(monkeypatch)
    got = run(torch.compile(fn, fullgraph=True), tensors, g)
    assert seen == ["fwd", "bwd"]
    assert_same(got, want, ("out",) + ("d",) * len(tensors))
