"""The epilogue as one autograd node (epilogue_op.apply_epilogue) against the composition of
torch ops it replaces (epilogue.eager_epilogue): RMSNorm, RoPE (interleaved pairs or
halves, rope_dim 0, part of head_dim or all of it) and the Hadamard rotation, on rows of a
ragged THD pack with capacity padding rows, grouped and SBHD positions; forward and both
gradients bitwise, fp32 and bf16."""

import pytest
import torch
from csa_compressor import epilogue_op

from csa_compressor import Compressor, compressed_cu_seqlens
from csa_compressor.epilogue import Epilogue, YaRN, eager_epilogue, rope_inv_freq
from csa_compressor.epilogue import grouped_positions, rope_positions, sbhd_positions
from csa_compressor.epilogue_op import apply_epilogue


def _positions(layout, n, ratio=4):
    if layout == "thd":  # segments of 37, 0, 3, 63, 9 tokens and 3 capacity padding rows
        cu = torch.tensor([0, 37, 37, 40, 103, 112])
        cuc = compressed_cu_seqlens(cu, ratio)
        return rope_positions(cuc, n, ratio, max_seqlen=63)
    if layout == "grouped":
        ids = torch.tensor([3, 4, 0, 1, 2, -1] * (n // 6) + [0] * (n % 6))
        return grouped_positions(ids, ratio)
    return sbhd_positions(n // 2, 2, ratio)


def _both(x, w, pos, ep):
    res = []
    for fn in (apply_epilogue, eager_epilogue):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xi, wi, pos, ep)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
        out.backward(g)
        res.append((out.detach(), xi.grad, wi.grad))
    return res


CASES = [  # (head_dim, rope_dim, interleaved, rotate)
    (128, 64, True, True), (128, 64, False, True), (128, 0, True, True), (128, 128, True, False),
    (64, 16, False, False), (512, 64, True, False), (512, 64, True, True), (96, 32, True, False),
]


@pytest.mark.parametrize("layout", ["thd", "grouped", "sbhd"])
@pytest.mark.parametrize("d,rope_dim,interleaved,rotate", CASES)
def test_the_epilogue_node_is_the_composition(layout, d, rope_dim, interleaved, rotate):
    n = 30
    gen = torch.Generator().manual_seed(d + rope_dim)
    x = 3 * torch.randn(n, d, generator=gen)
    w = 1 + 0.1 * torch.randn(d, generator=gen)
    ep = Epilogue(eps=1e-6, rope_dim=rope_dim, rope_theta=10000.0, rope_interleaved=interleaved,
                  rotate=rotate)
    pos = _positions(layout, n)
    for dtype in (torch.float32, torch.bfloat16):
        got, want = _both(x.to(dtype), w.to(dtype), pos, ep)
        for name, a, b in zip(("out", "grad pooled", "grad norm_weight"), got, want):
            assert a.dtype == b.dtype == dtype and torch.equal(a, b), (name, dtype)


def test_yarn_frequencies_reach_the_epilogue():
    x = torch.randn(12, 64)
    w = torch.ones(64)
    pos = torch.arange(12) * 4
    plain = Epilogue(rope_dim=32, rope_theta=10000.0)
    yarn = Epilogue(rope_dim=32, rope_theta=10000.0, rope_yarn=YaRN(factor=4.0, original_max_position_embeddings=8))
    assert torch.equal(apply_epilogue(x, w, pos, yarn), eager_epilogue(x, w, pos, yarn))
    assert not torch.allclose(apply_epilogue(x, w, pos, yarn), apply_epilogue(x, w, pos, plain))


def test_epilogue_arguments_are_checked():
    x, w, pos = torch.randn(4, 64), torch.ones(64), torch.arange(4)
    with pytest.raises(ValueError, match="norm_weight: expected shape \\(64,\\)"):
        apply_epilogue(x, torch.ones(32), pos, Epilogue())
    with pytest.raises(ValueError, match="positions: expected shape \\(4,\\)"):
        apply_epilogue(x, w, torch.arange(5), Epilogue())
    with pytest.raises(ValueError, match="pooled: expected \\(N, head_dim\\)"):
        apply_epilogue(x[None], w, pos, Epilogue())
    with pytest.raises(ValueError, match="head_dim: rotate=True needs a power of two"):
        apply_epilogue(torch.randn(4, 96), torch.ones(96), pos, Epilogue(rotate=True))
    with pytest.raises(TypeError, match="positions: expected integer positions"):
        apply_epilogue(x, w, pos.float(), Epilogue())
    with pytest.raises(TypeError, match="ep: expected a csa_compressor.Epilogue"):
        apply_epilogue(x, w, pos, {"rope_dim": 64})
    with pytest.raises(ValueError, match="eps: expected a finite number"):
        apply_epilogue(x, w, pos, Epilogue(eps=0.0))
    with pytest.raises(ValueError, match="rope_dim: expected an even int"):
        Epilogue(rope_dim=66).check(64)


@pytest.mark.parametrize("rope_dim,rotate,yarn", [(64, True, None), (0, False, None),
                                                   (128, False, YaRN(factor=40.0))])
def test_the_epilogue_compiles_fullgraph_to_the_eager_node_bitwise(rope_dim, rotate, yarn):
    """Under torch.compile the node's directions are custom ops: the compiled forward and
    both gradients are the eager node's (and so the composition's) bit for bit."""
    import torch._dynamo

    x = torch.randn(24, 128)
    w = 1 + 0.1 * torch.randn(128)
    g = torch.randn(24, 128)
    pos = torch.arange(24) * 4
    ep = Epilogue(rope_dim=rope_dim, rope_theta=10000.0, rotate=rotate, rope_yarn=yarn)
    torch._dynamo.reset()
    compiled = torch.compile(apply_epilogue, fullgraph=True)
    res = []
    for fn in (compiled, apply_epilogue, eager_epilogue):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xi, wi, pos, ep)
        out.backward(g)
        res.append((out.detach(), xi.grad, wi.grad))
    for want in res[1:]:
        for a, b in zip(res[0], want):
            assert torch.equal(a, b)


def test_the_module_with_the_eager_epilogue_is_bitwise_the_same():
    """fused_epilogue=False (the composition of torch ops the node replaces) gives the
    module's output and every gradient bit for bit; the rotary frequencies it keeps a
    device are the ones it would make."""
    torch.manual_seed(0)
    m = Compressor(64, 64, 4, rotate=True, dtype=torch.float32, pooling="reference",
                   rope_yarn=YaRN(factor=16.0))
    cu = torch.tensor([0, 37, 37, 101], dtype=torch.int32)
    x, g = torch.randn(101, 64), torch.randn(25, 64)
    res = []
    for fused in (True, False):
        m.fused_epilogue = fused
        xi = x.clone().requires_grad_(True)
        out, _ = m(xi, cu, max_seqlen=64)
        grads = torch.autograd.grad(out, [xi, *m.parameters()], g)
        res.append((out, *grads))
    for a, b in zip(*res):
        assert torch.equal(a, b)
    assert torch.equal(m._inv_freq[torch.device("cpu")],
                       rope_inv_freq(m.rope_dim, m.rope_theta, m.rope_yarn))


@pytest.mark.parametrize("norm_in_kernel", [True, False])
def test_a_row_kernel_that_cannot_run_now_gives_way_to_the_torch_ops(monkeypatch, norm_in_kernel):
    """Where the row kernel is chosen but cannot be had (not compiled while a CUDA graph
    captures: kernels.epilogue_rows.run returns None, nothing written), both directions
    run the composition's torch ops instead: bitwise eager_epilogue still, the norm's
    statistics included (the forward must not keep the unwritten ones)."""
    from csa_compressor import epilogue
    from csa_compressor.kernels import epilogue_rows

    calls = []
    monkeypatch.setattr(epilogue_op, "_rows_kernel", lambda *a: True)
    monkeypatch.setattr(epilogue_op, "norm_in_kernel", lambda *a: norm_in_kernel)
    monkeypatch.setattr(epilogue_rows, "run", lambda backward, *a, **k: calls.append(backward))
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(40, 128, generator=gen)).bfloat16()
    w = (1 + 0.1 * torch.randn(128, generator=gen)).bfloat16()
    a, b = _both(x, w, _positions("thd", 40), Epilogue(rope_dim=64, rotate=True))
    assert calls == [False, True]  # each direction asked the kernel first
    for name, u, v in zip(("out", "grad rows", "grad weight"), a, b):
        assert torch.equal(u, v), name


