"""csa_compressor.megatron: the install, the hook's fallbacks and its wiring into
Megatron-LM's own Compressor (CPU). Megatron's module runs from its snapshot where one is
found (tests/megatron_env.py); those tests skip without it. On the GPU the fused kernels
answer the hook (tests/test_megatron_gpu.py)."""

import sys
import types

import pytest
import torch

from csa_compressor import megatron
from megatron_env import build_compressor, grouped_step, sbhd_step, thd_step


@pytest.fixture(autouse=True)
def _fresh_fallback_reasons():
    """Each test reads the reasons its own calls recorded."""
    megatron.clear_fallback_reasons()


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
    want = sbhd_step(comp, x)
    with megatron.installed():
        got = sbhd_step(comp, x)
        short = comp(torch.randn(ratio - 1, 3, 64))
    assert fused_on_cpu == [3 * (sq // ratio)], "the fused pooling was not called once"
    assert short[0] is None if isinstance(short, tuple) else short is None
    assert got[0].shape == (sq // ratio, 3, head_dim)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    _assert_parameter_grads_close(got[2], want[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratio,ids", [
    (4, [3, 4, 5, 0, 1, 2, 0, -1, -1]),    # a halo row, a continuation, a new sequence, padding
    (4, [0, 1, 2, 3, 0, 0, 1]),            # starts at a sequence start; a one-block sequence
    (128, [7, 8, 0, 1, -1]),
])
def test_megatrons_grouped_compressor_through_the_adapter(megatron_csa, fused_on_cpu, ratio, ids,
                                                          monkeypatch):
    """Megatron's context-parallel pre-grouped path installed, the fused pooling standing in
    as the fp32 reference: output and every gradient against Megatron's own eager region,
    row 0 excepted where it is an overlapping halo (Megatron fills its previous block from
    the buffer's last group, the adapter leaves it empty; downstream never reads it). The
    groups' offsets are built well formed, so the problem skips the device offsets guard."""
    from csa_compressor import ops

    built, inner = [], ops.fused_from_problem
    monkeypatch.setattr(ops, "fused_from_problem",
                        lambda p, finish=None: built.append(p.offsets_built) or inner(p, finish))
    comp = build_compressor(megatron_csa, hidden=64, head_dim=32, ratio=ratio, rope_dim=16)
    ids = torch.tensor(ids, dtype=torch.int32)
    x = torch.randn(ids.numel() * ratio, 1, 64, generator=torch.Generator().manual_seed(2))
    halo = int(ids[0]) != 0 and comp.overlap  # without overlap no row reads a previous block
    max_seqlen = (int(ids.max()) + 1) * ratio
    want = grouped_step(comp, x, ids, max_seqlen, halo)
    with megatron.installed():
        got = grouped_step(comp, x, ids, max_seqlen, halo)
    assert fused_on_cpu == [ids.numel()], "the fused pooling was not called once"
    assert built == [True]
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
        step = lambda: sbhd_step(comp, x)  # noqa: E731
    else:
        ids = torch.tensor([0, 1, 2, 0, 1, -1], dtype=torch.int32)
        x = torch.randn(ids.numel() * 4, 1, 64, generator=gen).to(torch.bfloat16)
        step = lambda: grouped_step(comp, x, ids, 12, False)  # noqa: E731
    want = step()
    with megatron.installed():
        got = step()
    assert fused_on_cpu, "the fused pooling was not called"
    assert len(hadamard_standin) == 2, "each step rotates once"
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    _assert_parameter_grads_close(got[2], want[2], **tol)
