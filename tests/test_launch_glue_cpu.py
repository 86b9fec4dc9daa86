"""The host side of every launch, on the CPU: launch_forward / launch_backward with the
compile step replaced by a recorder, for each kernel family (short windows, the
large-pack backward, long windows), so the arguments the compiled functions receive are
checked without a GPU."""

import pytest
import torch
from csa_compressor import kernel_api
from csa_compressor.checks import poison_if_malformed

cutlass = pytest.importorskip("cutlass")

from csa_compressor.kernels import launch  # noqa: E402
from csa_compressor.kernels.compile import Compiled  # noqa: E402
from csa_compressor.kernels.pool_bwd import PoolBackward  # noqa: E402
from csa_compressor.kernels.pool_fwd import PoolForward  # noqa: E402
from csa_compressor.kernels.pool_long import LongPoolBackward, LongPoolForward  # noqa: E402
from csa_compressor.validation import validate  # noqa: E402
from packs import make_pack  # noqa: E402

CDT = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32}


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def fake_compile(monkeypatch):
    calls = {}

    def record(direction, dtype, ratio, coff, head_dim):
        long = ratio * coff > 16
        cdt = CDT[dtype] if direction not in ("dape", "dape_wide") else cutlass.Float32
        if direction == "fwd":
            k = LongPoolForward(cdt, ratio, coff, head_dim) if long else PoolForward(cdt, ratio, coff, head_dim)
        else:
            k = (LongPoolBackward(cdt, ratio, coff, head_dim) if long
                 else PoolBackward(cdt, ratio, coff, head_dim, large=direction == "bwd_large"))
        rec = calls.setdefault(direction, Recorder())
        dape = calls.setdefault("dape", Recorder())
        large = (record("bwd_large", dtype, ratio, coff, head_dim)
                 if direction == "bwd" and k.has_large_variant else None)
        return Compiled(k, rec, 80, k.grid_ctas_per_sm(80), dape=dape, large=large)

    def compiled_for(spec, device):
        return record(spec.direction, spec.dtype, spec.ratio, spec.coff, spec.head_dim)

    monkeypatch.setattr(launch, "compiled_for", compiled_for)
    monkeypatch.setattr(launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch, "_one_gpu", lambda: True)
    # the offsets' guard kernel as its torch ops (the same rule, checks.poison_if_malformed)
    monkeypatch.setattr(launch, "guarded_ape", lambda cu, cuc, ape, T, N, r, shape=None:
                        poison_if_malformed(ape if ape.numel() else torch.zeros(shape),
                                            cu, cuc, T, N, r))
    return calls


@pytest.mark.parametrize("lens,d,ratio,coff,dtype", [
    ([37, 0, 3, 64, 129], 128, 4, 2, torch.bfloat16),
    ([8192, 8192], 128, 4, 2, torch.bfloat16),  # large enough for the large-pack backward
    ([300, 0, 257], 512, 128, 1, torch.bfloat16),
    ([70, 33], 64, 16, 2, torch.float32),
])
def test_launches_pass_the_compiled_functions_their_arguments(fake_compile, lens, d, ratio, coff,
                                                               dtype):
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, extra_rows=2)
    p = validate(kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff)
    out = torch.empty(N, d, dtype=dtype)
    launch.launch_forward(p, out)
    (fwd_args,) = fake_compile["fwd"].calls
    assert torch.equal(fwd_args[2], ape)  # well-formed offsets: the guard's copy is ape
    assert fwd_args[5] is out and isinstance(fwd_args[6], int) and fwd_args[6] >= 1
    g = torch.randn(N, d).to(dtype)
    dkv, dsc, dape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    launch.launch_backward(p, g, dkv, dsc, dape)
    used = [k for k in ("bwd", "bwd_large") if k in fake_compile and fake_compile[k].calls]
    assert len(used) == 1, used  # one backward launched, the default or its large-pack variant
    which = used[0]
    (bwd_args,) = fake_compile[which].calls
    assert torch.equal(bwd_args[2], ape)
    rows_per_cta, row_ctas, zero_ctas = bwd_args[9:12]
    assert rows_per_cta * row_ctas >= N and zero_ctas >= 1
    work = bwd_args[8]
    assert work.shape == (row_ctas * ratio, coff * d) and work.dtype == torch.float32
    (dape_args,) = fake_compile["dape"].calls
    assert dape_args[1].shape == (1, ratio * coff * d)
    assert (which == "bwd_large") == (N >= 4096)


@pytest.mark.parametrize("break_it", ["decreasing", "first", "past_T", "other_ratio", "capacity",
                                      "capacity_zero"])
