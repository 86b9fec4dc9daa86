"""csa_compressor.megatron: the install, the hook's fallbacks and its wiring into
Megatron-LM's own Compressor (CPU). Megatron's module runs from its snapshot where one is
found (tests/megatron_env.py); those tests skip without it. On the GPU the fused kernels
answer the hook (tests/test_megatron_gpu.py)."""

import sys
import types

import pytest
import torch
from csa_compressor import runtime

from csa_compressor import megatron
from megatron_env import (bf16_ulps, build_compressor, count_concatenations, epilogue_by_hand,
                          thd_step)


@pytest.fixture(autouse=True)
def _fresh_fallback_reasons():
    """Each test reads the reasons its own calls recorded."""
    megatron.clear_fallback_reasons()


@pytest.fixture
def stub_csa(monkeypatch):
    """A stand-in for Megatron's csa module: just the names the adapter needs."""
    mod = types.ModuleType(megatron.hooks.CSA_MODULE)
    original = lambda *a, **k: None  # noqa: E731

    class Compressor:
        def _forward_sbhd(self, x):
            return "eager"

    mod.maybe_compress_thd_fused, mod.Compressor = original, Compressor
    monkeypatch.setitem(sys.modules, megatron.hooks.CSA_MODULE, mod)
    yield mod, original
    megatron.uninstall()


def test_install_and_uninstall_swap_the_hook(stub_csa):
    mod, original = stub_csa
    assert not megatron.is_installed()
    eager = mod.Compressor.__dict__["_forward_sbhd"]
    megatron.install()
    megatron.install()  # idempotent
    assert mod.maybe_compress_thd_fused is megatron.maybe_compress_thd_fused
    assert mod.Compressor._forward_sbhd is megatron.hooks.forward_sbhd
    megatron.uninstall()
    assert mod.maybe_compress_thd_fused is original and not megatron.is_installed()
    assert mod.Compressor.__dict__["_forward_sbhd"] is eager
    with megatron.installed():
        assert mod.maybe_compress_thd_fused is megatron.maybe_compress_thd_fused
    assert mod.maybe_compress_thd_fused is original
    with pytest.raises(TypeError, match="respect_enabled"):
        megatron.install(respect_enabled="yes")


def test_a_megatron_without_the_hook_is_named(monkeypatch):
    mod = types.ModuleType(megatron.hooks.CSA_MODULE)
    monkeypatch.setitem(sys.modules, megatron.hooks.CSA_MODULE, mod)
    with pytest.raises(ImportError, match="maybe_compress_thd_fused, Compressor"):
        megatron.install()


