"""Megatron-LM's own Compressor with csa_compressor.megatron installed, on the GPU: the
fused kernels answer its THD hook, and its output and gradients stay within bf16
rounding of its eager region (which rounds the weights and products to bf16; the fused
pooling does not)."""

import pytest
import torch
from csa_compressor import pooling

import csa_compressor as C
from csa_compressor import megatron
from megatron_env import (bf16_ulps, build_compressor, count_concatenations, epilogue_by_hand,
                          thd_step)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_fallback_reasons():
    """Each test reads the reasons its own calls recorded."""
    megatron.clear_fallback_reasons()


def _installed_step(step, monkeypatch):
    """``step()`` with the adapter installed, and the row counts the fused pooling ran on
    (an SBHD launch's: every sequence's)."""
    from csa_compressor import dispatch

    fused, launched = dispatch.fused_from_validated, []
    monkeypatch.setattr(dispatch, "fused_from_validated",
                        lambda p, *a, **k: launched.append(p.total_comp * max(p.batch, 1))
                        or fused(p, *a, **k))
    with megatron.installed():
        return step(), launched


def _sbhd_step(comp, x):
    """One SBHD forward + backward of ``comp``: (output, input gradient, {parameter name:
    gradient}), in fp32."""
    comp.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = comp(xi)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    out.backward(g.to(out.dtype))
    return out.float(), xi.grad.float(), {n: p.grad.float() for n, p in comp.named_parameters()}


def _ours_thd_step(ours, x, cu, max_seqlen):
    """One THD forward + backward of the package's Compressor with thd_step's incoming
    gradient: (output, input gradient, {parameter name: gradient}), in fp32."""
    xs = x.clone().requires_grad_(True)
    out, cuc = ours(xs, cu, max_seqlen=max_seqlen)
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    g = g.to(out.dtype)
    g[int(cuc[-1]):] = 0
    out.backward(g)
    return (out.detach().float(), xs.grad.float(),
            {n: p.grad.float() for n, p in ours.named_parameters()})


