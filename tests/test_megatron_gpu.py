"""Megatron-LM's own Compressor with csa_compressor.megatron installed, on the GPU: the
fused kernels answer its THD hook, and its output and gradients stay within bf16
rounding of its eager region (which rounds the weights and products to bf16; the fused
pooling does not)."""

import pytest
import torch

from csa_compressor import megatron
from megatron_env import build_compressor, import_csa, init_one_process

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def csa(tmp_path_factory):
    mod = import_csa()
    if mod is None:
        pytest.skip("no importable Megatron-LM tree (set MEGATRON_LM_PATH)")
    init_one_process(tmp_path_factory.mktemp("gloo"))
    return mod


def _step(comp, x, cu, max_seqlen):
    from megatron.core.packed_seq_params import PackedSeqParams

    comp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    out, cuc = comp(x, psp)
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    g = g.to(out.dtype)
    g[int(cuc[-1]):] = 0  # capacity padding rows take no gradient downstream
    out.backward(g)
    return out.detach().float(), x.grad.float(), {n: p.grad.float() for n, p in comp.named_parameters()}


@pytest.mark.parametrize("ratio,head_dim", [(4, 128), (4, 512), (128, 512), (128, 128)])
def test_megatrons_compressor_on_the_fused_kernels(csa, ratio, head_dim):
    comp = build_compressor(csa, hidden=256, head_dim=head_dim, ratio=ratio, rope_dim=64,
                            dtype=torch.bfloat16).cuda()
    lens = [37, 0, 3, 640, 129, 1] if ratio == 4 else [300, 0, 127, 1040]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = torch.randn(int(cu[-1]) + 5, 1, 256, device="cuda").to(torch.bfloat16)
    want = _step(comp, x, cu, max(lens))
    calls = []
    hook = megatron.maybe_compress_thd_fused

    def counted(*a, **k):
        out = hook(*a, **k)
        calls.append(out is not None)
        return out

    with megatron.installed():
        csa.maybe_compress_thd_fused = counted
        got = _step(comp, x, cu, max(lens))
    assert calls == [True], megatron.fallback_reasons()
    for a, b in [(got[0], want[0]), (got[1], want[1])] + [(got[2][n], want[2][n]) for n in want[2]]:
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=3e-2)
