"""install() and Megatron-LM's DeepSeek-V4.1 CSA2Compressor on the CPU: without a GPU it
keeps Megatron's code and says why; with the fused path standing in on the CPU (the
reference in the kernels' place) forward and forward_packed, outputs and every gradient,
are bitwise Megatron's own."""

import pytest
import torch

from csa_compressor import megatron
from test_module_v41_cpu import _grads, _megatron, csa2  # noqa: F401  (the fixture)


@pytest.fixture
def clean():
    megatron.uninstall()
    megatron.clear_fallback_reasons()
    yield
    megatron.uninstall()


def _packed_call(m, x, rows):
    return m.forward_packed(x, rows)


@pytest.mark.parametrize("ratio", [2, 4])
def test_cpu_install_keeps_megatrons_code_and_says_why(csa2, clean, ratio):  # noqa: F811
    mg = _megatron(csa2, 64, 32, ratio, torch.bfloat16)
    x = torch.randn(9, 2, 64).bfloat16()
    want = mg(x)
    with megatron.installed():
        got = mg(x)
    assert torch.equal(want, got)
    assert any("CUDA" in r or "cuda" in r for r in megatron.fallback_reasons()), \
        megatron.fallback_reasons()
    assert csa2.CSA2Compressor.forward.__module__.startswith("megatron")


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routed_forward_and_forward_packed_are_megatrons(csa2, clean, fused_on_cpu,  # noqa: F811
                                                         ratio, dtype):
    mg = _megatron(csa2, 64, 32, ratio, dtype)
    x = torch.randn(19, 3, 64).to(dtype)
    rows = torch.tensor([[5 * g + k for k in range(ratio)] for g in range(6)])
    flat = torch.randn(40, 64).to(dtype)
    want = [_grads(mg, x, lambda m, t: m(t)), _grads(mg, flat, lambda m, t: _packed_call(m, t, rows)),
            _grads(mg, flat, lambda m, t: _packed_call(m, t, rows[:0]))]
    megatron.install()
    got = [_grads(mg, x, lambda m, t: m(t)), _grads(mg, flat, lambda m, t: _packed_call(m, t, rows)),
           _grads(mg, flat, lambda m, t: _packed_call(m, t, rows[:0]))]
    for a, b in zip(want, got):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for n in a[2]:
            assert (a[2][n] is None and b[2][n] is None) or torch.equal(a[2][n], b[2][n]), n
    if ratio > 1:
        assert len(fused_on_cpu) == 2, fused_on_cpu  # forward and forward_packed launched
    else:
        assert not fused_on_cpu and any("ratio 1" in r for r in megatron.fallback_reasons())