def test_importing_the_package_never_imports_megatron():
    import subprocess

    code = ("import csa_compressor, sys; csa_compressor.Compressor; csa_compressor.reference;"
            "assert not any(m.startswith('megatron') for m in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _assert_parameter_grads_close(got, want, **tol):
    """Every parameter's gradient (ape among them), each relative to its largest element."""
    assert set(got) == set(want) and "ape" in got
    for name in want:
        scale = want[name].abs().max()
        torch.testing.assert_close(got[name] / scale, want[name] / scale, **tol, msg=name)


def _thd(T=104, d=32, coff=2, ratio=4, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(T, 1, coff * d, generator=gen).to(dtype)
    score = torch.randn(T, 1, coff * d, generator=gen).to(dtype)
    ape = torch.randn(ratio, coff * d, generator=gen)
    cu = torch.tensor([0, 37, 37, 100], dtype=torch.int32)
    cuc = torch.tensor([0, 9, 9, 24], dtype=torch.int32)
    return kv, score, ape, cu, cuc


@pytest.mark.parametrize("mutate,words", [
    (lambda a: {**a, "kv": a["kv"][:, 0]}, "kv: expected (T, 1, coff*d)"),
    (lambda a: {**a, "head_dim": 16}, "not coff*head_dim"),
    (lambda a: {**a, "score": a["score"][:50]}, "score"),
    (lambda a: {**a, "ape": a["ape"].double()}, "ape"),
    (lambda a: {**a, "kv": "not a tensor"}, "kv"),
    (lambda a: {**a, "total_comp": -1}, "total_comp"),
])
def test_the_hook_falls_back_with_a_reason_and_never_raises(monkeypatch, mutate, words):
    """What Megatron could hand the hook that the kernels cannot take: None and the reason
    (the device check passed over, so the input checks answer on the CPU)."""
    monkeypatch.setattr("csa_compressor.runtime.device_reason", lambda device: None)
    kv, score, ape, cu, cuc = _thd()
    args = dict(kv=kv, score=score, ape=ape, cu_seqlens=cu, cu_seqlens_comp=cuc, total_comp=26,
                ratio=4, head_dim=32, coff=2, enabled=True)
    assert megatron.maybe_compress_thd_fused(**mutate(args)) is None
    assert any(words in r for r in megatron.fallback_reasons()), megatron.fallback_reasons()


def test_on_the_cpu_the_hook_says_so():
    kv, score, ape, cu, cuc = _thd()
    assert megatron.maybe_compress_thd_fused(kv, score, ape, cu, cuc, 26, 4, 32, 2) is None
    assert any("tensors are on cpu" in r for r in megatron.fallback_reasons())


def test_megatrons_enabled_flag_is_ignored_unless_asked(stub_csa, fused_on_cpu):
    kv, score, ape, cu, cuc = _thd()
    with megatron.installed():
        out = megatron.maybe_compress_thd_fused(kv, score, ape, cu, cuc, 26, ratio=4, head_dim=32,
                                                coff=2, enabled=False)
        assert out is not None and out.shape == (26, 1, 32)
    with megatron.installed(respect_enabled=True):
        assert megatron.maybe_compress_thd_fused(kv, score, ape, cu, cuc, 26, ratio=4, head_dim=32,
                                                 coff=2, enabled=False) is None


@pytest.mark.parametrize("ratio,head_dim,dtype", [(4, 32, torch.float32), (4, 128, torch.float32),
                                                  (4, 32, torch.bfloat16), (128, 32, torch.float32)])
def test_megatrons_compressor_through_the_hook(megatron_csa, fused_on_cpu, ratio, head_dim, dtype):
    """Megatron's own Compressor, its THD path with static capacity (padding rows), ragged
    packs with empty and short segments: installed, with the fused op standing in as the
    fp32 reference (the kernels' contract; no GPU here), its output and every gradient
    (input, both projection weights, ape, norm weight) against its eager region."""
    # In bf16 the eager region rounds its weights and products to bf16; the fp32 pooling
    # differs from it by that rounding. (rotate=True needs fast_hadamard_transform, a GPU
    # package: not here.)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    comp = build_compressor(megatron_csa, hidden=64, head_dim=head_dim, ratio=ratio, rope_dim=16,
                            dtype=dtype)
    lens = [37, 0, 3, 63, 9] if ratio == 4 else [300, 0, 127, 520]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu[-1]) + 4, 1, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = thd_step(comp, x, cu, max(lens))
    with megatron.installed():
        got = thd_step(comp, x, cu, max(lens))
    assert fused_on_cpu, "the hook was not called"
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    _assert_parameter_grads_close(got[2], want[2], **tol)


@pytest.mark.parametrize("epilogue", [False, True])
def test_megatrons_compressor_on_the_cpu_keeps_its_eager_pooling(megatron_csa, epilogue):
    comp = build_compressor(megatron_csa, hidden=64, head_dim=32, ratio=4, rope_dim=16)
    cu = torch.tensor([0, 37, 100], dtype=torch.int32)
    x = torch.randn(100, 1, 64)
    want = thd_step(comp, x, cu, 63)
    with megatron.installed(epilogue=epilogue):
        got = thd_step(comp, x, cu, 63)
    assert torch.equal(got[0], want[0])
    assert any("tensors are on cpu" in r for r in megatron.fallback_reasons())


@pytest.mark.parametrize("ratio,yarn", [(4, None), (128, None), (4, (4.0, 64)), (128, (16.0, 256))])
def test_the_module_reproduces_megatrons_compressor(megatron_csa, ratio, yarn):
    """Compressor(megatron_layout=True) with Megatron's parameters (load_megatron_state_dict)
    and its settings (RMSNorm eps 1e-5, RoPE base 10000 on the last rope_dim channels in
    interleaved pairs at block_index * ratio, padding rows continuing the last segment): the
    same output, padding rows included, and gradients as Megatron's own Compressor on its
    THD path (fp32; plain RoPE, and YaRN given its factor and original length)."""
    from csa_compressor import Compressor
    from csa_compressor.epilogue import YaRN

    mg = build_compressor(megatron_csa, hidden=64, head_dim=32, ratio=ratio, rope_dim=16,
                          yarn=None if yarn is None else {
                              "scaling_factor": yarn[0],
                              "original_max_position_embeddings": yarn[1]})
    ours = Compressor(64, 32, ratio, rope_dim=16, rope_theta=10000.0, rope_interleaved=True,
                      norm_eps=1e-5, dtype=torch.float32, pooling="reference", megatron_layout=True,
                      rope_yarn=None if yarn is None else YaRN(
                          factor=yarn[0], original_max_position_embeddings=yarn[1]))
    ours.load_megatron_state_dict(mg.state_dict())
    lens = [37, 0, 3, 63, 9] if ratio == 4 else [300, 0, 127, 520]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu[-1]) + 4, 1, 64, generator=torch.Generator().manual_seed(3))
    want = thd_step(mg, x, cu, max(lens))
    xs = x.clone().requires_grad_(True)
    out, cuc = ours(xs, cu, max_seqlen=max(lens))
    n = int(cuc[-1])
    assert out.shape == want[0].shape and out.shape[0] > n  # capacity padding rows too
    torch.testing.assert_close(out.detach(), want[0], rtol=1e-4, atol=1e-4)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    g[n:] = 0
    out.backward(g)
    torch.testing.assert_close(xs.grad, want[1], rtol=1e-4, atol=1e-4)
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        got = dict(ours.named_parameters())[ok].grad
        scale = want[2][mk].abs().max()
        torch.testing.assert_close(got / scale, want[2][mk] / scale, rtol=1e-4, atol=1e-4, msg=mk)


