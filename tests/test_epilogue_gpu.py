"""The epilogue node on the GPU, at the module's scale (3 x 8192 tokens at ratio 4): bitwise
the composition of torch ops it replaces, forward and both gradients, on THD (capacity
padding rows), grouped and SBHD positions; and the module's step through it captured in a
CUDA graph."""

import pytest
import torch
from csa_compressor import epilogue_op

import csa_compressor as C
from csa_compressor.epilogue import Epilogue, eager_epilogue, grouped_positions
from csa_compressor.epilogue import rope_positions, sbhd_positions
from csa_compressor.epilogue_op import apply_epilogue

pytestmark = pytest.mark.gpu


def node_and_composition(x, w, g, pos, ep):
    """(out, grad of the rows, grad of the weight) of the node and of the composition."""
    res = []
    for fn in (apply_epilogue, eager_epilogue):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xi, wi, pos, ep)
        out.backward(g)
        res.append((out.detach(), xi.grad, wi.grad))
    return res


def assert_same(res):
    for name, a, b in zip(("out", "grad pooled", "grad norm_weight"), *res):
        assert torch.equal(a, b), name


def record_launches(monkeypatch, x, w, ep):
    """The row kernel's launches from here on: (backward, with the norm's math) each. The
    geometry's once-only order check runs first (its probe launch is not a step's), and
    where the kernel takes the norm it must have found torch's order."""
    from csa_compressor import epilogue
    from csa_compressor.kernels import epilogue_rows

    if epilogue_op._rows_kernel(x, w, ep) and x.shape[0] >= epilogue_op.ROWSUM_MIN_ROWS:
        assert epilogue_op.norm_in_kernel(x, w, ep), "the kernel's row sums are not torch's"

    launched, run = [], epilogue_rows.run
    monkeypatch.setattr(epilogue_rows, "run", lambda bwd, *a, **k: launched.append(
        (bwd, k.get("norm_eps") is not None)) or run(bwd, *a, **k))
    return launched


@pytest.mark.parametrize("layout", ["thd", "grouped", "sbhd"])
@pytest.mark.parametrize("d,rope_dim,interleaved,rotate,dtype", [
    (128, 64, True, True, torch.bfloat16), (512, 64, True, False, torch.bfloat16),
    (512, 512, True, True, torch.bfloat16), (128, 64, False, True, torch.bfloat16),
    (256, 0, True, True, torch.bfloat16), (64, 32, True, False, torch.float32),
    (256, 0, True, True, torch.float16),
    (192, 0, True, False, torch.bfloat16),  # torch's row sum: 48 vectors, lanes unequal
    (160, 0, True, False, torch.bfloat16),  # 40 vectors: 8 lanes with two
    (96, 0, True, False, torch.bfloat16),  # single values, three a lane
    (32, 0, True, True, torch.float32),  # one channel a lane, no rotary table
    (96, 32, True, False, torch.bfloat16),  # a geometry the kernel does not cover: torch ops
])
def test_the_epilogue_node_is_the_composition_on_the_gpu(monkeypatch, layout, d, rope_dim,
                                                         interleaved, rotate, dtype):
    ratio, n = 4, 3 * 2048 + 5
    dev = torch.device("cuda")
    if layout == "thd":  # ragged, an empty and a sub-ratio segment, capacity padding rows
        cu = torch.tensor([0, 8192, 8192, 8195, 9198, 24576], dtype=torch.int32, device=dev)
        n = int(C.compressed_cu_seqlens(cu, ratio)[-1]) + 7
        pos = rope_positions(C.compressed_cu_seqlens(cu, ratio), n, ratio, max_seqlen=15378)
    elif layout == "grouped":
        ids = torch.arange(n, device=dev) % 2048 - (torch.arange(n, device=dev) >= 3 * 2048).long() * 4096
        pos = grouped_positions(ids, ratio)
    else:
        n = 3 * 2048
        pos = sbhd_positions(2048, 3, ratio, device=dev)
    gen = torch.Generator(device=dev).manual_seed(d)
    x = (3 * torch.randn(n, d, device=dev, generator=gen)).to(dtype)
    w = (1 + 0.1 * torch.randn(d, device=dev, generator=gen)).to(dtype)
    g = torch.randn(n, d, device=dev, generator=gen).to(dtype)
    ep = Epilogue(rope_dim=rope_dim, rope_theta=160000.0, rope_interleaved=interleaved,
                  rotate=rotate)
    from csa_compressor.kernels import epilogue_rows

    launched = record_launches(monkeypatch, x, w, ep)
    res = node_and_composition(x, w, g, pos, ep)
    covered = epilogue_rows.supported(dtype, d, rope_dim, interleaved, rotate)
    assert launched == ([(False, True), (True, True)] if covered else []), launched
    assert_same(res)


