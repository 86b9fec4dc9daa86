"""Compressor.v41 (DeepSeek-V4.1) against Megatron-LM's CSA2Compressor on the CPU, on the
same weights: output and every gradient bit for bit, SBHD and THD, ratios 1, 2 and 4."""

import pytest
import torch

from csa_compressor import Compressor

RATIOS = [1, 2, 4]


@pytest.fixture(scope="module")
def csa2(megatron_csa):
    from megatron_env import import_csa2

    mod = import_csa2()
    if mod is None:
        pytest.skip("no Megatron-LM tree with the csa2 overlay")
    return mod


def _megatron(csa2, hidden, head_dim, ratio, dtype, eps=1e-5):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                            use_cpu_initialization=True, params_dtype=dtype,
                            bf16=dtype == torch.bfloat16, layernorm_epsilon=eps)
    comp = csa2.CSA2Compressor(cfg, csa2.CSA2CompressorSubmodules(norm=WrappedTorchNorm),
                               compress_ratio=ratio, head_dim=head_dim)
    comp.norm.to(dtype)  # as Megatron's mixed-precision wrapper casts it
    with torch.no_grad():  # a norm weight other than ones
        comp.norm.weight.copy_(torch.rand(head_dim) + 0.5)
    return comp


def _grads(module, x, out_fn):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = out_fn(module, x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device, out.dtype)
    out.backward(g)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seq", [16, 19])
def test_sbhd_forward_and_backward_are_megatrons(csa2, ratio, dtype, seq):
    hidden, head_dim = 64, 32
    mg = _megatron(csa2, hidden, head_dim, ratio, dtype)
    ours = Compressor.v41(hidden, head_dim, ratio, norm_eps=1e-5, dtype=dtype, pooling="reference")
    ours.load_megatron_state_dict(mg.state_dict())
    x = torch.randn(seq, 3, hidden).to(dtype)
    a = _grads(mg, x, lambda m, t: m(t))
    b = _grads(ours, x, lambda m, t: m(t))
    assert a[0].shape == (seq // ratio, 3, head_dim)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    names = {"linear_wkv.weight": "wkv.weight", "linear_wgate.weight": "wgate.weight",
             "norm.weight": "norm_weight"}
    for n, g in a[2].items():
        assert torch.equal(g, b[2][names[n]]), n


@pytest.mark.parametrize("ratio", RATIOS)
def test_thd_rows_are_the_sbhd_rows_of_each_sequence(csa2, ratio):
    hidden, head_dim = 64, 32
    mg = _megatron(csa2, hidden, head_dim, ratio, torch.bfloat16)
    ours = Compressor.v41(hidden, head_dim, ratio, norm_eps=1e-5, pooling="reference")
    ours.load_megatron_state_dict(mg.state_dict())
    lens = [9, 0, 16, 5]
    x = torch.randn(sum(lens), hidden).bfloat16()
    cu = torch.tensor([0, 9, 9, 25, 30], dtype=torch.int32)
    rows, cuc = ours(x, cu)
    offs = cuc.tolist()
    for s, n in enumerate(lens):
        want = mg(x[cu[s]:cu[s + 1]].unsqueeze(1))
        assert torch.equal(rows[offs[s]:offs[s + 1]], want[:, 0]), s


def test_state_dict_keys_are_checked(csa2):
    ours = Compressor.v41(64, 32, 1, pooling="reference")
    with pytest.raises(KeyError, match="linear_wgate.weight"):
        ours.load_megatron_state_dict({"linear_wgate.weight": torch.zeros(32, 64)})
    with pytest.raises(TypeError, match="x: expected the module's dtype"):
        ours(torch.randn(4, 1, 64))