def test_megatron_layout_returns_none_when_nothing_compresses():
    from csa_compressor import Compressor

    m = Compressor(64, 32, 4, dtype=torch.float32, megatron_layout=True)
    out, cuc = m(torch.randn(6, 1, 64), torch.tensor([0, 3, 6], dtype=torch.int32))
    assert out is None and cuc.tolist() == [0, 0, 0]
    out, _ = m(torch.randn(8, 1, 64), torch.tensor([0, 8], dtype=torch.int32))
    assert out.shape == (2, 1, 32)
    with pytest.raises(KeyError, match="linear_q"):
        m.load_megatron_state_dict({"linear_q.weight": torch.zeros(1)})


def _sbhd_step(comp, x):
    comp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = comp(x)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return (out.detach().float(), x.grad.float(),
            {n: p.grad.float() for n, p in comp.named_parameters()})


@pytest.mark.parametrize("ratio,head_dim,sq", [(4, 32, 37), (4, 128, 64), (128, 32, 300),
                                               (128, 32, 260)])
def test_megatrons_sbhd_compressor_through_the_adapter(megatron_csa, fused_on_cpu, ratio,
                                                      head_dim, sq):
    """Megatron's SBHD path (no packed_seq_params; b = 3 sequences of sq tokens, a tail
    past the last block) installed, the fused pooling standing in as the fp32 reference:
    output and every gradient against Megatron's own method; sq < ratio stays Megatron's
    None."""
    comp = build_compressor(megatron_csa, hidden=64, head_dim=head_dim, ratio=ratio, rope_dim=16)
    x = torch.randn(sq, 3, 64, generator=torch.Generator().manual_seed(2))
    want = _sbhd_step(comp, x)
    with megatron.installed():
        got = _sbhd_step(comp, x)
        short = comp(torch.randn(ratio - 1, 3, 64))
    assert fused_on_cpu == [3 * (sq // ratio)], "the fused pooling was not called once"
    assert short[0] is None if isinstance(short, tuple) else short is None
    assert got[0].shape == (sq // ratio, 3, head_dim)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    _assert_parameter_grads_close(got[2], want[2], rtol=1e-5, atol=1e-5)


def _grouped_step(comp, x, ids, max_seqlen, skip_row0):
    """One pre-grouped (context-parallel) forward + backward of Megatron's Compressor. Row 0
    takes no gradient where it is the previous rank's halo (ids[0] != 0), as downstream."""
    comp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    cu = torch.tensor([0, x.shape[0]], dtype=torch.int32)
    out, second = comp._forward_thd(x, cu, max_seqlen_q=max_seqlen, compressed_group_ids=ids)
    assert second is None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    if skip_row0:
        g[0] = 0
    out.backward(g)
    return (out.detach().float(), x.grad.float(),
            {n: p.grad.float() for n, p in comp.named_parameters()})


@pytest.mark.parametrize("ratio,ids", [
    (4, [3, 4, 5, 0, 1, 2, 0, -1, -1]),    # a halo row, a continuation, a new sequence, padding
    (4, [0, 1, 2, 3, 0, 0, 1]),            # starts at a sequence start; a one-block sequence
    (128, [7, 8, 0, 1, -1]),
])
def test_megatrons_grouped_compressor_through_the_adapter(megatron_csa, fused_on_cpu, ratio, ids):
    """Megatron's context-parallel pre-grouped path installed, the fused pooling standing in
    as the fp32 reference: output and every gradient against Megatron's own eager region,
    row 0 excepted where it is an overlapping halo (Megatron fills its previous block from
    the buffer's last group, the adapter leaves it empty; downstream never reads it)."""
    comp = build_compressor(megatron_csa, hidden=64, head_dim=32, ratio=ratio, rope_dim=16)
    ids = torch.tensor(ids, dtype=torch.int32)
    x = torch.randn(ids.numel() * ratio, 1, 64, generator=torch.Generator().manual_seed(2))
    halo = int(ids[0]) != 0 and comp.overlap  # without overlap no row reads a previous block
    max_seqlen = (int(ids.max()) + 1) * ratio
    want = _grouped_step(comp, x, ids, max_seqlen, halo)
    with megatron.installed():
        got = _grouped_step(comp, x, ids, max_seqlen, halo)
    assert fused_on_cpu == [ids.numel()], "the fused pooling was not called once"
    assert got[0].shape == want[0].shape == (ids.numel(), 1, 32)
    rows = slice(1 if halo else 0, None)
    torch.testing.assert_close(got[0][rows], want[0][rows], rtol=1e-5, atol=1e-5)
    if halo:  # the halo row itself: a first block here, not Megatron's rolled one
        assert not torch.allclose(got[0][0], want[0][0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    _assert_parameter_grads_close(got[2], want[2], rtol=1e-5, atol=1e-5)


def test_grouped_calls_megatron_cannot_fuse_keep_its_eager_region(megatron_csa):
    comp = build_compressor(megatron_csa, hidden=64, head_dim=32, ratio=4, rope_dim=16)
    ids = torch.tensor([0, 1, 2], dtype=torch.int32)
    x = torch.randn(12, 1, 64)
    cu = torch.tensor([0, 12], dtype=torch.int32)
    want = comp._forward_thd(x, cu, max_seqlen_q=12, compressed_group_ids=ids)[0]
    with megatron.installed():
        got = comp._forward_thd(x, cu, max_seqlen_q=12, compressed_group_ids=ids)[0]
    assert torch.equal(got, want)
    assert any("tensors are on cpu" in r for r in megatron.fallback_reasons())


@pytest.mark.parametrize("fuse_all", [False, True])
def test_the_hook_engages_under_deterministic_mode_and_torch_compile(megatron_csa, fused_on_cpu,
                                                                     fuse_all):
    """Megatron's own fused path refuses deterministic mode and torch.compile; installed,
    ours takes both (its backward is bitwise reproducible without atomics): the fused
    pooling runs, and the compiled step gives the eager step's output and gradients (with
    the fused epilogue and the one projection GEMM too)."""
    import torch._dynamo

    comp = build_compressor(megatron_csa, hidden=64, head_dim=32, ratio=4, rope_dim=16)
    cu = torch.tensor([0, 37, 37, 100], dtype=torch.int32)
    x = torch.randn(104, 1, 64, generator=torch.Generator().manual_seed(2))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        megatron.clear_fallback_reasons()
        with megatron.installed(epilogue=fuse_all, projection=fuse_all):
            want = thd_step(comp, x, cu, 63)
            assert fused_on_cpu, megatron.fallback_reasons()
            launched = len(fused_on_cpu)
            torch._dynamo.reset()
            compiled = torch.compile(comp, backend="aot_eager")
            got = thd_step(compiled, x, cu, 63)
            assert len(fused_on_cpu) > launched  # the compiled step pooled through the hook too
            assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    finally:
        torch.use_deterministic_algorithms(was)
        torch._dynamo.reset()
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    grads = {n.removeprefix("_orig_mod."): g for n, g in got[2].items()}  # the compiled wrapper's
    assert set(grads) == set(want[2])
    for name in want[2]:
        torch.testing.assert_close(grads[name], want[2][name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("path", ["thd", "sbhd", "grouped"])
def test_megatrons_rotating_compressor_through_the_adapter(megatron_csa, fused_on_cpu,
                                                          hadamard_standin, path):
    """rotate=True (the indexer's Compressor: head_dim 128, ratio 4, Hadamard after RoPE;
    Megatron's rotation takes bf16 only): THD, SBHD and pre-grouped calls installed, the
    fused pooling standing in as the fp32 reference, against Megatron's eager code within
    bf16 rounding, output and every gradient."""
    tol = dict(rtol=2e-2, atol=2e-2)
    comp = build_compressor(megatron_csa, hidden=64, head_dim=128, ratio=4, rope_dim=16,
                            rotate=True, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    if path == "thd":
        lens = [37, 0, 3, 63, 9]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        x = torch.randn(int(cu[-1]) + 4, 1, 64, generator=gen).to(torch.bfloat16)
        step = lambda: thd_step(comp, x, cu, max(lens))  # noqa: E731
    elif path == "sbhd":
        x = torch.randn(37, 3, 64, generator=gen).to(torch.bfloat16)
        step = lambda: _sbhd_step(comp, x)  # noqa: E731
    else:
        ids = torch.tensor([0, 1, 2, 0, 1, -1], dtype=torch.int32)
        x = torch.randn(ids.numel() * 4, 1, 64, generator=gen).to(torch.bfloat16)
        step = lambda: _grouped_step(comp, x, ids, 12, False)  # noqa: E731
    want = step()
    with megatron.installed():
        got = step()
    assert fused_on_cpu, "the fused pooling was not called"
    assert len(hadamard_standin) == 2, "each step rotates once"
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    _assert_parameter_grads_close(got[2], want[2], **tol)


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
        want = _sbhd_step(mg, x)
    _assert_bitwise_megatron(_sbhd_step(ours, x), want)


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
    want = _sbhd_step(mg, x)
    _assert_megatron_eager(_sbhd_step(eager, x), want)
    assert not torch.equal(_sbhd_step(ours, x)[0], want[0])


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
        want, got = _sbhd_step(mg, x), _sbhd_step(ours, x)
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
        step = lambda: _sbhd_step(mg, x)  # noqa: E731
    elif path == "grouped":
        ids = torch.tensor([0, 1, 2, 0, 1, -1], dtype=torch.int32)  # no halo row: all compared
        x = torch.randn(len(ids) * 4, 1, 128, generator=gen).to(torch.bfloat16)
        step = lambda: _grouped_step(mg, x, ids, 12, False)  # noqa: E731
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


# install(epilogue=True): Megatron's norm, RoPE and rotation as the fused epilogue

def _epilogue_case(megatron_csa, path, ratio, head_dim, rope_dim, yarn, rotate):
    """Megatron's Compressor (bf16, its norm weight as Float16Module leaves it and not all
    ones), its input, and a step function of a forward: (output, input gradient,
    {name: parameter gradient})."""
    mg = build_compressor(megatron_csa, hidden=128, head_dim=head_dim, ratio=ratio,
                          rope_dim=rope_dim, rotate=rotate, dtype=torch.bfloat16,
                          yarn=None if yarn is None else {
                              "scaling_factor": yarn[0], "original_max_position_embeddings": yarn[1]})
    with torch.no_grad():
        w = 1 + 0.1 * torch.randn(head_dim, generator=torch.Generator().manual_seed(7))
        mg.norm.weight.data = w.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    if path == "thd":
        lens = [701, 0, 3, 517, 262] if ratio == 4 else [1300, 0, 127, 700]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        x = torch.randn(int(cu[-1]) + 5, 1, 128, generator=gen).to(torch.bfloat16)
        extra = dict(cu=cu, max_seqlen=max(lens))
        forward = lambda comp, xi: comp(xi, _psp(cu, max(lens)))[0]  # noqa: E731
    elif path == "sbhd":
        x = torch.randn(301 if ratio == 4 else 600, 3, 128, generator=gen).to(torch.bfloat16)
        extra = {}
        forward = lambda comp, xi: comp(xi)  # noqa: E731
    else:
        ids = torch.tensor([3, 4, 5, 0, 1, 2, 0, -1] if ratio == 4 else [7, 8, 0, 1, -1],
                           dtype=torch.int32)
        x = torch.randn(ids.numel() * ratio, 1, 128, generator=gen).to(torch.bfloat16)
        mx = (int(ids.max()) + 1) * ratio
        extra = dict(ids=ids, max_seqlen=mx)
        forward = lambda comp, xi: comp._forward_thd(  # noqa: E731
            xi, torch.tensor([0, xi.shape[0]], dtype=torch.int32), max_seqlen_q=mx,
            compressed_group_ids=ids)[0]
    return mg, x, extra, forward


def _psp(cu, max_seqlen):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def _step_of(comp, x, forward):
    """(output, input gradient, {name: parameter gradient}) of one forward + backward, the
    incoming gradient random and the same for every call of a shape."""
    comp.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = forward(comp, xi)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out.detach(), xi.grad, {n: p.grad for n, p in comp.named_parameters()}


@pytest.mark.parametrize("projection", [False, True])
@pytest.mark.parametrize("path,ratio,head_dim,rope_dim,yarn,rotate", [
    ("thd", 4, 512, 64, None, False),
    ("thd", 4, 128, 64, (4.0, 64), True),
    ("thd", 128, 256, 64, (16.0, 256), False),
    ("thd", 128, 128, 0, None, False),
    ("sbhd", 4, 128, 64, None, True),
    ("sbhd", 128, 256, 64, None, False),
    ("grouped", 4, 128, 64, None, True),
    ("grouped", 128, 256, 64, (16.0, 256), False),
])
def test_the_fused_epilogue_on_megatrons_compressor(megatron_csa, fused_on_cpu, hadamard_standin,
                                                    path, ratio, head_dim, rope_dim, yarn, rotate,
                                                    projection):
    """install(epilogue=True) (and projection=True: one GEMM on the two linears' weights),
    the fused pooling standing in as the fp32 reference: the output and every gradient bit
    for bit what Megatron's projections (or that GEMM), that pooling and the epilogue
    composed by hand give (Megatron's norm weight and eps, its rotary table, its positions;
    capacity padding rows, halo and padding groups included); Megatron's norm and rotation
    (and with projection=True its linears) never called; and within a few bf16 ulps of
    Megatron's own epilogue (installed without it), which rounds after the norm and in every
    step of its bf16 rotary embedding."""
    mg, x, extra, forward = _epilogue_case(megatron_csa, path, ratio, head_dim, rope_dim, yarn,
                                           rotate)
    with megatron.installed():
        want = _step_of(mg, x, forward)
    megatron.clear_fallback_reasons()
    calls = []
    handles = [m.register_forward_hook(lambda m, *a: calls.append(type(m).__name__))
               for m in (mg.norm, mg.linear_wkv, mg.linear_wgate)]
    rotations = len(hadamard_standin)
    try:
        with megatron.installed(epilogue=True, projection=projection):
            got = _step_of(mg, x, forward)
    finally:
        for h in handles:
            h.remove()
    assert len(hadamard_standin) == rotations and "RMSNorm" not in calls, "Megatron's epilogue ran"
    assert len(calls) == (0 if projection else 2), calls
    assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    assert got[0].shape == want[0].shape

    xr = x.clone().requires_grad_(True)
    mg.zero_grad(set_to_none=True)
    out = epilogue_by_hand(mg, xr, path, "reference", total=got[0].shape[0], joint=projection,
                           **extra)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype))
    assert torch.equal(got[0], out.detach()), "output"
    assert torch.equal(got[1], xr.grad), "input gradient"
    for n, p in mg.named_parameters():
        assert torch.equal(got[2][n], p.grad), n

    # against Megatron's own epilogue: only its roundings apart (measured here at most 2 ulps
    # on the output, 4 on a gradient, and 0.6% of output elements over 1 ulp)
    ulps = {"output": bf16_ulps(got[0], want[0]), "input gradient": bf16_ulps(got[1], want[1])}
    for n in want[2]:
        ulps[n] = bf16_ulps(got[2][n], want[2][n])
    worst = {n: float(u.max()) for n, u in ulps.items()}
    assert worst["output"] <= 4 and all(w <= 8 for w in worst.values()), worst
    assert float((ulps["output"] > 1).float().mean()) <= 0.02, worst


@pytest.mark.parametrize("mutate,words", [
    (lambda mg: setattr(mg.config, "layernorm_zero_centered_gamma", True), "zero-centred gamma"),
    (lambda mg: setattr(mg.rotary_pos_emb, "seq_len_interpolation_factor", 2.0),
     "seq_len_interpolation_factor"),
    (lambda mg: setattr(mg.rotary_pos_emb, "rotary_interleaved", True), "rotary_interleaved"),
    (lambda mg: setattr(mg.norm, "eps", None), "eps"),
    (lambda mg: setattr(mg.rotary_pos_emb, "inv_freq", mg.rotary_pos_emb.inv_freq[:8]),
     "its tables have 16 channels"),
])
@pytest.mark.parametrize("path", ["thd", "sbhd", "grouped"])
def test_a_configuration_the_fused_epilogue_does_not_compute_keeps_megatrons(
        megatron_csa, fused_on_cpu, mutate, words, path):
    """Where Megatron's configuration is not what the fused epilogue computes, its own norm,
    RoPE and rotation run after the fused pooling (bit for bit install() without the
    epilogue), and fallback_reasons() says why."""
    mg, x, _, forward = _epilogue_case(megatron_csa, path, 4, 64, 32, None, False)
    mutate(mg)
    with megatron.installed():
        want = _step_of(mg, x, forward)
    launched = len(fused_on_cpu)
    with megatron.installed(epilogue=True):
        got = _step_of(mg, x, forward)
    assert len(fused_on_cpu) == launched + 1, "the pooling was not fused"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    assert any(r.startswith("epilogue: ") and words in r for r in megatron.fallback_reasons()), \
        megatron.fallback_reasons()


def test_install_epilogue_is_checked_and_restored(stub_csa):
    with pytest.raises(TypeError, match="epilogue: expected True or False"):
        megatron.install(epilogue="yes")
    megatron.install()
    with megatron.installed(epilogue=True):
        assert megatron.state.options().epilogue
    assert megatron.is_installed() and not megatron.state.options().epilogue
    megatron.uninstall()
    with megatron.installed(epilogue=True):
        pass
    assert not megatron.is_installed() and not megatron.state.options().epilogue


@pytest.mark.parametrize("path,ratio,head_dim,rope_dim,yarn,rotate", [
    ("thd", 4, 128, 64, (4.0, 64), True), ("thd", 128, 256, 64, None, False),
    ("sbhd", 4, 128, 64, None, False), ("sbhd", 128, 64, 0, None, False)])
def test_megatrons_whole_compressor_fused_is_the_packages_module(
        megatron_csa, fused_on_cpu, hadamard_standin, path, ratio, head_dim, rope_dim, yarn,
        rotate):
    """install(epilogue=True, projection=True): Megatron's Compressor then computes what the
    package's Compressor (default numerics, megatron_layout) computes with its parameters
    and its rotary frequencies: the output and every gradient bit for bit."""
    from csa_compressor import Compressor
    from csa_compressor.epilogue import YaRN, megatron_inv_freq, rope_inv_freq

    if rope_dim:  # the one difference the default makes: its frequencies are fp64 ones
        assert not torch.equal(rope_inv_freq(rope_dim, 10000.0),
                               megatron_inv_freq(rope_dim, 10000.0).double())
    mg, x, extra, forward = _epilogue_case(megatron_csa, path, ratio, head_dim, rope_dim, yarn,
                                           rotate)
    with megatron.installed(epilogue=True, projection=True):
        want = _step_of(mg, x, forward)
    assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    y = None if yarn is None else YaRN(factor=yarn[0], original_max_position_embeddings=yarn[1])
    ours = Compressor(128, head_dim, ratio, rope_dim=rope_dim, norm_eps=1e-5, rotate=rotate,
                      dtype=torch.bfloat16, pooling="reference", megatron_layout=True,
                      rope_theta=10000.0, rope_yarn=y, rope_frequencies="megatron")
    ours.load_megatron_state_dict(mg.state_dict())
    assert ours.one_projection and ours.numerics == "fp32"
    if path == "thd":
        got = _step_of(ours, x, lambda comp, xi: comp(xi, extra["cu"],
                                                       max_seqlen=extra["max_seqlen"])[0])
    else:
        got = _step_of(ours, x, lambda comp, xi: comp(xi))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        assert torch.equal(got[2][ok], want[2][mk]), mk


@pytest.mark.parametrize("path,ratio,head_dim,yarn,rotate", [
    ("thd", 4, 128, (4.0, 64), True), ("sbhd", 128, 256, None, False),
    ("grouped", 4, 128, None, True)])
def test_one_projection_reads_megatrons_ddp_buffer_in_place(
        megatron_csa, fused_on_cpu, hadamard_standin, monkeypatch, path, ratio, head_dim, yarn,
        rotate):
    """Under Megatron's own DistributedDataParallel (distributed optimizer) the two linears'
    weights are views of one parameter buffer, linear_wgate's right before linear_wkv's:
    install(epilogue=True, projection=True) runs the GEMM on them in place as ``[wgate;
    wkv]`` (no concatenation a step) and pools ``[score | kv]``; the output and every
    gradient (DDP's main_grad) are bit for bit the composition by hand on that layout,
    and the output and the weights' gradients those of the step outside DDP."""
    from csa_compressor import module
    from megatron_env import ddp_step, megatron_ddp

    mg, x, extra, forward = _epilogue_case(megatron_csa, path, ratio, head_dim, 64, yarn, rotate)
    with megatron.installed(epilogue=True, projection=True):
        apart = _step_of(mg, x, forward)  # separate weights: their concatenation
    ddp = megatron_ddp(mg)
    wkv, wgate = mg.linear_wkv.weight, mg.linear_wgate.weight
    assert module._adjacent(wgate, wkv) and not module._adjacent(wkv, wgate)
    concatenated = count_concatenations(monkeypatch)
    with megatron.installed(epilogue=True, projection=True):
        got = ddp_step(ddp, mg, x, forward)
    assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    assert not concatenated, "the weights were concatenated"

    g = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(1)).to(got[0].dtype)
    hand = ddp_step(ddp, mg, x, lambda comp, xi: epilogue_by_hand(
        comp, xi, path, "reference", total=got[0].shape[0], joint="score_first", **extra), g)
    assert torch.equal(got[0], hand[0]), "output"
    assert torch.equal(got[1], hand[1]), "input gradient"
    for n in got[2]:
        assert torch.equal(got[2][n], hand[2][n]), n
    assert torch.equal(got[0], apart[0])
    for n in ("linear_wkv.weight", "linear_wgate.weight", "ape", "norm.weight"):
        assert torch.equal(got[2][n], apart[2][n].float()), n


@pytest.mark.parametrize("path", ["thd", "sbhd", "grouped"])
def test_one_projection_gemm_with_megatrons_own_epilogue(megatron_csa, fused_on_cpu,
                                                         hadamard_standin, path):
    """install(projection=True) alone: Megatron's two linears never called, its norm, RoPE
    and rotation still run; the output and every gradient within the bf16 rounding of its
    two GEMMs' input gradients added in the dtype (installed without it)."""
    mg, x, _, forward = _epilogue_case(megatron_csa, path, 4, 128, 64, None, True)
    with megatron.installed():
        want = _step_of(mg, x, forward)
    calls = []
    handles = [m.register_forward_hook(lambda m, *a: calls.append(m))
               for m in (mg.norm, mg.linear_wkv, mg.linear_wgate)]
    rotations = len(hadamard_standin)
    try:
        with megatron.installed(projection=True):
            got = _step_of(mg, x, forward)
    finally:
        for h in handles:
            h.remove()
    assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    assert calls == [mg.norm] and len(hadamard_standin) == rotations + 1
    worst = {"output": float(bf16_ulps(got[0], want[0]).max()),
             "input gradient": float(bf16_ulps(got[1], want[1]).max())}
    worst.update({n: float(bf16_ulps(got[2][n], want[2][n]).max()) for n in want[2]})
    assert all(w <= 4 for w in worst.values()), worst
    assert not torch.equal(got[1], want[1])  # one GEMM's input gradient, not two added


@pytest.mark.parametrize("mutate,words", [
    (lambda mg: setattr(mg.config, "delay_wgrad_compute", True), "delay_wgrad_compute"),
    (lambda mg: setattr(mg.linear_wgate, "sequence_parallel", True),
     "linear_wgate: sequence_parallel"),
    (lambda mg: setattr(mg.linear_wkv, "bias", torch.nn.Parameter(
        torch.zeros(mg.linear_wkv.weight.shape[0], dtype=mg.linear_wkv.weight.dtype))),
     "linear_wkv: it has a bias"),
])
@pytest.mark.parametrize("path", ["thd", "sbhd", "grouped"])
def test_linears_one_gemm_does_not_compute_keep_megatrons(megatron_csa, fused_on_cpu, mutate,
                                                          words, path):
    """Where Megatron's linears do more than a plain GEMM, they run (bit for bit install()
    without projection=True), and fallback_reasons() says why."""
    mg, x, _, forward = _epilogue_case(megatron_csa, path, 4, 64, 32, None, False)
    mutate(mg)
    with megatron.installed():
        want = _step_of(mg, x, forward)
    megatron.clear_fallback_reasons()
    with megatron.installed(projection=True):
        got = _step_of(mg, x, forward)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    assert list(megatron.fallback_reasons()) == ["projection: " + words], \
        megatron.fallback_reasons()


@pytest.mark.parametrize("layout", ["thd", "sbhd"])
def test_the_packages_compressor_inside_megatrons_ddp_reads_its_weights_in_place(
        megatron_csa, monkeypatch, layout):
    """The package's Compressor wrapped in Megatron's DistributedDataParallel (distributed
    optimizer): its weights become views of DDP's buffer, wgate's right before wkv's. The
    module leaves them there (a later .to() does not move them out of the buffer), its one
    GEMM reads them in place (no concatenation) and pools ``[score | kv]``: the output and
    the parameters' gradients bit for bit those of the same module outside DDP, the input
    gradient within one bf16 ulp (its GEMM sums the same products in another order)."""
    import copy

    from csa_compressor import Compressor, module
    from megatron_env import inside_and_outside_ddp, megatron_ddp

    torch.manual_seed(3)
    ours = Compressor(128, 64, 4, rope_dim=32, rotate=True, dtype=torch.bfloat16,
                      pooling="reference", megatron_layout=True)
    with torch.no_grad():
        ours.norm_weight.add_(0.1 * torch.randn(64).bfloat16())
    apart = copy.deepcopy(ours)
    cfg = build_compressor(megatron_csa, hidden=128, head_dim=64, ratio=4, rope_dim=32).config
    ddp = megatron_ddp(ours, cfg)
    wkv, wgate = ours.wkv.weight, ours.wgate.weight
    assert module._adjacent(wgate, wkv) and not module._adjacent(wkv, wgate)
    where = (wkv.data_ptr(), wgate.data_ptr())
    ours.to("cpu")  # a move that changes nothing keeps DDP's views
    assert (wkv.data_ptr(), wgate.data_ptr()) == where

    concatenated = count_concatenations(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    if layout == "thd":
        cu = torch.tensor([0, 301, 301, 306, 700], dtype=torch.int32)
        x = torch.randn(700, 1, 128, generator=gen).bfloat16()
        forward = lambda comp, xi: comp(xi, cu, max_seqlen=394)[0]  # noqa: E731
    else:
        x = torch.randn(301, 3, 128, generator=gen).bfloat16()
        forward = lambda comp, xi: comp(xi)  # noqa: E731

    got, want = inside_and_outside_ddp(ddp, ours, apart, x, forward, gen)
    # outside DDP the copy's weights are separate: concatenated, once
    assert concatenated == [1], "the weights were concatenated inside DDP"
    assert torch.equal(got[0], want[0]), "output"
    for (n, _), a, b in zip(ours.named_parameters(), got[2:], want[2:]):
        assert torch.equal(a, b), n
    assert float(bf16_ulps(got[1], want[1]).max()) <= 1