def _path_case(path, ratio, hidden):
    """The input of one of Megatron's Compressor paths at the GPU tests' scale (THD 8192 +
    8191 + 5000 + 3 + 0 tokens with capacity padding, SBHD 2 x 4100, pre-grouped 8192
    tokens as groups with a halo, continuations and padding), epilogue_by_hand's extra
    arguments for it, and its forward ``(module, x) -> output``."""
    gen = torch.Generator("cuda").manual_seed(2)
    if path == "thd":
        lens = [8192, 8191, 5000, 3, 0]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                          device="cuda")
        x = torch.randn(int(cu[-1]), 1, hidden, device="cuda", generator=gen).to(torch.bfloat16)

        def forward(comp, xi):
            from megatron.core.packed_seq_params import PackedSeqParams

            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                  max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
            return comp(xi, psp)[0]
        return x, dict(cu=cu, max_seqlen=max(lens)), forward
    if path == "sbhd":
        x = torch.randn(4100, 2, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        return x, {}, lambda comp, xi: comp(xi)
    n = 8192 // ratio
    ids = torch.cat([torch.arange(5, n // 2), torch.arange(n // 2 - 7),
                     torch.full((7,), -1)]).to(device="cuda", dtype=torch.int32)
    x = torch.randn(ids.numel() * ratio, 1, hidden, device="cuda",
                    generator=gen).to(torch.bfloat16)

    def forward(comp, xi):
        cu1 = torch.tensor([0, xi.shape[0]], dtype=torch.int32, device="cuda")
        return comp._forward_thd(xi, cu1, max_seqlen_q=8192, compressed_group_ids=ids)[0]
    return x, dict(ids=ids, max_seqlen=8192), forward


def _hooked_step(megatron_csa, step):
    """``step()`` with the adapter installed, and what each call of Megatron's THD hook
    gave: True where the fused pooling answered it."""
    calls = []
    hook = megatron.maybe_compress_thd_fused

    def counted(*a, **k):
        out = hook(*a, **k)
        calls.append(out is not None)
        return out

    with megatron.installed():
        megatron_csa.maybe_compress_thd_fused = counted
        return step(), calls


@pytest.mark.parametrize("ratio,head_dim", [(4, 128), (4, 512), (128, 512), (128, 128)])
def test_megatrons_compressor_on_the_fused_kernels(megatron_csa, ratio, head_dim):
    comp = build_compressor(megatron_csa, hidden=256, head_dim=head_dim, ratio=ratio, rope_dim=64,
                            dtype=torch.bfloat16).cuda()
    lens = [37, 0, 3, 640, 129, 1] if ratio == 4 else [300, 0, 127, 1040]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = torch.randn(int(cu[-1]) + 5, 1, 256, device="cuda").to(torch.bfloat16)
    want = thd_step(comp, x, cu, max(lens))
    got, calls = _hooked_step(megatron_csa, lambda: thd_step(comp, x, cu, max(lens)))
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
    want = _sbhd_step(comp, x)
    got, launched = _installed_step(lambda: _sbhd_step(comp, x), monkeypatch)
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
    got, launched = _installed_step(step, monkeypatch)
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
    got, launched = _installed_step(step, monkeypatch)
    assert launched == [rows], megatron.fallback_reasons()
    assert len(hadamard_standin) == 2
    if path == "thd":
        got = [got[0], got[1]] + list(got[2].values())
        want = [want[0], want[1]] + list(want[2].values())
    for a, b in zip(got, want):
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=3e-2)


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
    want, calls = _hooked_step(megatron_csa, lambda: thd_step(mg, x, cu, max(lens)))
    assert calls == [True], megatron.fallback_reasons()
    got = _ours_thd_step(ours, x, cu, max(lens))
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
        want = _sbhd_step(mg, x)
        step = lambda comp: _sbhd_step(comp, x)  # noqa: E731
    else:
        lens = [8192, 8191, 5000, 3, 0]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                          device="cuda")
        x = torch.randn(int(cu[-1]), 1, hidden, device="cuda").to(torch.bfloat16)
        want = thd_step(mg, x, cu, max(lens))
        step = lambda comp: _ours_thd_step(comp, x, cu, max(lens))  # noqa: E731
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
    x, extra, _ = _path_case(path, ratio, hidden)
    if path == "sbhd":
        step = lambda: _sbhd_step(mg, x)  # noqa: E731
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
    want, launched = _installed_step(lambda: _sbhd_step(mg, x), monkeypatch)
    assert launched == [2 * (4100 // ratio)], megatron.fallback_reasons()
    got = _sbhd_step(ours, x)
    differ = {"output": int((got[0] != want[0]).sum()), "input gradient": int((got[1] != want[1]).sum())}
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        differ[mk] = int((got[2][ok] != want[2][mk]).sum())
    assert not any(differ.values()), f"elements that differ: {differ}"


@pytest.mark.parametrize("projection,norm_weight", [
    (False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float32)])
@pytest.mark.parametrize("path,ratio,head_dim,yarn,rotate", [
    ("thd", 4, 512, None, False), ("thd", 4, 128, (4.0, 4096), True),
    ("thd", 128, 512, (16.0, 4096), False), ("sbhd", 4, 128, None, True),
    ("sbhd", 128, 512, None, False), ("grouped", 4, 512, None, False),
    ("grouped", 128, 128, None, True)])
def test_the_fused_epilogue_on_megatrons_compressor_on_the_fused_kernels(
        megatron_csa, hadamard_standin, monkeypatch, path, ratio, head_dim, yarn, rotate,
        projection, norm_weight):
    """install(epilogue=True) (and projection=True: one GEMM on the two linears' weights) on
    the H200 (hidden 1024, bf16; THD 8192 + 8191 + 5000 + 3 + 0 tokens with capacity
    padding, SBHD 2 x 4100, pre-grouped 8192 tokens as groups with a halo, continuations and
    padding; the norm weight in bf16 as Float16Module leaves it, or in fp32 as Megatron
    builds it): the epilogue's row kernel runs both directions, and the output and every
    gradient are bit for bit Megatron's projections (or that GEMM) + the fused pooling op +
    the epilogue composed of torch ops (Megatron's norm weight, eps, rotary table and
    positions); Megatron's rotation never called; within a few bf16 ulps of Megatron's own
    epilogue after the same pooling."""
    from csa_compressor import fused_epilogue
    from csa_compressor.kernels import epilogue_rows, launch
    from csa_compressor.kernels.tuning import current

    hidden = 1024
    mg = build_compressor(megatron_csa, hidden=hidden, head_dim=head_dim, ratio=ratio, rope_dim=64,
                          rotate=rotate, dtype=torch.bfloat16, yarn=None if yarn is None else {
                              "scaling_factor": yarn[0],
                              "original_max_position_embeddings": yarn[1]}).cuda()
    with torch.no_grad():  # not all ones
        mg.norm.weight.data = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(norm_weight)
    x, extra, forward = _path_case(path, ratio, hidden)
    g = None

    def step():
        nonlocal g
        mg.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = forward(mg, xi)
        if g is None:
            g = torch.randn(out.shape, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1)).to(out.dtype)
            if path == "grouped" and ratio == 4:
                g[0] = 0  # the halo row: not consumed downstream
        out.backward(g)
        return [out.detach(), xi.grad] + [p.grad for _, p in mg.named_parameters()]

    names = ["output", "input gradient"] + [n for n, _ in mg.named_parameters()]
    with megatron.installed():
        want = step()
    megatron.clear_fallback_reasons()
    rotations = len(hadamard_standin)
    launched, run = [], epilogue_rows.run
    monkeypatch.setattr(epilogue_rows, "run", lambda bwd, *a, **k: launched.append(
        (bwd, a[0].shape[0])) or run(bwd, *a, **k))
    pooled_with, launch_forward = [], launch.launch_forward
    monkeypatch.setattr(launch, "launch_forward", lambda p, out, epilogue=None, extra=(): (
        pooled_with.append(epilogue is not None) or launch_forward(p, out, epilogue, extra)))
    with megatron.installed(epilogue=True, projection=projection):
        got = step()
    monkeypatch.setattr(epilogue_rows, "run", run)
    monkeypatch.setattr(launch, "launch_forward", launch_forward)
    assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    assert len(hadamard_standin) == rotations, "Megatron's rotation ran"
    rows = got[0].numel() // head_dim  # the step's launches, not a once-only probe's
    assert (True, rows) in launched, (rows, launched)
    # The one-GEMM THD path and the SBHD path hand the epilogue to the pooling op, whose
    # forward runs inside the pooling kernel where INSIDE takes it; the others run the
    # row kernel after the pooling.
    handed = path == "sbhd" or (path == "thd" and projection)
    coff = mg.ape.shape[1] // head_dim  # Megatron's ape: (ratio, coff * head_dim)
    long = current().long_window(ratio * coff)
    default = fused_epilogue.DEFAULT_INSIDE
    inside = handed and "fwd" in (default.long if long else default.short)
    assert (True in pooled_with) is inside, (path, projection, pooled_with)
    assert ((False, rows) in launched) is not inside, (rows, launched)

    xr = x.clone().requires_grad_(True)
    mg.zero_grad(set_to_none=True)
    out = epilogue_by_hand(mg, xr, path, "fused", total=got[0].shape[0], joint=projection,
                           **extra)
    out.backward(g)
    hand = [out.detach(), xr.grad] + [p.grad for _, p in mg.named_parameters()]
    differ = {n: int((a != b).sum()) for n, a, b in zip(names, got, hand)}
    assert not any(differ.values()), f"elements that differ from the composition: {differ}"

    worst = {n: float(bf16_ulps(a, b).max()) for n, a, b in zip(names, got, want)}
    over1 = float((bf16_ulps(got[0], want[0]) > 1).float().mean())
    print(f"\n{path} ratio {ratio} d{head_dim} projection={projection}: max bf16 ulps against Megatron's epilogue "
          f"{ {n: round(w, 2) for n, w in worst.items()} }, output elements > 1 ulp {over1:.4%}")
    assert worst["output"] <= 4 and all(w <= 8 for w in worst.values()) and over1 <= 0.02, \
        (worst, over1)


@pytest.mark.parametrize("path,ratio,head_dim,rope_dim,yarn,rotate", [
    ("thd", 4, 32, 8, None, False), ("thd", 4, 128, 64, None, False),
    ("thd", 4, 128, 64, (4.0, 4096), True), ("thd", 4, 512, 64, None, False),
    ("thd", 128, 128, 64, None, True), ("thd", 128, 512, 0, None, False),
    ("sbhd", 4, 256, 32, None, True), ("sbhd", 128, 512, 64, None, False)])
def test_megatrons_whole_compressor_fused_is_the_packages_module_on_the_fused_kernels(
        megatron_csa, path, ratio, head_dim, rope_dim, yarn, rotate):
    """install(epilogue=True, projection=True) on the H200 (hidden 1024, bf16; THD 8192 +
    8191 + 5000 + 3 + 0 tokens, SBHD 2 x 4100): Megatron's Compressor computes what the
    package's Compressor (default numerics, pooling="fused", Megatron's parameters,
    rope_frequencies="megatron") computes, the output and every gradient bit for bit."""
    from csa_compressor import Compressor
    from csa_compressor.epilogue import YaRN

    hidden = 1024
    y = None if yarn is None else {"scaling_factor": yarn[0],
                                   "original_max_position_embeddings": yarn[1]}
    mg = build_compressor(megatron_csa, hidden=hidden, head_dim=head_dim, ratio=ratio,
                          rope_dim=rope_dim, rotate=rotate, dtype=torch.bfloat16, yarn=y).cuda()
    with torch.no_grad():
        mg.norm.weight.data = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(torch.bfloat16)
    ours = Compressor(hidden, head_dim, ratio, rope_dim=rope_dim, norm_eps=1e-5, rotate=rotate,
                      dtype=torch.bfloat16, device="cuda", pooling="fused", megatron_layout=True,
                      rope_theta=10000.0, rope_frequencies="megatron",
                      rope_yarn=None if yarn is None else YaRN(
                          factor=yarn[0], original_max_position_embeddings=yarn[1]))
    ours.load_megatron_state_dict(mg.state_dict())
    if path == "thd":
        lens = [8192, 8191, 5000, 3, 0]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                          device="cuda")
        x = torch.randn(int(cu[-1]), 1, hidden, device="cuda").to(torch.bfloat16)
        with megatron.installed(epilogue=True, projection=True):
            want = thd_step(mg, x, cu, max(lens))
        got = _ours_thd_step(ours, x, cu, max(lens))
    else:
        x = torch.randn(4100, 2, hidden, device="cuda").to(torch.bfloat16)
        with megatron.installed(epilogue=True, projection=True):
            want = _sbhd_step(mg, x)
        got = _sbhd_step(ours, x)
    assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    differ = {"output": int((got[0] != want[0]).sum()), "input gradient": int((got[1] != want[1]).sum())}
    for mk, ok in Compressor.MEGATRON_KEYS.items():
        differ[mk] = int((got[2][ok] != want[2][mk]).sum())
    assert not any(differ.values()), f"elements that differ: {differ}"


