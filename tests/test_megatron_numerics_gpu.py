"""Megatron-LM's Compressor installed with its own numerics on the GPU: install(numerics=...)
reproduces Megatron's Compressor (its eager region's roundings) on the fused kernels, THD
and SBHD, and numerics="eager" keeps its eager bits."""

import pytest
import torch

from csa_compressor import megatron
from megatron_env import bf16_ulps, build_compressor, thd_step
from megatron_gpu_env import fresh_fallback_reasons  # noqa: F401  (the fixture)
from megatron_gpu_env import installed_step, sbhd_step, ours_thd_step, path_case, hooked_step

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_fallback_reasons")]


@pytest.mark.parametrize("ratio,head_dim,yarn,rotate", [
    (4, 512, None, False), (4, 128, (4.0, 4096), True), (128, 512, (16.0, 4096), False),
    (128, 128, None, False)])
def test_megatron_numerics_reproduce_megatrons_compressor_on_the_fused_kernels(
        megatron_csa, hadamard_standin, ratio, head_dim, yarn, rotate):
    """Compressor(numerics="megatron", pooling="fused") against Megatron's Compressor with the
    adapter installed (its pooling on the same fused kernels, fp32 as Megatron's own fused
    path): a pack of 8192 + 8191 + 5000 + 3 + 0 tokens, hidden 1024, bf16; the output and
    every gradient bit for bit (rotate: Megatron's rotation stood in, tests/conftest.py)."""
    from csa_compressor import Compressor
    from csa_compressor.epilogue import YaRN

    hidden = 1024
    mg = build_compressor(megatron_csa, hidden=hidden, head_dim=head_dim, ratio=ratio, rope_dim=64,
                          rotate=rotate, dtype=torch.bfloat16, yarn=None if yarn is None else {
                              "scaling_factor": yarn[0],
                              "original_max_position_embeddings": yarn[1]}).cuda()
    ours = Compressor(hidden, head_dim, ratio, rope_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                      rotate=rotate, dtype=torch.bfloat16, device="cuda", pooling="fused",
                      megatron_layout=True, numerics="megatron",
                      rope_yarn=None if yarn is None else YaRN(
                          factor=yarn[0], original_max_position_embeddings=yarn[1]))
    with torch.no_grad():  # what Float16Module leaves it: the dtype (and not all ones)
        mg.norm.weight.data = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(torch.bfloat16)
    ours.load_megatron_state_dict(mg.state_dict())
    lens = [8192, 8191, 5000, 3, 0]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = torch.randn(int(cu[-1]), 1, hidden, device="cuda").to(torch.bfloat16)
    want, calls = hooked_step(megatron_csa, lambda: thd_step(mg, x, cu, max(lens)))
    assert calls == [True], megatron.fallback_reasons()
    got = ours_thd_step(ours, x, cu, max(lens))
    pairs = [("output", got[0], want[0]), ("input gradient", got[1], want[1])]
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        pairs.append((mk, got[2][ok], want[2][mk]))
    differ = {name: int((a != b).sum()) for name, a, b in pairs}
    assert not any(differ.values()), f"elements that differ: {differ}"


def _eager_report(got, want):
    """{tensor: (elements that differ, max bf16 ulps of max(|x|, the row's RMS))} of a
    module step against a Megatron step."""
    from csa_compressor import Compressor

    pairs = [("output", got[0], want[0]), ("input gradient", got[1], want[1])]
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        pairs.append((mk, got[2][ok], want[2][mk]))
    return {name: (int((a != b).sum()), float(bf16_ulps(a, b).max())) for name, a, b in pairs}


@pytest.mark.parametrize("path,ratio,head_dim,yarn", [
    ("thd", 4, 512, None), ("thd", 4, 128, (4.0, 4096)), ("thd", 128, 512, (16.0, 4096)),
    ("thd", 128, 128, None), ("sbhd", 4, 512, None), ("sbhd", 128, 128, None)])
