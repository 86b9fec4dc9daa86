"""The packed layout, ``[kv | score]`` as one tensor (compress_thd_fused_packed, the
module's one projection), on the CPU: its validation, its op and autograd routing (the
launches replaced by the fp32 reference, as in test_ops_cpu), and the module's one GEMM
against two. The kernels on it: tests/test_packed_gpu.py."""

import pytest
import torch
from csa_compressor import kernel_api, pooling

from csa_compressor import Compressor, ops, reference, validation
from packs import make_pack, reference_of


def test_packed_validation_names_what_is_wrong():
    kv, score, ape, cu, cuc, N = make_pack([9, 13], 8, 4, 2)
    kvs = torch.cat((kv, score), dim=1)
    p = validation.validate_packed(kvs, ape, cu, cuc, N, ratio=4, coff=2)
    assert p.row_stride == 32 and p.kvs is not None and p.head_dim == 8
    assert torch.equal(p.kv, kv) and torch.equal(p.score, score)
    with pytest.raises(ValueError, match="kvs: last dimension must be 2\\*coff\\*d"):
        validation.validate_packed(kvs[:, :30], ape, cu, cuc, N, ratio=4, coff=2)
    with pytest.raises(ValueError, match="ape: expected shape"):
        validation.validate_packed(kvs, ape[:, :8], cu, cuc, N, ratio=4, coff=2)
    with pytest.raises(ValueError, match="kvs: expected contiguous"):
        validation.validate_packed(torch.cat((kvs, kvs), 1)[:, ::2], ape, cu, cuc, N, ratio=4,
                                   coff=2, for_kernel=True)
    odd = torch.zeros(22, 2 * 65, dtype=torch.bfloat16)  # score half at 130 bytes
    with pytest.raises(ValueError, match="kvs: the second half starts 130 bytes"):
        validation.validate_packed(odd, torch.zeros(4, 65), cu, None, 5, ratio=4, coff=1,
                                   for_kernel=True)
    # [score | kv]: the views swap, the stride and the gradient's layout stay
    p = validation.validate_packed(torch.cat((score, kv), 1), ape, cu, cuc, N, ratio=4, coff=2,
                                   score_first=True)
    assert p.score_first and p.row_stride == 32
    assert torch.equal(p.kv, kv) and torch.equal(p.score, score)
    with pytest.raises(TypeError, match="score_first"):
        validation.validate_packed(kvs, ape, cu, cuc, N, ratio=4, coff=2, score_first=1)


def _fake_launches(monkeypatch, grads):
    calls = {"fwd": 0, "bwd": 0}

    def fake_forward(p):
        calls["fwd"] += 1
        return reference_of(p)

    def fake_launch_backward(grad, p, out):
        # the launch writes dkv and dscore where _backward_packed points it
        calls["bwd"] += 1
        assert torch.equal(grad, grads["g"]) and p.kvs.shape == grads["dkvs"].shape
        out[0].copy_(grads["dkv"])
        out[1].copy_(grads["dscore"])
        return grads["dape"].clone()

    for mod in (ops, pooling):
        monkeypatch.setattr(mod, "validate_packed",
                            lambda *a, for_kernel=False, **k: validation.validate_packed(*a, **k))
    monkeypatch.setattr(pooling, "forward", fake_forward)
    monkeypatch.setattr(pooling, "launch_backward_into", fake_launch_backward)
    return calls