def _table(P, rope_dim, theta, yarn=None):
    """cos / sin of every position below P as the theta path computes a row's angles."""
    inv = rope_inv_freq(rope_dim, theta, yarn)
    ang = (torch.arange(P, dtype=torch.float64)[:, None] * inv[None, :]).to(torch.float32)
    return torch.cos(ang), torch.sin(ang)


@pytest.mark.parametrize("layout", ["thd", "grouped", "sbhd"])
@pytest.mark.parametrize("d,rope_dim,interleaved,rotate", [(128, 64, True, True),
                                                           (128, 64, False, False),
                                                           (64, 64, True, False)])
def test_a_caller_rotary_table_is_the_composition_and_the_theta_path(layout, d, rope_dim,
                                                                     interleaved, rotate):
    """rope_table (cos, sin indexed by position): the node is the composition on that table,
    forward and both gradients bit for bit; a table made as the theta path makes its angles
    gives the theta path's bits; another table gives other rows."""
    n = 30
    gen = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(n, d, generator=gen)).bfloat16()
    w = (1 + 0.1 * torch.randn(d, generator=gen)).bfloat16()
    g = torch.randn(n, d, generator=gen).bfloat16()
    pos = _positions(layout, n)
    ep = Epilogue(rope_dim=rope_dim, rope_theta=10000.0, rope_interleaved=interleaved,
                  rotate=rotate)
    table = _table(int(pos.max()) + 1, rope_dim, 10000.0)
    res = []
    for fn, kw in ((apply_epilogue, dict(rope_table=table)), (eager_epilogue, dict(rope_table=table)),
                   (apply_epilogue, {})):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xi, wi, pos, ep, **kw)
        out.backward(g)
        res.append((out.detach(), xi.grad, wi.grad))
    for want in res[1:]:
        for a, b in zip(res[0], want):
            assert torch.equal(a, b)
    other = _table(int(pos.max()) + 1, rope_dim, 500.0)
    assert not torch.equal(apply_epilogue(x, w, pos, ep, rope_table=other), res[0][0])


