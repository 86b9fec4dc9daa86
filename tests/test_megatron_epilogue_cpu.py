"""install(epilogue=True) and install(projection=True) (CPU): Megatron's norm, RoPE and
rotation as the fused epilogue, and its two projections as one GEMM, against Megatron-LM's
own Compressor and the package's module, inside and outside Megatron's DDP. Megatron's
module runs from its snapshot where one is found (tests/megatron_env.py); those tests skip
without it."""

import pytest
import torch

from csa_compressor import megatron
from megatron_env import bf16_ulps, build_compressor, count_concatenations, epilogue_by_hand


@pytest.fixture(autouse=True)
def _fresh_fallback_reasons():
    """Each test reads the reasons its own calls recorded."""
    megatron.clear_fallback_reasons()


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