def test_malformed_offsets_reach_the_kernels_as_a_nan_ape(fake_compile, break_it):
    """The default path's guard: the kernels read a NaN APE (so every row and gradient is
    NaN) for each malformation check_offsets=True names; with no rows, NaN gradients."""
    from csa_compressor.layout import compressed_cu_seqlens

    kv, score, ape, cu, cuc, N = make_pack([37, 20, 64, 29], 128, 4, 2, dtype=torch.bfloat16)
    if break_it == "decreasing":
        cu = torch.tensor([0, 60, 37, 101, 150], dtype=torch.int32)
        cuc = compressed_cu_seqlens(cu.clamp(max=150), 4)
    elif break_it == "first":
        cu = cu + 5
        cuc = compressed_cu_seqlens(cu - 5, 4)
    elif break_it == "past_T":
        cu = cu.clone()
        cu[-1] += 4
        cuc = compressed_cu_seqlens(cu, 4)
    elif break_it == "other_ratio":
        cuc = compressed_cu_seqlens(cu, 8)
    elif break_it == "capacity":
        N = int(cuc[-1]) - 1
    else:
        N = 0
    p = validate(kv, score, ape, cu, cuc, N, ratio=4, coff=2, contents=False)
    g = torch.randn(N, 128).to(torch.bfloat16)
    dkv, dsc, dape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    launch.launch_backward(p, g, dkv, dsc, dape)
    if N == 0:
        assert all(bool(t.isnan().all()) for t in (dkv, dsc, dape))
        return
    launch.launch_forward(p, torch.empty(N, 128, dtype=torch.bfloat16))
    (fwd_args,) = fake_compile["fwd"].calls
    bwd = [c for k in ("bwd", "bwd_large") if k in fake_compile for c in fake_compile[k].calls]
    assert fwd_args[2].isnan().all() and bwd[0][2].isnan().all()


def test_a_kernels_check_runs_once_a_key_and_never_while_a_graph_captures(monkeypatch):
    """jit.checked_once, behind every small kernel that stands in for a torch op whose
    bits depend on torch's order or math library (row sums, cosines, column sums)."""
    from csa_compressor.kernels.jit import checked_once

    capturing, runs, table = [True], [], {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    def check(answer):
        return lambda: runs.append(answer) or answer

    assert checked_once(table, "a", check(True)) is False and runs == [] and table == {}
    capturing[0] = False
    assert checked_once(table, "a", check(None)) is False and table == {}  # no kernel now
    assert checked_once(table, "a", check(True)) is True
    assert checked_once(table, "b", check(False)) is False
    capturing[0] = True  # a kept answer holds inside a capture too, nothing reruns
    assert checked_once(table, "a", check(False)) is True and checked_once(table, "b", check(True)) is False
    assert runs == [None, True, False] and table == {"a": True, "b": False}


def test_the_eager_numerics_are_their_own_kernels_and_share_the_dape_sums():
    """numerics="eager" is a field of the compile key (another kernel, another disk-cache
    entry); the dape sums it brings are the fp32 kernels' (they add fp32 partials either
    way); an unknown numerics is refused by name."""
    import pytest

    from csa_compressor.kernels import disk_cache, plan

    fp32 = plan.spec("bwd", torch.bfloat16, 4, 2, 128)
    eager = plan.spec("bwd", torch.bfloat16, 4, 2, 128, numerics="eager")
    assert fp32 != eager and hash(fp32) != hash(eager) and "numerics='eager'" in str(eager)
    assert disk_cache.entry_name(fp32, "sm_90a") != disk_cache.entry_name(eager, "sm_90a")
    sums = [s for s in plan.family(eager) if s.direction.startswith("dape")]
    assert sums == [s for s in plan.family(fp32) if s.direction.startswith("dape")]
    assert all(s.numerics == "fp32" for s in sums)
    assert plan.spec("dape", torch.bfloat16, 4, 2, 128, numerics="eager").numerics == "fp32"
    with pytest.raises(ValueError, match="numerics"):
        plan.spec("fwd", torch.bfloat16, 4, 2, 128, numerics="bf16")


def test_the_kernel_level_api_launches_the_numerics_it_is_asked_for(fake_compile, monkeypatch):
    """pool_forward / pool_backward(numerics="eager") compile and launch the eager kernels
    (the spec's numerics), the default the fp32 ones; a bad value is refused by name."""
    from csa_compressor import validation

    specs = []
    record = launch.compiled_for
    monkeypatch.setattr(launch, "compiled_for", lambda spec, dev: specs.append(spec) or record(spec, dev))
    monkeypatch.setattr(kernel_api, "validate",
                        lambda *a, for_kernel=False, **k: validation.validate(*a, **k))
    kv, score, ape, cu, cuc, N = make_pack([37, 0, 64], 128, 4, 2, dtype=torch.bfloat16)
    out, g = torch.empty(N, 128, dtype=torch.bfloat16), torch.randn(N, 128).to(torch.bfloat16)
    grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    for numerics in ("eager", "fp32"):
        specs.clear()
        kernel_api.pool_forward(kv, score, ape, cu, cuc, out, ratio=4, coff=2, numerics=numerics)
        kernel_api.pool_backward(kv, score, ape, cu, cuc, g, *grads, ratio=4, coff=2, numerics=numerics)
        assert [s.direction for s in specs] == ["fwd", "bwd"]
        assert all(s.numerics == numerics for s in specs)
    with pytest.raises(ValueError, match="numerics"):
        kernel_api.pool_forward(kv, score, ape, cu, cuc, out, ratio=4, coff=2, numerics="bf16")


@pytest.mark.parametrize("lens,d,ratio,coff", [([37, 0, 64], 128, 2, 1), ([300, 257], 512, 128, 1),
                                               ([8192, 8192], 128, 4, 2)])
@pytest.mark.parametrize("malformed", [False, True])
def test_no_position_bias_launches_the_kernels_without_an_ape(fake_compile, monkeypatch, lens, d,
                                                             ratio, coff, malformed):
    """ape=None: the specs say no ape, the kernels read the guard's flag (zeros, NaN for
    malformed offsets) where the APE would be, and the backward launches no dape sum."""
    specs = []
    record = launch.compiled_for
    monkeypatch.setattr(launch, "compiled_for", lambda spec, dev: specs.append(spec) or record(spec, dev))
    kv, score, _, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=torch.bfloat16)
    if malformed:
        cu = cu.clone()
        cu[0] = 1
    p = validate(kv, score, None, cu, cuc, N, ratio=ratio, coff=coff, contents=False)
    assert not p.has_ape and p.ape.numel() == 0
    launch.launch_forward(p, torch.empty(N, d, dtype=torch.bfloat16))
    dape = torch.empty_like(p.ape)
    launch.launch_backward(p, torch.randn(N, d).to(torch.bfloat16), torch.empty_like(kv),
                           torch.empty_like(score), dape)
    assert [s.ape for s in specs] == [False, False]
    bwd = [c for k in ("bwd", "bwd_large") if k in fake_compile for c in fake_compile[k].calls]
    for flag in (fake_compile["fwd"].calls[0][2], bwd[0][2]):
        assert flag.shape == (ratio, coff * d)
        assert flag.isnan().all() if malformed else (flag == 0).all()
    assert "dape" not in fake_compile or not fake_compile["dape"].calls
    assert dape.numel() == 0