def test_a_rotary_table_compiles_fullgraph_to_the_eager_node_bitwise():
    import torch._dynamo

    x, w, g = torch.randn(24, 128), 1 + 0.1 * torch.randn(128), torch.randn(24, 128)
    pos = torch.arange(24) * 4
    ep = Epilogue(rope_dim=64, rotate=True)
    table = _table(100, 64, 777.0)
    torch._dynamo.reset()
    compiled = torch.compile(apply_epilogue, fullgraph=True)
    res = []
    for fn in (compiled, apply_epilogue):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xi, wi, pos, ep, rope_table=table)
        out.backward(g)
        res.append((out.detach(), xi.grad, wi.grad))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_rotary_table_arguments_are_checked():
    x, w, pos = torch.randn(4, 64), torch.ones(64), torch.arange(4)
    ep = Epilogue(rope_dim=32)
    cos, sin = _table(8, 32, 10000.0)
    with pytest.raises(TypeError, match="rope_table: expected a \\(cos, sin\\) pair"):
        apply_epilogue(x, w, pos, ep, rope_table=cos)
    with pytest.raises(TypeError, match="rope_table\\[1\\] \\(sin\\): expected torch.float32"):
        apply_epilogue(x, w, pos, ep, rope_table=(cos, sin.double()))
    with pytest.raises(ValueError, match="rope_table\\[0\\] \\(cos\\): expected shape \\(P >= 1, rope_dim // 2 = 16\\)"):
        apply_epilogue(x, w, pos, ep, rope_table=(cos[:, :8], sin))
    with pytest.raises(ValueError, match="rope_table\\[0\\] \\(cos\\): expected shape"):
        apply_epilogue(x, w, pos, ep, rope_table=(cos[:0], sin[:0]))
    with pytest.raises(ValueError, match="rope_table: cos and sin must have one shape"):
        apply_epilogue(x, w, pos, ep, rope_table=(cos, sin[:5]))
    with pytest.raises(ValueError, match=r"inv_freq: expected a floating-point \(16,\) tensor"):
        apply_epilogue(x, w, pos, ep, inv_freq=torch.ones(15, dtype=torch.float64))


