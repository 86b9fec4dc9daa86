"""Megatron-LM's own Compressor with csa_compressor.megatron installed, on the GPU: the
fused kernels answer its THD, SBHD and pre-grouped paths, with and without the rotation,
and its output and gradients stay within bf16 rounding of its eager region (which rounds
the weights and products to bf16; the fused pooling does not)."""

import pytest
import torch

import csa_compressor as C
from csa_compressor import megatron
from megatron_env import build_compressor, thd_step
from megatron_gpu_env import fresh_fallback_reasons  # noqa: F401  (the fixture)
from megatron_gpu_env import installed_step, sbhd_step, hooked_step

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_fallback_reasons")]


@pytest.mark.parametrize("ratio,head_dim", [(4, 128), (4, 512), (128, 512), (128, 128)])
def test_megatrons_compressor_on_the_fused_kernels(megatron_csa, ratio, head_dim):
    comp = build_compressor(megatron_csa, hidden=256, head_dim=head_dim, ratio=ratio, rope_dim=64,
                            dtype=torch.bfloat16).cuda()
    lens = [37, 0, 3, 640, 129, 1] if ratio == 4 else [300, 0, 127, 1040]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = torch.randn(int(cu[-1]) + 5, 1, 256, device="cuda").to(torch.bfloat16)
    want = thd_step(comp, x, cu, max(lens))
    got, calls = hooked_step(megatron_csa, lambda: thd_step(comp, x, cu, max(lens)))
    assert calls == [True], megatron.fallback_reasons()
    for a, b in [(got[0], want[0]), (got[1], want[1])] + [(got[2][n], want[2][n]) for n in want[2]]:
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=3e-2)


@pytest.mark.parametrize("ratio,head_dim,sq", [(4, 128, 1030), (128, 512, 1100)])
def test_megatrons_sbhd_compressor_on_the_fused_kernels(megatron_csa, monkeypatch, ratio, head_dim,
                                                        sq):
    """Its SBHD path (b = 2 sequences of sq tokens, a tail past the last block) through
    the adapter's _forward_sbhd: the fused pooling ran (no fallback reason), output and
    gradients within bf16 rounding of Megatron's own method."""
    comp = build_compressor(megatron_csa, hidden=256, head_dim=head_dim, ratio=ratio, rope_dim=64,
                            dtype=torch.bfloat16).cuda()
    x = torch.randn(sq, 2, 256, device="cuda").to(torch.bfloat16)
    want = sbhd_step(comp, x)
    got, launched = installed_step(lambda: sbhd_step(comp, x), monkeypatch)
    assert launched == [2 * (sq // ratio)], megatron.fallback_reasons()
    assert got[0].shape == (sq // ratio, 2, head_dim)
    for a, b in [(got[0], want[0]), (got[1], want[1])] + [(got[2][n], want[2][n]) for n in want[2]]:
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=3e-2)


@pytest.mark.parametrize("ratio,head_dim,ids", [
    (4, 512, [5, 6, 7, 0, 1, 2, 3, 0] + list(range(200)) + [-1] * 24),
    (128, 512, [3, 4, 0, 1, 2, -1, -1]),
])
def test_megatrons_grouped_compressor_on_the_fused_kernels(megatron_csa, monkeypatch, ratio,
                                                           head_dim, ids):
    """Its context-parallel pre-grouped path through the adapter's _forward_thd: the fused
    pooling ran, output (row 0, an overlapping halo, excepted) and gradients within bf16
    rounding of Megatron's eager region."""
    comp = build_compressor(megatron_csa, hidden=256, head_dim=head_dim, ratio=ratio, rope_dim=64,
                            dtype=torch.bfloat16).cuda()
    ids = torch.tensor(ids, dtype=torch.int32, device="cuda")
    x = torch.randn(ids.numel() * ratio, 1, 256, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, x.shape[0]], dtype=torch.int32, device="cuda")
    halo = comp.overlap

    def step():
        comp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out, _ = comp._forward_thd(xi, cu, max_seqlen_q=x.shape[0], compressed_group_ids=ids)
        g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        if halo:
            g[0] = 0
        out.backward(g.to(out.dtype))
        return [out[1:].float(), xi.grad.float()] + [p.grad.float() for p in comp.parameters()]

    want = step()
    got, launched = installed_step(step, monkeypatch)
    assert launched == [ids.numel()], megatron.fallback_reasons()
    for a, b in zip(got, want):
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=3e-2)


@pytest.mark.parametrize("path", ["thd", "sbhd", "grouped"])
def test_megatrons_rotating_compressor_on_the_fused_kernels(megatron_csa, monkeypatch,
                                                            hadamard_standin, path):
    """rotate=True at head_dim 128, ratio 4 (fast_hadamard_transform stood in by plain
    torch, tests/conftest.py): THD, SBHD and pre-grouped calls through the fused kernels,
    within bf16 rounding of Megatron's eager code."""
    comp = build_compressor(megatron_csa, hidden=256, head_dim=128, ratio=4, rope_dim=64,
                            rotate=True, dtype=torch.bfloat16).cuda()
    if path == "thd":
        lens = [37, 0, 3, 640, 129, 1]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                          device="cuda")
        x = torch.randn(int(cu[-1]) + 5, 1, 256, device="cuda").to(torch.bfloat16)
        rows = C.layout.compressed_capacity(x.shape[0], len(lens), max(lens), 4)  # Megatron's capacity
        step = lambda: thd_step(comp, x, cu, max(lens))  # noqa: E731
    else:
        if path == "sbhd":
            x = torch.randn(1030, 2, 256, device="cuda").to(torch.bfloat16)
            rows = 2 * (1030 // 4)
        else:
            ids = torch.tensor([0, 1, 2, 0] + list(range(100)) + [-1] * 4, dtype=torch.int32,
                               device="cuda")
            x = torch.randn(ids.numel() * 4, 1, 256, device="cuda").to(torch.bfloat16)
            cu = torch.tensor([0, x.shape[0]], dtype=torch.int32, device="cuda")
            rows = ids.numel()

        def step():
            comp.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            if path == "sbhd":
                out = comp(xi)
                out = out[0] if isinstance(out, tuple) else out
            else:
                out, _ = comp._forward_thd(xi, cu, max_seqlen_q=x.shape[0],
                                           compressed_group_ids=ids)
            g = torch.randn(out.shape, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1))
            out.backward(g.to(out.dtype))
            return [out.float(), xi.grad.float()] + [p.grad.float() for p in comp.parameters()]

    want = step()
    got, launched = installed_step(step, monkeypatch)
    assert launched == [rows], megatron.fallback_reasons()
    assert len(hadamard_standin) == 2
    if path == "thd":
        got = [got[0], got[1]] + list(got[2].values())
        want = [want[0], want[1]] + list(want[2].values())
    for a, b in zip(got, want):
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=3e-2)
