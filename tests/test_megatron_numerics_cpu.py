"""The package's Compressor with numerics="megatron" and "eager" against Megatron-LM's own
Compressor, and install(numerics=...) (CPU): output and every gradient bit for bit, on the
THD, SBHD and pre-grouped paths. Megatron's module runs from its snapshot where one is
found (tests/megatron_env.py); those tests skip without it."""

import pytest
import torch

from csa_compressor import megatron
from megatron_env import build_compressor, grouped_step, sbhd_step, thd_step


@pytest.fixture(autouse=True)
def _fresh_fallback_reasons():
    """Each test reads the reasons its own calls recorded."""
    megatron.clear_fallback_reasons()


def _module_like(mg, ratio, head_dim, rope_dim, dtype, yarn=None, rotate=False, pooling="reference"):
    """The package's Compressor with Megatron's parameters, settings and numerics="megatron".
    Megatron's norm weight is first made what training leaves it (Float16Module casts it to
    the dtype; ape stays fp32) and not all ones, so that its use is compared too."""
    from csa_compressor import Compressor
    from csa_compressor.epilogue import YaRN

    with torch.no_grad():
        w = 1 + 0.1 * torch.randn(mg.norm.weight.shape, generator=torch.Generator().manual_seed(7))
        mg.norm.weight.data = w.to(device=mg.norm.weight.device, dtype=dtype)

    ours = Compressor(mg.linear_wkv.weight.shape[1], head_dim, ratio, rope_dim=rope_dim,
                      rope_theta=10000.0, rope_interleaved=True, norm_eps=1e-5, rotate=rotate,
                      dtype=dtype, pooling=pooling, megatron_layout=True, numerics="megatron",
                      rope_yarn=None if yarn is None else YaRN(
                          factor=yarn[0], original_max_position_embeddings=yarn[1]))
    ours.load_megatron_state_dict(mg.state_dict())
    return ours


def _assert_bitwise_megatron(got, want):
    """got: (output, input gradient, {our parameter name: gradient}); want: a Megatron step."""
    from csa_compressor import Compressor

    assert torch.equal(got[0], want[0]), "output"
    assert torch.equal(got[1], want[1]), "input gradient"
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        assert torch.equal(got[2][ok].float(), want[2][mk]), mk


def _ours_thd_step(ours, x, cu, max_seqlen):
    ours.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_(True)
    out, cuc = ours(xs, cu, max_seqlen=max_seqlen)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    g[int(cuc[-1]):] = 0
    out.backward(g)
    return out.detach().float(), xs.grad.float(), {n: p.grad for n, p in ours.named_parameters()}


# (ratio, head_dim, rope_dim, YaRN (factor, original max positions) or None, dtype) of the
# module-against-Megatron tests: both ratios, rope_dim 0, YaRN, fp16 and fp32.
MEGATRON_CASES = [
    (4, 512, 64, None, torch.bfloat16),
    (4, 128, 64, (4.0, 64), torch.bfloat16),
    (4, 64, 64, None, torch.float16),
    (128, 512, 64, None, torch.bfloat16),
    (128, 128, 0, None, torch.bfloat16),
    (128, 256, 64, (16.0, 256), torch.bfloat16),
    (4, 32, 16, None, torch.float32),
]