@pytest.mark.parametrize("d,rope_dim,rotate,rows,weight,offset", [
    (128, 64, True, torch.bfloat16, torch.float32, 0),  # Megatron's without Float16Module
    (512, 64, False, torch.bfloat16, torch.float32, 0),
    (256, 0, True, torch.float16, torch.float32, 0),
    (128, 64, True, torch.bfloat16, torch.bfloat16, 1),  # 2 bytes past an aligned address
    (512, 64, False, torch.bfloat16, torch.float32, 3),  # 12 bytes past
])
def test_a_norm_weight_of_its_own_dtype_or_address_runs_the_kernel(monkeypatch, d, rope_dim,
                                                                   rotate, rows, weight, offset):
    """The row kernel reads the norm weight in its own dtype (widened to fp32, as the
    composition's ``weight.float()``), and one at an address its vector loads cannot take
    (a weight inside a flat parameter buffer) through a copy: both directions launch, and
    every tensor, the weight's fp32 gradient too, is the composition's bit for bit."""
    dev = torch.device("cuda")
    cu = torch.tensor([0, 8192, 8192, 8195, 9198, 24576], dtype=torch.int32, device=dev)
    cuc = C.compressed_cu_seqlens(cu, 4)
    n = int(cuc[-1]) + 7
    pos = rope_positions(cuc, n, 4, max_seqlen=15378)
    gen = torch.Generator(device=dev).manual_seed(d + offset)
    x = (3 * torch.randn(n, d, device=dev, generator=gen)).to(rows)
    flat = (1 + 0.1 * torch.randn(d + offset, device=dev, generator=gen)).to(weight)
    w = flat[offset:]
    assert (w.data_ptr() % 16 == 0) == (offset == 0)
    g = torch.randn(n, d, device=dev, generator=gen).to(rows)
    ep = Epilogue(rope_dim=rope_dim, rope_theta=160000.0, rotate=rotate)
    launched = record_launches(monkeypatch, x, w, ep)
    res = []
    for fn in (apply_epilogue, eager_epilogue):
        # the leaf is the slice's base: the weight keeps its address
        fi = flat.clone().requires_grad_(True)
        xi, wi = x.clone().requires_grad_(True), fi[offset:]
        out = fn(xi, wi, pos, ep)
        out.backward(g)
        res.append((out.detach(), xi.grad, fi.grad))
    assert launched == [(False, True), (True, True)], launched
    assert res[0][2].dtype == weight
    assert_same(res)


@pytest.mark.parametrize("interleaved,rotate", [(True, True), (False, False)])
def test_a_caller_rotary_table_on_the_gpu(monkeypatch, interleaved, rotate):
    """rope_table (cos, sin by position) through the row kernel: bitwise the composition on
    that table, and, for a table of the theta path's angles, the theta path's bits."""
    from csa_compressor.epilogue import rope_inv_freq

    dev = torch.device("cuda")
    cu = torch.tensor([0, 8192, 8192, 8195, 9198, 24576], dtype=torch.int32, device=dev)
    cuc = C.compressed_cu_seqlens(cu, 4)
    n = int(cuc[-1]) + 7
    pos = rope_positions(cuc, n, 4, max_seqlen=15378)
    gen = torch.Generator(device=dev).manual_seed(11)
    x = (3 * torch.randn(n, 128, device=dev, generator=gen)).bfloat16()
    w = (1 + 0.1 * torch.randn(128, device=dev, generator=gen)).bfloat16()
    g = torch.randn(n, 128, device=dev, generator=gen).bfloat16()
    ep = Epilogue(rope_dim=64, rope_theta=160000.0, rope_interleaved=interleaved, rotate=rotate)
    inv = rope_inv_freq(64, 160000.0, device=dev)
    ang = (torch.arange(15378, device=dev, dtype=torch.float64)[:, None] * inv).float()
    table = (torch.cos(ang), torch.sin(ang))
    launched = record_launches(monkeypatch, x, w, ep)
    res = []
    for fn, kw in ((apply_epilogue, dict(rope_table=table)),
                   (eager_epilogue, dict(rope_table=table)), (apply_epilogue, {})):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xi, wi, pos, ep, **kw)
        out.backward(g)
        res.append((out.detach(), xi.grad, wi.grad))
    assert launched == [(False, True), (True, True), (False, True), (True, True)]
    for want in res[1:]:
        for a, b in zip(res[0], want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 33])
