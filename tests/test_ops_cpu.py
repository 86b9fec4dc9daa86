"""Routing of compress_thd_fused's eager path (CPU, kernel launches replaced by the fp32
reference): autograd only when something needs a gradient."""

import torch
from csa_compressor import kernel_api, pooling

from csa_compressor import ops, reference, validation
from packs import make_pack, reference_of


def _cpu_forward(monkeypatch):
    calls = []

    def fake_validate(*a, for_kernel=False, **k):
        return validation.validate(*a, for_kernel=False, **k)

    def fake_forward(p):
        calls.append(p)
        return reference_of(p)

    monkeypatch.setattr(ops, "validate", fake_validate)
    monkeypatch.setattr(pooling, "forward", fake_forward)
    return calls


def test_no_grad_inputs_skip_autograd(monkeypatch):
    calls = _cpu_forward(monkeypatch)
    kv, score, ape, cu, cuc, N = make_pack([9, 0, 13], 8, 4, 2)
    out = ops.compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    assert len(calls) == 1 and out.grad_fn is None and not out.requires_grad


def test_grad_inputs_go_through_autograd(monkeypatch):
    calls = _cpu_forward(monkeypatch)
    kv, score, ape, cu, cuc, N = make_pack([9, 0, 13], 8, 4, 2)
    out = ops.compress_thd_fused(kv, score.requires_grad_(True), ape, cu, cuc, N, ratio=4, coff=2)
    assert len(calls) == 1 and out.requires_grad and out.grad_fn is not None
    with torch.no_grad():
        out = ops.compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    assert len(calls) == 2 and out.grad_fn is None


def test_direct_launch_unwraps_only_what_converts():
    """compile._direct calls the compiled function's tvm_ffi.Function where the TVM-FFI
    protocol gives one, and the DSL object itself otherwise (never None)."""
    from csa_compressor.kernels.jit import direct as _direct

    class Converts:
        def __init__(self, inner):
            self.inner = inner

        def __tvm_ffi_object__(self):
            return self.inner

    raw, plain = object(), object()
    assert _direct(Converts(raw)) is raw
    wrapped_none = Converts(None)
    assert _direct(wrapped_none) is wrapped_none
    assert _direct(plain) is plain


def test_device_guard_is_skipped_with_one_gpu(monkeypatch):
    """With one visible GPU the launch takes no device guard and does not even ask for the
    current device; with several it guards only a non-current device."""
    from csa_compressor.kernels import launch

    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append(1) or 0)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: ("guard", dev))
    monkeypatch.setattr(launch, "_one_gpu", lambda: True)
    assert launch.on_device(torch.device("cuda", 0)) is launch._CURRENT and not asked
    monkeypatch.setattr(launch, "_one_gpu", lambda: False)
    assert launch.on_device(torch.device("cuda", 0)) is launch._CURRENT and asked
    assert launch.on_device(torch.device("cuda", 1)) == ("guard", torch.device("cuda", 1))


def _cpu_launches(monkeypatch, grads):
    """Both directions' launches replaced, counted: the forward by the fp32 reference, the
    backward by ``grads`` (the reference's, precomputed: an op's body runs below autograd),
    after checking it was handed the incoming gradient."""
    calls = {"fwd": 0, "bwd": 0}

    def fake_validate(*a, for_kernel=False, **k):
        return validation.validate(*a, for_kernel=False, **k)

    def fake_forward(p):
        calls["fwd"] += 1
        return reference_of(p)

    def fake_backward(grad, p, out):
        # the launch writes dkv and dscore where the op's backward points it
        calls["bwd"] += 1
        assert torch.equal(grad, grads["g"]) and p.kv.shape == grads["dkv"].shape
        out[0].copy_(grads["dkv"])
        out[1].copy_(grads["dscore"])
        return grads["dape"].clone()

    for mod in (ops, pooling):
        monkeypatch.setattr(mod, "validate", fake_validate)
    monkeypatch.setattr(pooling, "forward", fake_forward)
    monkeypatch.setattr(pooling, "launch_backward_into", fake_backward)
    return calls


def test_compile_and_eager_share_the_op_and_its_autograd(monkeypatch):
    """torch.compile(fullgraph=True) of compress_thd_fused reaches the custom ops (forward
    and backward bodies each run once a step), with no graph break, and gives what the
    eager bypass gives, bitwise, output and gradients."""
    import torch._dynamo

    kv, score, ape, cu, cuc, N = make_pack([9, 0, 13, 4], 8, 4, 2)
    g = torch.randn(N, 8, generator=torch.Generator().manual_seed(5))
    leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
    ref = reference.compress_thd(*leaves, cu, cuc, N, ratio=4, coff=2, mode="fp32")
    grads = dict(zip(("dkv", "dscore", "dape"), torch.autograd.grad(ref, leaves, g)), g=g)
    calls = _cpu_launches(monkeypatch, grads)

    def step(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
        out = fn(*leaves, cu, cuc, N, ratio=4, coff=2)
        return [out.detach()] + list(torch.autograd.grad(out, leaves, g))

    want = step(ops.compress_thd_fused)
    assert calls == {"fwd": 1, "bwd": 1}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(ops.compress_thd_fused, fullgraph=True, backend="aot_eager")
    got = step(compiled)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert calls == {"fwd": 2, "bwd": 2}, calls
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(want[0], ref.detach()) and torch.equal(want[1], grads["dkv"])
    torch._dynamo.reset()
