"""Megatron-LM's Compressor with the package's epilogue on the GPU: install(epilogue=True)
against Megatron's own epilogue, the whole Compressor fused against the package's module,
the one projection reading Megatron's DDP buffer in place, and the package's Compressor
inside Megatron's DDP."""

import pytest
import torch

from csa_compressor import megatron
from megatron_env import (bf16_ulps, build_compressor, count_concatenations, epilogue_by_hand,
                          thd_step)
from megatron_gpu_env import fresh_fallback_reasons  # noqa: F401  (the fixture)
from megatron_gpu_env import sbhd_step, ours_thd_step, path_case

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_fallback_reasons")]


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
    x, extra, forward = path_case(path, ratio, hidden)
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
        got = ours_thd_step(ours, x, cu, max(lens))
    else:
        x = torch.randn(4100, 2, hidden, device="cuda").to(torch.bfloat16)
        with megatron.installed(epilogue=True, projection=True):
            want = sbhd_step(mg, x)
        got = sbhd_step(ours, x)
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
    x, extra, forward = path_case(path, ratio, hidden)
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