@pytest.mark.parametrize("path,ratio,head_dim,rotate", [
    ("thd", 4, 512, False), ("sbhd", 4, 128, True), ("grouped", 128, 512, False)])
def test_one_projection_reads_megatrons_ddp_buffer_in_place_on_the_fused_kernels(
        megatron_csa, hadamard_standin, monkeypatch, path, ratio, head_dim, rotate):
    """Under Megatron's own DistributedDataParallel (distributed optimizer; hidden 1024,
    bf16, THD 8192 + 8191 + 5000 + 3 + 0 tokens, SBHD 2 x 4100, 64 pre-grouped groups):
    linear_wgate's weight lies right before linear_wkv's in its parameter buffer, and
    install(epilogue=True, projection=True) reads them in place as one GEMM (no
    concatenation), the fused kernels pooling ``[score | kv]``: the output and every
    gradient (main_grad) bit for bit the composition by hand on that layout, with the
    package's packed op (score_first)."""
    from csa_compressor import module
    from megatron_env import ddp_step, megatron_ddp

    hidden = 1024
    mg = build_compressor(megatron_csa, hidden=hidden, head_dim=head_dim, ratio=ratio, rope_dim=64,
                          rotate=rotate, dtype=torch.bfloat16).cuda()
    ddp = megatron_ddp(mg)
    assert module._adjacent(mg.linear_wgate.weight, mg.linear_wkv.weight)
    x, extra, forward = _path_case(path, ratio, hidden)
    concatenated = count_concatenations(monkeypatch)
    with megatron.installed(epilogue=True, projection=True):
        got = ddp_step(ddp, mg, x, forward)
    assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    assert not concatenated, "the weights were concatenated"
    g = torch.randn(got[0].shape, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(1)).to(got[0].dtype)
    hand = ddp_step(ddp, mg, x, lambda comp, xi: epilogue_by_hand(
        comp, xi, path, "fused", total=got[0].shape[0], joint="score_first", **extra), g)
    names = ["output", "input gradient"] + list(got[2])
    differ = {n: int((a != b).sum()) for n, a, b in zip(
        names, [got[0], got[1], *got[2].values()], [hand[0], hand[1], *hand[2].values()])}
    assert not any(differ.values()), f"elements that differ from the composition: {differ}"