def test_no_position_bias_is_its_own_kernel():
    from csa_compressor.kernels import disk_cache, plan

    s = plan.spec("bwd", torch.float32, 2, 1, 512)
    none = plan.spec("bwd", torch.float32, 2, 1, 512, ape=False)
    assert s != none and "no ape" in str(none)
    assert disk_cache.entry_name(s, "sm_90a") != disk_cache.entry_name(none, "sm_90a")
    assert all(f.ape for f in plan.family(none)[1:3])  # the dape sums are the shared ones


def test_an_fp32_backward_widens_its_vectors_only_where_the_ctas_an_sm_stay():
    """BWD_FP32_VEC_BYTES: fp32 takes the wider vector where the design keeps its CTAs an
    SM (d512 ratio 2 coff 1), not where the doubled staging would cost CTAs (d128 ratio 4
    coff 2: 3 -> 1) or where it fits no CTA; bf16 never changes."""
    from csa_compressor.kernels import tuning

    t = tuning.replace(tuning.current(), BWD_FP32_VEC_BYTES=8)
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    assert PoolBackward(f32, 2, 1, 512, tuning=t).vec == 2
    narrow = PoolBackward(f32, 4, 2, 128, tuning=t)
    assert narrow.vec == 1 and narrow.target_ctas_per_sm == PoolBackward(f32, 4, 2, 128).target_ctas_per_sm
    assert PoolBackward(bf16, 2, 1, 512, tuning=t).vec == PoolBackward(bf16, 2, 1, 512).vec
    # nor where the wider staging fits no CTA (d64 ratio 8 coff 2 failed to launch)
    assert PoolBackward(f32, 8, 2, 64, tuning=t).vec == 1
    four = tuning.replace(tuning.current(), BWD_FP32_VEC_BYTES=4)
    assert PoolBackward(f32, 2, 1, 512, tuning=four).vec == 1
    for r, c, d in ((8, 2, 64), (4, 2, 512), (2, 1, 512), (16, 1, 64), (4, 2, 128)):
        for large in (False, True):
            k = PoolBackward(f32, r, c, d, tuning=t, large=large and PoolBackward(
                f32, r, c, d, tuning=t).has_large_variant)
            assert k.ctas_fitting_smem() >= 1, (r, c, d, large, k.smem_bytes)