@pytest.mark.parametrize("d,rotate", [(128, True), (512, False)])
def test_few_rows_take_torch_statistics_and_match(monkeypatch, n, d, rotate):
    """Below 16 rows torch's reduce gives a row more than a warp (another order): the
    kernel then takes torch's statistics; either way the node is the composition."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n)
    x = (3 * torch.randn(n, d, device=dev, generator=gen)).bfloat16()
    w = (1 + 0.1 * torch.randn(d, device=dev, generator=gen)).bfloat16()
    g = torch.randn(n, d, device=dev, generator=gen).bfloat16()
    pos = torch.arange(n, device=dev) * 4
    ep = Epilogue(rope_dim=64, rotate=rotate, eps=1e-5)
    launched = record_launches(monkeypatch, x, w, ep)
    res = node_and_composition(x, w, g, pos, ep)
    assert launched == [(False, n >= 16), (True, n >= 16)]
    assert_same(res)


@pytest.mark.parametrize("small_compiled", [True, False])
def test_the_module_step_with_the_epilogue_node_captures(monkeypatch, small_compiled):
    """The module's step captured in a CUDA graph, replayed bit for bit the eager step.
    ``small_compiled`` False: the pooling kernels are compiled but the small ones beside
    them (offsets, rotary positions and angles, the epilogue's rows) are not; they are not
    compiled inside the capture, their torch ops run instead."""
    from csa_compressor.kernels import jit as kjit

    torch.manual_seed(0)
    m = C.Compressor(512, 128, 4, rotate=True, device="cuda")
    cu = torch.tensor([0, 300, 300, 1030], dtype=torch.int32, device="cuda")
    x = torch.randn(1030, 512, device="cuda").bfloat16().requires_grad_(True)
    g = torch.randn(257, 128, device="cuda").bfloat16()

    def step():
        out, _ = m(x, cu, max_seqlen=730)
        grads = torch.autograd.grad(out, [x, *m.parameters()], g)
        # detached: an output kept with its graph keeps the eager step's AccumulateGrad
        # nodes (default stream) alive, and the captured backward would wait on that stream
        return (out.detach(), *grads)

    want = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    if not small_compiled:
        monkeypatch.setattr(kjit, "_SMALL", {})  # as if never compiled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        got = step()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    if not small_compiled:
        assert kjit._SMALL == {}
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d,ratio,rotate", [(128, 4, True), (512, 4, False), (512, 128, False)])
def test_the_module_with_the_epilogue_node_is_the_module_with_torch_ops(d, ratio, rotate):
    """The module's step (fused pooling, then the epilogue kernels) against the same module
    with its epilogue as the composition of torch ops: output and every gradient bitwise,
    on a ragged pack with capacity padding rows."""
    torch.manual_seed(0)
    m = C.Compressor(256, d, ratio, rotate=rotate, device="cuda", pooling="fused")
    lens = [1030, 0, 3, 2600, 517]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = torch.randn(sum(lens), 256, device="cuda").bfloat16()
    res = []
    for fused in (True, False):
        m.fused_epilogue = fused
        xi = x.clone().requires_grad_(True)
        out, _ = m(xi, cu, max_seqlen=max(lens))
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
        res.append((out.detach(), *torch.autograd.grad(out, [xi, *m.parameters()], g)))
    for i, (a, b) in enumerate(zip(*res)):
        assert torch.equal(a, b), i


def test_a_row_sum_order_unlike_torchs_is_caught(monkeypatch):
    """The kernel built with the warp's combine reversed (an order torch does not use):
    the once-a-geometry check finds its statistics off torch's and the node keeps torch's
    statistics, bitwise the composition still."""
    from csa_compressor import epilogue
    from csa_compressor.kernels import epilogue_rows

    from csa_compressor.kernels import disk_cache, jit as kjit

    monkeypatch.setattr(epilogue_rows, "ROWSUM_WARP_OFFSETS", (1, 2, 4, 8, 16))
    monkeypatch.setattr(kjit, "_SMALL", {})  # built afresh, not taken from a cache
    monkeypatch.delenv(disk_cache.ENV, raising=False)
    monkeypatch.setattr(epilogue_op, "_ROWSUM_AGREES", {})
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    x = (3 * torch.randn(4096, 512, device=dev, generator=gen)).bfloat16()
    w = (1 + 0.1 * torch.randn(512, device=dev, generator=gen)).bfloat16()
    g = torch.randn(4096, 512, device=dev, generator=gen).bfloat16()
    pos = torch.arange(4096, device=dev) * 4
    ep = Epilogue(rope_dim=64)
    res = node_and_composition(x, w, g, pos, ep)
    assert list(epilogue_op._ROWSUM_AGREES.values()) == [False]
    assert_same(res)


@pytest.mark.parametrize("d,rotate", [(128, True), (512, False)])
def test_the_compiled_module_is_the_eager_module_bitwise(d, rotate):
    """torch.compile(fullgraph) of the module's step: pooling and epilogue are custom ops
    there, running the same kernels: output and every gradient bitwise the eager step,
    with no graph break."""
    import torch._dynamo

    torch.manual_seed(0)
    m = C.Compressor(256, d, 4, rotate=rotate, device="cuda", pooling="fused")
    lens = [1030, 0, 3, 2600, 517]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = torch.randn(sum(lens), 256, device="cuda").bfloat16()

    def step(xi):
        out, _ = m(xi, cu, max_seqlen=max(lens))
        return out

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    res = []
    for fn in (compiled, step):
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
        res.append((out.detach(), *torch.autograd.grad(out, [xi, *m.parameters()], g)))
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    for i, (a, b) in enumerate(zip(*res)):
        assert torch.equal(a, b), i