@pytest.mark.parametrize("layout", ["thd", "sbhd"])
def test_the_packages_compressor_inside_megatrons_ddp_on_the_fused_kernels(
        megatron_csa, monkeypatch, layout):
    """The package's Compressor (pooling="fused", the fused epilogue; hidden 1024, d512
    ratio 4) wrapped in Megatron's DistributedDataParallel (distributed optimizer): its one
    GEMM reads DDP's buffer in place as ``[wgate; wkv]`` (no concatenation) and the fused
    kernels pool ``[score | kv]``: the output and the parameters' gradients bit for bit
    those of the same module outside DDP, the input gradient within one bf16 ulp."""
    import copy

    from csa_compressor import Compressor, module
    from megatron_env import inside_and_outside_ddp, megatron_ddp

    torch.manual_seed(3)
    ours = Compressor(1024, 512, 4, rotate=False, dtype=torch.bfloat16, device="cuda",
                      pooling="fused", megatron_layout=True)
    apart = copy.deepcopy(ours)
    cfg = build_compressor(megatron_csa, hidden=1024, head_dim=512, ratio=4, rope_dim=64).config
    ddp = megatron_ddp(ours, cfg)
    assert module._adjacent(ours.wgate.weight, ours.wkv.weight)
    concatenated = count_concatenations(monkeypatch)
    gen = torch.Generator("cuda").manual_seed(4)
    if layout == "thd":
        cu = torch.tensor([0, 8192, 8192, 8195, 16000], dtype=torch.int32, device="cuda")
        x = torch.randn(16000, 1, 1024, device="cuda", generator=gen).bfloat16()
        forward = lambda comp, xi: comp(xi, cu, max_seqlen=8192)[0]  # noqa: E731
    else:
        x = torch.randn(4100, 2, 1024, device="cuda", generator=gen).bfloat16()
        forward = lambda comp, xi: comp(xi)  # noqa: E731
    got, want = inside_and_outside_ddp(ddp, ours, apart, x, forward, gen)
    assert concatenated == [1], "the weights were concatenated inside DDP"
    differ = {n: int((a != b).sum()) for (n, _), a, b in zip(
        [("output", 0)] + list(ours.named_parameters()), [got[0]] + got[2:], [want[0]] + want[2:])}
    assert not any(differ.values()), f"elements that differ outside DDP: {differ}"
    assert float(bf16_ulps(got[1], want[1]).max()) <= 1