def test_megatron_eager_numerics_reproduce_megatrons_own_compressor_on_the_fused_kernels(
        megatron_csa, path, ratio, head_dim, yarn):
    """Compressor(numerics="megatron_eager", pooling="fused") against Megatron's Compressor
    with nothing installed (its eager region: weights and products rounded to bf16), at
    scale (THD 8192 + 8191 + 5000 + 3 + 0 tokens, SBHD 2 x 4100, hidden 1024, bf16): the
    output and every gradient within 2 bf16 ulps of max(|x|, the row's RMS), and the
    default pooling's fp32 numerics measurably further."""
    from csa_compressor import Compressor
    from csa_compressor.epilogue import YaRN

    hidden = 1024
    mg = build_compressor(megatron_csa, hidden=hidden, head_dim=head_dim, ratio=ratio, rope_dim=64,
                          dtype=torch.bfloat16, yarn=None if yarn is None else {
                              "scaling_factor": yarn[0],
                              "original_max_position_embeddings": yarn[1]}).cuda()
    with torch.no_grad():
        mg.norm.weight.data = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(torch.bfloat16)

    def module(numerics):
        ours = Compressor(hidden, head_dim, ratio, rope_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                          dtype=torch.bfloat16, device="cuda", pooling="fused",
                          megatron_layout=True, numerics=numerics,
                          rope_yarn=None if yarn is None else YaRN(
                              factor=yarn[0], original_max_position_embeddings=yarn[1]))
        ours.load_megatron_state_dict(mg.state_dict())
        return ours

    assert not megatron.is_installed()
    if path == "sbhd":
        x = torch.randn(4100, 2, hidden, device="cuda").to(torch.bfloat16)
        want = sbhd_step(mg, x)
        step = lambda comp: sbhd_step(comp, x)  # noqa: E731
    else:
        lens = [8192, 8191, 5000, 3, 0]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                          device="cuda")
        x = torch.randn(int(cu[-1]), 1, hidden, device="cuda").to(torch.bfloat16)
        want = thd_step(mg, x, cu, max(lens))
        step = lambda comp: ours_thd_step(comp, x, cu, max(lens))  # noqa: E731
    eager = _eager_report(step(module("megatron_eager")), want)
    fp32 = _eager_report(step(module("megatron")), want)
    print(f"\n{path} r{ratio} d{head_dim}: megatron_eager {eager}\n  megatron (fp32 pooling) {fp32}")
    assert all(ulps <= 2.0 for _, ulps in eager.values()), eager
    assert eager["output"][0] < fp32["output"][0], (eager, fp32)


@pytest.mark.parametrize("path,ratio,head_dim", [("thd", 4, 512), ("thd", 128, 128),
                                                ("sbhd", 4, 128), ("sbhd", 128, 512)])
def test_install_numerics_eager_keeps_megatrons_eager_bits_on_the_fused_kernels(
        megatron_csa, monkeypatch, path, ratio, head_dim):
    """install(numerics="eager"): Megatron's Compressor with its pooling on the fused kernels
    (each step's launch counted) against the same module with nothing installed, at scale
    (THD 8192 + 8191 + 5000 + 3 + 0 tokens, SBHD 2 x 4100, hidden 1024, bf16): the output
    and every gradient bit for bit, ape's within 2 bf16 ulps (an fp32 sum in another order)."""
    hidden = 1024
    mg = build_compressor(megatron_csa, hidden=hidden, head_dim=head_dim, ratio=ratio, rope_dim=64,
                          dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        mg.norm.weight.data = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(torch.bfloat16)
    x, extra, _ = path_case(path, ratio, hidden)
    if path == "sbhd":
        step = lambda: sbhd_step(mg, x)  # noqa: E731
    else:
        step = lambda: thd_step(mg, x, extra["cu"], extra["max_seqlen"])  # noqa: E731
    want = step()
    from csa_compressor import dispatch

    fused, launched = dispatch.fused_from_validated, []

    def counted(p, *a, **k):  # the numerics the launch ran with (set by fused_from_validated)
        out = fused(p, *a, **k)
        launched.append(p.numerics)
        return out

    monkeypatch.setattr(dispatch, "fused_from_validated", counted)
    with megatron.installed(numerics="eager"):
        got = step()
    assert launched == ["eager"], megatron.fallback_reasons()
    differ = {"output": int((got[0] != want[0]).sum()),
              "input gradient": int((got[1] != want[1]).sum())}
    for name, grad in want[2].items():
        if name == "ape":
            ulps = float(bf16_ulps(got[2][name], grad).max())
            assert ulps <= 2.0, ulps
        else:
            differ[name] = int((got[2][name] != grad).sum())
    assert not any(differ.values()), f"elements that differ: {differ}"


@pytest.mark.parametrize("ratio,head_dim", [(4, 512), (128, 128)])
def test_megatron_numerics_on_megatrons_sbhd_path(megatron_csa, monkeypatch, ratio, head_dim):
    """SBHD (2 sequences of 4100 tokens, a tail past the last block): Compressor(numerics=
    "megatron", pooling="fused") against Megatron's SBHD path installed, bit for bit."""
    from csa_compressor import Compressor

    hidden = 1024
    mg = build_compressor(megatron_csa, hidden=hidden, head_dim=head_dim, ratio=ratio,
                          rope_dim=64, dtype=torch.bfloat16).cuda()
    ours = Compressor(hidden, head_dim, ratio, rope_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                      dtype=torch.bfloat16, device="cuda", pooling="fused", numerics="megatron")
    with torch.no_grad():
        mg.norm.weight.data = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(torch.bfloat16)
    ours.load_megatron_state_dict(mg.state_dict())
    x = torch.randn(4100, 2, hidden, device="cuda").to(torch.bfloat16)
    want, launched = installed_step(lambda: sbhd_step(mg, x), monkeypatch)
    assert launched == [2 * (4100 // ratio)], megatron.fallback_reasons()
    got = sbhd_step(ours, x)
    differ = {"output": int((got[0] != want[0]).sum()), "input gradient": int((got[1] != want[1]).sum())}
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        differ[mk] = int((got[2][ok] != want[2][mk]).sum())
    assert not any(differ.values()), f"elements that differ: {differ}"