def test_offsets_the_package_built_skip_the_device_check(fake_compile, monkeypatch):
    """Problem.offsets_built (streaming's packs, built from lengths checked on the host):
    the kernels read the APE itself (or zeros without one), no guard runs; a caller's
    offsets still go through the guard."""
    guarded = []
    guard = launch.guarded_ape
    monkeypatch.setattr(launch, "guarded_ape", lambda *a, **k: guarded.append(1) or guard(*a, **k))
    kv, score, ape, cu, cuc, N = make_pack([37, 20, 64], 128, 4, 2, dtype=torch.bfloat16)
    for built in (False, True):
        p = validate(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
        p.offsets_built = built
        launch.launch_forward(p, torch.empty(N, 128, dtype=torch.bfloat16))
        assert (fake_compile["fwd"].calls[-1][2] is ape) == built
        assert len(guarded) == 1  # the caller's offsets only
    p = validate(kv, score, None, cu, cuc, N, ratio=4, coff=2)
    p.offsets_built = True
    launch.launch_forward(p, torch.empty(N, 128, dtype=torch.bfloat16))
    launch.launch_backward(p, torch.randn(N, 128).to(torch.bfloat16), torch.empty_like(kv),
                           torch.empty_like(score), p.ape)
    flag = fake_compile["fwd"].calls[-1][2]
    assert flag.shape == (4, 256) and (flag == 0).all() and len(guarded) == 1
    bwd = [c for k in ("bwd", "bwd_large") if k in fake_compile for c in fake_compile[k].calls]
    assert bwd[-1][8].shape == (1, 256)  # no dape partials: a one-row workspace stands in



@pytest.mark.parametrize("case", ["out_kv", "grad_kv_kv", "grad_kv_grad_score", "grad_ape_ape",
                                  "workspace_grad_out", "grad_score_cu_seqlens"])
def test_the_kernel_level_api_refuses_an_output_that_shares_memory(fake_compile, monkeypatch, case):
    """An output buffer that overlaps an input or another output is refused by name before any
    launch (the kernels would read what they write); outputs in one buffer's disjoint parts
    pass, and so do inputs that share memory (kv given as score too)."""
    from csa_compressor import validation

    monkeypatch.setattr(kernel_api, "validate",
                        lambda *a, for_kernel=False, **k: validation.validate(*a, **k))
    d, ratio, coff = 128, 4, 2
    kv, score, ape, cu, cuc, N = make_pack([37, 0, 64], d, ratio, coff, dtype=torch.bfloat16)
    g, out = torch.randn(N, d).to(torch.bfloat16), torch.empty(N, d, dtype=torch.bfloat16)
    both = torch.empty((2,) + tuple(kv.shape), dtype=kv.dtype)
    grads, workspace = [both[0], both[1], torch.empty_like(ape)], None
    kernel_api.pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)
    kernel_api.pool_backward(kv, score, ape, cu, cuc, g, *grads, ratio=ratio, coff=coff)
    # inputs may share memory: kv given as score too
    kernel_api.pool_backward(kv, kv, ape, cu, cuc, g, *grads, ratio=ratio, coff=coff)
    launched = sum(len(r.calls) for r in fake_compile.values())
    assert launched >= 3
    if case == "out_kv":
        out = kv.view(-1)[:N * d].view(N, d)
    elif case == "grad_kv_kv":
        grads[0] = kv
    elif case == "grad_kv_grad_score":
        grads[1] = grads[0]
    elif case == "grad_ape_ape":
        grads[2] = ape
    elif case == "workspace_grad_out":
        workspace = torch.empty(N * d, dtype=torch.float32)
        g = workspace.view(torch.bfloat16)[:N * d].view(N, d).copy_(g)
    else:  # the offsets inside grad_score's buffer
        grads[1] = torch.empty_like(score)
        cu = grads[1].view(-1).view(torch.int32)[:cu.numel()].copy_(cu)
    name, other = {"out_kv": ("out", "kv"), "grad_kv_kv": ("grad_kv", "kv"),
                   "grad_kv_grad_score": ("grad_kv", "grad_score"),
                   "grad_ape_ape": ("grad_ape", "ape"), "workspace_grad_out": ("workspace", "grad_out"),
                   "grad_score_cu_seqlens": ("grad_score", "cu_seqlens")}[case]
    with pytest.raises(ValueError, match=f"^{name}: shares memory with {other} "):
        if case == "out_kv":
            kernel_api.pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)
        else:
            kernel_api.pool_backward(kv, score, ape, cu, cuc, g, *grads, ratio=ratio, coff=coff,
                                     workspace=workspace)
    assert sum(len(r.calls) for r in fake_compile.values()) == launched