@pytest.mark.parametrize("ratio,head_dim,rope_dim,yarn,dtype", MEGATRON_CASES)
def test_megatron_numerics_reproduce_megatrons_compressor_bit_for_bit(
        megatron_csa, fused_on_cpu, ratio, head_dim, rope_dim, yarn, dtype):
    """Compressor(numerics="megatron") against Megatron's own Compressor with its pooling
    in fp32 (the adapter installed, the fp32 reference standing in for the kernels: what
    Megatron's fused path computes): the output, padding rows included, and every gradient
    bit for bit, on a ragged pack (an empty segment, a segment shorter than a block, a
    tail past the last block) with capacity padding rows."""
    mg = build_compressor(megatron_csa, hidden=256, head_dim=head_dim, ratio=ratio,
                          rope_dim=rope_dim, dtype=dtype, yarn=None if yarn is None else {
                              "scaling_factor": yarn[0], "original_max_position_embeddings": yarn[1]})
    ours = _module_like(mg, ratio, head_dim, rope_dim, dtype, yarn)
    lens = [701, 0, 3, 517, 262] if ratio == 4 else [1300, 0, 127, 2000]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu[-1]) + 5, 1, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    with megatron.installed():
        want = thd_step(mg, x, cu, max(lens))
    assert fused_on_cpu, "Megatron's pooling did not take the fp32 path"
    got = _ours_thd_step(ours, x, cu, max(lens))
    assert got[0].shape[0] > sum(n // ratio for n in lens)  # capacity padding rows compared too
    _assert_bitwise_megatron(got, want)
    if dtype != torch.float32:  # the default numerics round elsewhere: the test can tell them apart
        fp32 = _module_like(mg, ratio, head_dim, rope_dim, dtype, yarn)
        fp32.numerics, fp32.one_projection = "fp32", True
        other = _ours_thd_step(fp32, x, cu, max(lens))
        assert not torch.equal(other[1], want[1])  # one GEMM's input gradient, not two added
        assert torch.equal(other[0], want[0]) == (rope_dim == 0)  # the rotation rounds once


def test_megatron_numerics_on_the_sbhd_path(megatron_csa, fused_on_cpu):
    """SBHD (3 sequences of 301 tokens, a tail past the last block): bit for bit too."""
    mg = build_compressor(megatron_csa, hidden=128, head_dim=128, ratio=4, rope_dim=64,
                          dtype=torch.bfloat16)
    ours = _module_like(mg, 4, 128, 64, torch.bfloat16)
    x = torch.randn(301, 3, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with megatron.installed():
        want = sbhd_step(mg, x)
    _assert_bitwise_megatron(sbhd_step(ours, x), want)


def test_megatron_numerics_with_the_rotation(megatron_csa, fused_on_cpu, hadamard_standin):
    """rotate=True (Megatron's rotation, a CUDA package, stood in by the same transform in
    fp32 with one rounding): bit for bit against that stand-in."""
    mg = build_compressor(megatron_csa, hidden=128, head_dim=128, ratio=4, rope_dim=64,
                          rotate=True, dtype=torch.bfloat16)
    ours = _module_like(mg, 4, 128, 64, torch.bfloat16, rotate=True)
    lens = [97, 0, 3, 260]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 1, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with megatron.installed():
        want = thd_step(mg, x, cu, max(lens))
    _assert_bitwise_megatron(_ours_thd_step(ours, x, cu, max(lens)), want)
    assert len(hadamard_standin) == 1


def _assert_megatron_eager(got, want):
    """_assert_bitwise_megatron but for ape's gradient, an fp32 sum over the rows that Megatron
    adds in torch's order and the pooling in another: within 1e-5 of its largest entry."""
    from csa_compressor import Compressor

    assert torch.equal(got[0], want[0]), "output"
    assert torch.equal(got[1], want[1]), "input gradient"
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        if mk == "ape":
            err = (got[2][ok].float() - want[2][mk]).abs().max()
            assert err <= 1e-5 * want[2][mk].abs().max(), f"ape: {err}"
        else:
            assert torch.equal(got[2][ok].float(), want[2][mk]), mk


@pytest.mark.parametrize("ratio,head_dim,rope_dim,yarn,dtype", MEGATRON_CASES)
def test_megatron_eager_numerics_reproduce_megatrons_own_compressor(
        megatron_csa, ratio, head_dim, rope_dim, yarn, dtype):
    """Compressor(numerics="megatron_eager") against Megatron's Compressor as it runs
    without fused kernels (nothing installed: its eager pooling rounds the softmax weights
    and the products to the dtype). On the CPU the module's pooling is the "upstream"
    reference. Output and every gradient bit for bit on a ragged pack with capacity padding
    rows; the "megatron" numerics (fp32 pooling) do not reproduce it, so the test can tell."""
    mg = build_compressor(megatron_csa, hidden=256, head_dim=head_dim, ratio=ratio,
                          rope_dim=rope_dim, dtype=dtype, yarn=None if yarn is None else {
                              "scaling_factor": yarn[0], "original_max_position_embeddings": yarn[1]})
    ours = _module_like(mg, ratio, head_dim, rope_dim, dtype, yarn)
    ours.numerics = "megatron_eager"
    lens = [701, 0, 3, 517, 262] if ratio == 4 else [1300, 0, 127, 2000]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu[-1]) + 5, 1, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert not megatron.is_installed()
    want = thd_step(mg, x, cu, max(lens))
    got = _ours_thd_step(ours, x, cu, max(lens))
    assert got[0].shape[0] > sum(n // ratio for n in lens)
    _assert_megatron_eager(got, want)
    if dtype != torch.float32:  # fp32 inputs: nothing to round, the two numerics are one
        fp32_pool = _module_like(mg, ratio, head_dim, rope_dim, dtype, yarn)
        other = _ours_thd_step(fp32_pool, x, cu, max(lens))
        assert not torch.equal(other[0], want[0])


def test_megatron_eager_numerics_on_the_sbhd_path(megatron_csa):
    """SBHD (3 sequences of 301 tokens) against Megatron's own eager SBHD path: bit for bit."""
    from csa_compressor import Compressor

    mg = build_compressor(megatron_csa, hidden=128, head_dim=128, ratio=4, rope_dim=64,
                          dtype=torch.bfloat16)
    ours = _module_like(mg, 4, 128, 64, torch.bfloat16)
    eager = Compressor(128, 128, 4, rope_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                       dtype=torch.bfloat16, pooling="reference", megatron_layout=True,
                       numerics="megatron_eager")
    eager.load_megatron_state_dict(mg.state_dict())
    x = torch.randn(301, 3, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = sbhd_step(mg, x)
    _assert_megatron_eager(sbhd_step(eager, x), want)
    assert not torch.equal(sbhd_step(ours, x)[0], want[0])


@pytest.mark.parametrize("path", ["thd", "sbhd"])
def test_megatron_eager_numerics_reach_the_fused_pooling(megatron_csa, fused_on_cpu, path):
    """Through the fused path (its launch standing in on the CPU with the reference of the
    numerics it is handed): numerics="megatron_eager" asks the kernels for the "eager"
    rounding, so the module is Megatron's own eager Compressor on both layouts."""
    from csa_compressor import Compressor

    mg = build_compressor(megatron_csa, hidden=128, head_dim=128, ratio=4, rope_dim=64,
                          dtype=torch.bfloat16)
    _module_like(mg, 4, 128, 64, torch.bfloat16)  # Megatron's norm weight as training has it
    ours = Compressor(128, 128, 4, rope_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                      dtype=torch.bfloat16, pooling="fused", megatron_layout=True,
                      numerics="megatron_eager")
    ours.load_megatron_state_dict(mg.state_dict())
    gen = torch.Generator().manual_seed(4)
    if path == "sbhd":
        x = torch.randn(301, 3, 128, generator=gen).to(torch.bfloat16)
        want, got = sbhd_step(mg, x), sbhd_step(ours, x)
    else:
        lens = [97, 0, 3, 260]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        x = torch.randn(int(cu[-1]), 1, 128, generator=gen).to(torch.bfloat16)
        want, got = thd_step(mg, x, cu, max(lens)), _ours_thd_step(ours, x, cu, max(lens))
    assert fused_on_cpu, "the fused pooling was not called"
    _assert_megatron_eager(got, want)


@pytest.mark.parametrize("path", ["thd", "sbhd", "grouped"])
def test_install_numerics_eager_keeps_megatrons_eager_bits(megatron_csa, fused_on_cpu, path):
    """install(numerics="eager"): Megatron's own Compressor with its pooling fused (standing
    in on the CPU by the reference of the numerics handed over) computes what it computes
    with nothing installed on its THD, SBHD and pre-grouped paths: the output and every
    gradient bit for bit but ape's (an fp32 sum in another order); install() alone does not."""
    mg = build_compressor(megatron_csa, hidden=128, head_dim=128, ratio=4, rope_dim=64,
                          dtype=torch.bfloat16)
    _module_like(mg, 4, 128, 64, torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    if path == "sbhd":
        x = torch.randn(301, 3, 128, generator=gen).to(torch.bfloat16)
        step = lambda: sbhd_step(mg, x)  # noqa: E731
    elif path == "grouped":
        ids = torch.tensor([0, 1, 2, 0, 1, -1], dtype=torch.int32)  # no halo row: all compared
        x = torch.randn(len(ids) * 4, 1, 128, generator=gen).to(torch.bfloat16)
        step = lambda: grouped_step(mg, x, ids, 12, False)  # noqa: E731
    else:
        lens = [97, 0, 3, 260]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        x = torch.randn(int(cu[-1]), 1, 128, generator=gen).to(torch.bfloat16)
        step = lambda: thd_step(mg, x, cu, max(lens))  # noqa: E731
    want = step()
    with megatron.installed(numerics="eager"):
        got = step()
    assert fused_on_cpu, megatron.fallback_reasons()
    with megatron.installed():
        fp32 = step()
    assert not torch.equal(fp32[0], want[0])
    assert torch.equal(got[0], want[0]), "output"
    assert torch.equal(got[1], want[1]), "input gradient"
    for name, grad in want[2].items():
        if name == "ape":
            assert (got[2][name] - grad).abs().max() <= 1e-5 * grad.abs().max()
        else:
            assert torch.equal(got[2][name], grad), name
    with pytest.raises(ValueError, match="numerics: expected one of"):
        megatron.install(numerics="bf16")


def test_megatron_numerics_is_checked():
    from csa_compressor import Compressor

    with pytest.raises(ValueError, match="numerics: expected one of"):
        Compressor(64, 32, 4, numerics="bf16")
