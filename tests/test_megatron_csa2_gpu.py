"""Megatron-LM's CSA2Compressor installed against not installed on the GPU: forward and
forward_packed, outputs and every gradient bit for bit (the issue's contract for fp32
pooling: torch's softmax and sum, and their autograd)."""

import pytest
import torch

from csa_compressor import megatron
from test_module_v41_cpu import _grads, _megatron, csa2  # noqa: F401  (the fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("seq", [4096, 4099])
def test_installed_is_megatrons_bit_for_bit(csa2, ratio, head_dim, seq):  # noqa: F811
    megatron.uninstall()
    mg = _megatron(csa2, 256, head_dim, ratio, torch.bfloat16).cuda()
    x = torch.randn(seq, 2, 256, device="cuda").bfloat16()
    g = torch.Generator().manual_seed(7)
    rows = torch.randperm(3000, generator=g)[: 64 * ratio].view(64, ratio).sort(1).values.cuda()
    flat = torch.randn(3000, 256, device="cuda").bfloat16()
    calls = [lambda m, t: m(t), lambda m, t: m.forward_packed(t, rows),
             lambda m, t: m.forward_packed(t, rows[:0])]
    want = [_grads(mg, t, f) for t, f in zip((x, flat, flat), calls)]
    with megatron.installed():
        got = [_grads(mg, t, f) for t, f in zip((x, flat, flat), calls)]
    for a, b in zip(want, got):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for n in a[2]:
            assert (a[2][n] is None and b[2][n] is None) or torch.equal(a[2][n], b[2][n]), n
