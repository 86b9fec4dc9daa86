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
