"""Compressor.v41 on the fused kernels against Megatron-LM's eager CSA2Compressor on the GPU,
on the same weights: output and every gradient bit for bit, SBHD (s a multiple of the
ratio and not) and THD (each sequence's rows those of its own SBHD call)."""

import pytest
import torch

from csa_compressor import Compressor
from test_module_v41_cpu import _grads, _megatron, csa2  # noqa: F401  (the fixture)

pytestmark = pytest.mark.gpu

NAMES = {"linear_wkv.weight": "wkv.weight", "linear_wgate.weight": "wgate.weight",
         "norm.weight": "norm_weight"}


def _pair(csa2, ratio, head_dim, hidden=256):  # noqa: F811
    from csa_compressor import megatron

    megatron.uninstall()
    mg = _megatron(csa2, hidden, head_dim, ratio, torch.bfloat16).cuda()
    ours = Compressor.v41(hidden, head_dim, ratio, norm_eps=1e-5, pooling="fused",
                          device="cuda")
    ours.load_megatron_state_dict(mg.state_dict())
    return mg, ours


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("seq", [4096, 4099])
def test_fused_module_is_megatrons_bit_for_bit(csa2, ratio, head_dim, seq):  # noqa: F811
    mg, ours = _pair(csa2, ratio, head_dim)
    x = torch.randn(seq, 2, 256, device="cuda").bfloat16()
    a = _grads(mg, x, lambda m, t: m(t))
    b = _grads(ours, x, lambda m, t: m(t))
    assert a[0].shape == (seq // ratio, 2, head_dim)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for n, g in a[2].items():
        assert torch.equal(g, b[2][NAMES[n]]), n


@pytest.mark.parametrize("ratio", [2, 4])
def test_fused_module_thd_rows_are_megatrons_per_sequence(csa2, ratio):  # noqa: F811
    mg, ours = _pair(csa2, ratio, 512)
    lens = [1030, 0, 2048, 7]
    cu = torch.tensor([0] + [sum(lens[:k + 1]) for k in range(len(lens))], dtype=torch.int32,
                      device="cuda")
    x = torch.randn(sum(lens), 256, device="cuda").bfloat16()
    rows, cuc = ours(x, cu)
    offs = cuc.tolist()
    for s in range(len(lens)):
        want = mg(x[cu[s]:cu[s + 1]].unsqueeze(1))
        assert torch.equal(rows[offs[s]:offs[s + 1]], want[:, 0]), s
