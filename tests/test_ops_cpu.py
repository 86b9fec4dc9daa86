"""Routing of compress_thd_fused's eager path (CPU, kernel launches replaced by the fp32
reference): autograd only when something needs a gradient."""

import torch

from csa_compressor import ops, reference, validation
from packs import make_pack


def _cpu_forward(monkeypatch):
    calls = []

    def fake_validate(*a, for_kernel=False, **k):
        return validation.validate(*a, for_kernel=False, **k)

    def fake_forward(p):
        calls.append(p)
        return reference.compress_thd(p.kv.detach(), p.score.detach(), p.ape.detach(), p.cu_seqlens,
                                      p.cu_seqlens_comp, p.total_comp, ratio=p.ratio, coff=p.coff,
                                      mode="fp32")

    monkeypatch.setattr(ops, "validate", fake_validate)
    monkeypatch.setattr(ops, "_forward", fake_forward)
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
    from csa_compressor.kernels.compile import _direct

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
    assert launch._on_device(torch.device("cuda", 0)).guard is None and not asked
    monkeypatch.setattr(launch, "_one_gpu", lambda: False)
    assert launch._on_device(torch.device("cuda", 0)).guard is None and asked
    assert launch._on_device(torch.device("cuda", 1)).guard == ("guard", torch.device("cuda", 1))