@pytest.mark.parametrize("fn", [apply_epilogue, eager_epilogue])
def test_positions_outside_the_rotary_table_give_nan_rows_and_nothing_else(fn):
    """A position outside [0, P) reads no table row and makes its row's rotary channels NaN
    (on the GPU an unclamped gather is a device-side assert); every other row keeps its
    bits."""
    x, w, g = torch.randn(5, 64), 1 + 0.1 * torch.randn(64), torch.randn(5, 64)
    ep = Epilogue(rope_dim=32)
    table = _table(8, 32, 10000.0)
    good, bad = torch.tensor([0, 1, 2, 7, 3]), torch.tensor([0, 8, 2, -1, 3])
    want = fn(x, w, good, ep, rope_table=table)
    xi = x.clone().requires_grad_(True)
    got = fn(xi, w, bad, ep, rope_table=table)
    assert got[[1, 3], -32:].isnan().all() and not got[[1, 3], :-32].isnan().any()
    assert torch.equal(got[[0, 2, 4]], want[[0, 2, 4]])
    got.backward(g)
    assert xi.grad[[1, 3]].isnan().all() and not xi.grad[[0, 2, 4]].isnan().any()


def test_the_weight_column_sum_takes_the_kernel_only_where_its_check_agreed(monkeypatch):
    """epilogue_op.column_sum: the kernel's order is checked once a geometry on a probe of
    the same shape; a kernel that differs from torch's sum there is never used (torch's
    sum instead), one that agrees is used for the rows themselves, and an unchecked
    geometry while a CUDA graph captures takes torch's sum without checking or keeping."""
    from csa_compressor import epilogue
    from csa_compressor.kernels import column_sum, hardware

    monkeypatch.setattr(hardware, "sm_count", lambda i: 132)
    monkeypatch.setattr(hardware, "threads_per_sm", lambda i: 2048)
    monkeypatch.setattr(epilogue_op, "_COLSUM_AGREES", {})
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    seen = []

    def kernel_off_by_one(x, lanes, ctas):  # a kernel whose order is not torch's
        seen.append((tuple(x.shape), lanes, ctas))
        return x.sum(0) + 1

    prod = torch.randn(6144, 128)
    monkeypatch.setattr(column_sum, "column_sum", kernel_off_by_one)
    assert torch.equal(epilogue_op.column_sum(prod), prod.sum(0))
    assert seen == [((6144, 128), 4, 96)]  # the probe only
    assert epilogue_op._COLSUM_AGREES == {(prod.device, 128, 4, 96): False}
    assert torch.equal(epilogue_op.column_sum(prod), prod.sum(0)) and len(seen) == 1

    def kernel_marked(x, lanes, ctas):  # torch's bits, and marks the rows it summed
        seen.append(x.data_ptr())
        return x.sum(0)

    monkeypatch.setattr(column_sum, "column_sum", kernel_marked)
    prod2 = torch.randn(6144, 512)
    assert torch.equal(epilogue_op.column_sum(prod2), prod2.sum(0))
    assert epilogue_op._COLSUM_AGREES[(prod2.device, 512, 4, 96)] is True
    assert seen[-1] == prod2.data_ptr() and len(seen) == 3  # the probe, then the rows

    capturing[0] = True
    prod3 = torch.randn(192, 512)  # another geometry (one CTA along the rows)
    assert torch.equal(epilogue_op.column_sum(prod3), prod3.sum(0))
    assert len(seen) == 3 and (prod3.device, 512, 4, 1) not in epilogue_op._COLSUM_AGREES