@pytest.mark.parametrize("score_first", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_packed_op_gives_one_gradient_in_its_layout(monkeypatch, compiled, score_first):
    """Eager and torch.compile(fullgraph) reach the packed op's bodies once a direction, and
    the gradient arrives as one (T, 2*coff*d) tensor: the halves' reference gradients side
    by side, in the input's order (``[score | kv]`` where score_first)."""
    import torch._dynamo

    kv, score, ape, cu, cuc, N = make_pack([9, 0, 13, 4], 8, 4, 2)
    g = torch.randn(N, 8, generator=torch.Generator().manual_seed(5))
    leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
    ref = reference.compress_thd(*leaves, cu, cuc, N, ratio=4, coff=2, mode="fp32")
    dkv, dscore, dape = torch.autograd.grad(ref, leaves, g)
    pair = (dscore, dkv) if score_first else (dkv, dscore)
    grads = {"g": g, "dkvs": torch.cat(pair, 1), "dape": dape, "dkv": dkv, "dscore": dscore}
    calls = _fake_launches(monkeypatch, grads)
    fn = ops.compress_thd_fused_packed
    if compiled:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    kvs = torch.cat((score, kv) if score_first else (kv, score), 1).requires_grad_(True)
    a = ape.clone().requires_grad_(True)
    out = fn(kvs, a, cu, cuc, N, ratio=4, coff=2, score_first=score_first)
    out.backward(g)
    assert calls == {"fwd": 1, "bwd": 1}, calls
    assert torch.equal(out.detach(), ref.detach())
    assert kvs.grad.shape == kvs.shape and torch.equal(kvs.grad, grads["dkvs"])
    assert torch.equal(a.grad, dape)
    if compiled:
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        torch._dynamo.reset()


@pytest.mark.parametrize("d,one", [(32, True), (33, False)])
def test_the_module_projects_once_where_the_kernels_can_read_the_halves(d, one):
    """One GEMM into [kv | score] (fp32 rows of coff*d*4 bytes, a multiple of 16), else two
    projections as before; output and every gradient as the two-projection computation."""
    torch.manual_seed(0)
    m = Compressor(48, d, 4, rope_dim=16, dtype=torch.float32, pooling="reference")
    assert m.one_projection == one
    cu = torch.tensor([0, 37, 37, 100], dtype=torch.int32)
    x = torch.randn(100, 48, requires_grad=True)
    out, cuc = m(x, cu)
    g = torch.randn(out.shape)
    out.backward(g)
    got = [out.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_(True)
    kv, score = m.wkv(x2), m.wgate(x2)
    pooled = reference.compress_thd(kv, score, m.ape, cu, cuc, out.shape[0], ratio=4, coff=2,
                                    mode="fp32")
    from csa_compressor.module import rope_positions

    want_out = m._finish(pooled, rope_positions(cuc, out.shape[0], 4))
    want_out.backward(g)
    want = [want_out.detach(), x2.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_module_sbhd_path_projects_once_too():
    """SBHD inputs: one GEMM and one transposed copy into the packed THD layout; output and
    every gradient as the two-projection path's."""
    torch.manual_seed(2)
    m = Compressor(32, 16, 4, rope_dim=8, dtype=torch.float32, pooling="reference")
    x = torch.randn(18, 3, 32)
    res = []
    for one in (True, False):
        m.one_projection = one
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.square().sum().backward()
        res.append([y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()])
    assert res[0][0].shape == (4, 3, 16)
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 64), (20, 7, 64)])
def test_the_one_projection_reads_both_weights_in_place(dtype, shape):
    """The module keeps wgate's weight right after wkv's in one buffer, and its projection
    reads the pair as one matrix (no concatenation a step): output, input gradient and
    both weight gradients (values and layouts) are the concatenation's."""
    from torch import nn

    from csa_compressor import module

    torch.manual_seed(0)
    m = Compressor(64, 32, 4, dtype=dtype)
    wkv, wgate = m.wkv.weight, m.wgate.weight
    assert module._adjacent(wkv, wgate)
    assert wgate.data_ptr() == wkv.data_ptr() + wkv.numel() * wkv.element_size()
    x = torch.randn(*shape).to(dtype).requires_grad_(True)
    y = m.project(x)
    assert y.grad_fn is not None and "JointLinear" in type(y.grad_fn).__name__
    g = torch.randn_like(y)
    got = (y.detach(), *torch.autograd.grad(y, [x, wkv, wgate], g))
    x2, wk, wg = (t.detach().clone().requires_grad_(True) for t in (x, wkv, wgate))
    y2 = nn.functional.linear(x2, torch.cat((wk, wg)))
    want = (y2.detach(), *torch.autograd.grad(y2, [x2, wk, wg], g))
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.stride() == b.stride()


def test_the_weights_stay_joined_across_conversions_and_fall_back_when_not():
    """.to() gives every parameter new storage: the module joins its two weights again (the
    same Parameter objects). Weights that are not adjacent (a rebound one) take the
    concatenation: the same step."""
    import copy

    from csa_compressor import module

    torch.manual_seed(1)
    m = Compressor(32, 16, 4, rope_dim=8, dtype=torch.float32, pooling="reference")
    params = list(m.parameters())
    m.to(torch.float64)
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]
    assert m.wkv.weight.dtype == torch.float64 and module._adjacent(m.wkv.weight, m.wgate.weight)
    m.to(torch.float32)
    other = copy.deepcopy(m)
    other.wgate.weight = torch.nn.Parameter(other.wgate.weight.detach().clone())
    assert not module._adjacent(other.wkv.weight, other.wgate.weight)
    cu = torch.tensor([0, 37, 37, 100], dtype=torch.int32)
    x = torch.randn(100, 32)
    res = []
    for mod in (m, other):
        xi = x.clone().requires_grad_(True)
        out, _ = mod(xi, cu)
        out.square().sum().backward()
        res.append([out.detach(), xi.grad] + [p.grad for p in mod.parameters()])
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_under_autocast_the_projection_casts_as_linear_does():
    """Under autocast the projection is linear's (its inputs cast to the autocast dtype, the
    gradients back in the parameters' and input's dtypes), as with unjoined weights."""
    import copy

    torch.manual_seed(3)
    m = Compressor(32, 16, 4, rope_dim=8, dtype=torch.float32, pooling="reference")
    other = copy.deepcopy(m)  # its own storage for each weight: the concatenation
    cu = torch.tensor([0, 37, 37, 100], dtype=torch.int32)
    x = torch.randn(100, 32)
    res = []
    for mod in (m, other):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = mod(xi, cu)
        out.float().square().sum().backward()
        res.append([out.detach(), xi.grad] + [p.grad for p in mod.parameters()])
    assert res[0][0].dtype == torch.bfloat16 and res[0][1].dtype == torch.float32
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_tensor_subclass_weights_are_not_joined_and_take_the_concatenation():
    """Weights that are tensor subclasses (DTensor, low-precision wrappers) are neither
    moved into one buffer nor read as one: the projection concatenates them."""
    from torch import nn

    from csa_compressor import module

    class Sub(torch.Tensor):
        pass

    torch.manual_seed(4)
    m = Compressor(32, 16, 4, rope_dim=8, dtype=torch.float32, pooling="reference")
    m.wkv.weight = nn.Parameter(m.wkv.weight.detach().clone().as_subclass(Sub))
    m.wgate.weight = nn.Parameter(m.wgate.weight.detach().clone().as_subclass(Sub))
    m._join_weights()
    assert type(m.wkv.weight.data) is Sub
    assert m.wkv.weight.untyped_storage().data_ptr() != m.wgate.weight.untyped_storage().data_ptr()
    assert not module._adjacent(m.wkv.weight, m.wgate.weight)
    x = torch.randn(10, 32)
    y = m.project(x)
    assert "JointLinear" not in type(y.grad_fn).__name__
    want = nn.functional.linear(x, torch.cat((m.wkv.weight, m.wgate.weight)))
    assert torch.equal(y, want)
