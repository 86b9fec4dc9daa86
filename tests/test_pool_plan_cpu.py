"""kernel_api.PoolPlan without a GPU: the offsets and sizes checked when the plan is made,
and its runs driven on CPU tensors with the compiled kernels stood in
(kernels.compile.stand_in): what each launch receives, and what a run refuses."""

import pytest
import torch

from csa_compressor import pool_plan
from csa_compressor.kernel_api import PoolPlan

KW = dict(ratio=4, coff=2, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("cu,kw,err,match", [
    ([0, 8, 4], {}, ValueError, r"cu_seqlens: expected non-decreasing offsets, got cu_seqlens\[1\]"),
    ([1, 8], {}, ValueError, r"cu_seqlens: expected cu_seqlens\[0\] == 0"),
    ([0, 8], {"num_tokens": 7}, ValueError, "cu_seqlens: the last offset 8 is past the 7 tokens"),
    ([0, 8], {"total_comp": 1}, ValueError, r"total_comp: expected an int in \[2|total_comp: expected an int >= 2"),
    ([0], {}, ValueError, r"cu_seqlens: expected B\+1 >= 2 offsets"),
    ([[0, 8]], {}, TypeError, "cu_seqlens: expected a 1-D int tensor or a list of ints"),
    ([0, True], {}, TypeError, "cu_seqlens: expected a 1-D int tensor or a list of ints"),
    (torch.tensor([0.0, 8.0]), {}, TypeError, "cu_seqlens: expected int32"),
    (torch.zeros(2, 2, dtype=torch.int32), {}, ValueError, r"cu_seqlens: expected B\+1 >= 2"),
    ([0, 2**30], {}, ValueError, "num_tokens, total_comp: T\\*coff\\*d"),
    ([0, 8], {"ape": 1}, TypeError, "ape: expected True or False"),
    ([0, 8], {"numerics": "bf16"}, ValueError, "numerics: expected one of"),
    ([0, 8], {"tuning": {}}, TypeError, "tuning: expected None or a kernels.tuning.Tuning"),
    ([0, 8], {"dtype": torch.int8}, TypeError, "dtype: expected torch.bfloat16"),
    ([0, 8], {"coff": 3}, ValueError, "coff: expected 1 or 2"),
])
def test_a_plan_refuses_bad_offsets_and_sizes(cu, kw, err, match):
    with pytest.raises(err, match=match):
        PoolPlan(cu, **{**KW, **kw})


cutlass = pytest.importorskip("cutlass")

from csa_compressor.kernels import compile as cc, plan as kplan  # noqa: E402


@pytest.fixture
def cpu_plan(monkeypatch):
    """(make a plan on the CPU, the launches its runs made): the device check passed
    over and every compiled kernel stood in by a recorder."""
    calls = []
    monkeypatch.setattr(pool_plan, "check_cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(pool_plan, "sm_count", lambda index: 132)
    monkeypatch.setattr("csa_compressor.kernels.launch.sm_count", lambda index: 132)

    def make(cu, row_stride=0, **kw):
        kw = {**KW, **kw}
        with_ape = kw.get("ape", True)
        for direction in ("fwd", "bwd"):
            spec = kplan.spec(direction, kw["dtype"], kw["ratio"], kw["coff"], kw["head_dim"],
                              row_stride=row_stride, ape=with_ape)
            stack.enter_context(cc.stand_in(spec, torch.device("cpu"),
                                            lambda *a: calls.append(a)))
        return PoolPlan(cu, **kw)

    from contextlib import ExitStack
    with ExitStack() as stack:
        yield make, calls


def _tensors(T=300, N=75, W=256, d=128, ratio=4):
    kv, score = torch.randn(T, W).bfloat16(), torch.randn(T, W).bfloat16()
    return kv, score, torch.randn(ratio, W), torch.empty(N, d, dtype=torch.bfloat16)


def test_a_run_launches_on_the_plans_offsets(cpu_plan):
    make, calls = cpu_plan
    plan = make([0, 100, 100, 300])
    assert (plan.num_tokens, plan.total_comp) == (300, 75)
    kv, score, ape, out = _tensors()
    assert plan.forward(kv, score, ape, out) is out
    (args,) = calls
    assert args[0] is kv and args[1] is score and args[2] is ape and args[5] is out
    assert args[3].tolist() == [0, 100, 100, 300] and args[3].dtype == torch.int32
    assert args[4].tolist() == [0, 25, 25, 75] and isinstance(args[6], int) and args[6] >= 1
    calls.clear()
    g = torch.randn(75, 128).bfloat16()
    grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    assert plan.backward(kv, score, ape, g, *grads) == grads
    bwd, dape = calls  # the backward, then the dape partials' sum into grad_ape
    assert bwd[5] is g and bwd[6] is grads[0] and bwd[7] is grads[1]
    assert bwd[8].dtype == torch.float32 and bwd[8].shape[1] == 256
    assert dape[1].data_ptr() == grads[2].data_ptr() and dape[0].shape[1] == 4 * 256


def test_without_an_ape_the_kernels_read_zeros_and_sum_nothing(cpu_plan):
    make, calls = cpu_plan
    plan = make([0, 300], ape=False)
    kv, score, _, out = _tensors()
    plan.forward(kv, score, None, out)
    assert torch.equal(calls[0][2], torch.zeros(4, 256))
    calls.clear()
    plan.backward(kv, score, None, torch.randn(75, 128).bfloat16(), torch.empty_like(kv),
                  torch.empty_like(score), None)
    assert len(calls) == 1 and calls[0][8].shape == (1, 256)
    with pytest.raises(ValueError, match="grad_ape: expected None"):
        plan.backward(kv, score, None, torch.randn(75, 128).bfloat16(), torch.empty_like(kv),
                      torch.empty_like(score), torch.empty(4, 256))


def test_a_run_refuses_what_does_not_fit_the_plan_before_any_launch(cpu_plan):
    make, calls = cpu_plan
    plan = make([0, 300])
    kv, score, ape, out = _tensors()
    bad = [
        ((kv[:-1], score, ape, out), ValueError, r"kv: expected shape \(300, 256\)"),
        ((kv, score.float(), ape, out), TypeError, "score: expected dtype torch.bfloat16"),
        ((kv, score, ape.double(), out), TypeError, "ape: expected dtype torch.float32"),
        ((kv, score, None, out), TypeError, r"ape: expected a \(4, 256\) float32 tensor \(the plan was made with ape=True\), got None"),
        ((kv, score, ape, out[:-1]), ValueError, r"out: expected shape \(75, 128\)"),
        ((kv, score, ape, torch.empty(128, 75, dtype=torch.bfloat16).t()), ValueError,
         "out: expected contiguous"),
        ((kv, score, ape, torch.empty(75 * 128 + 1, dtype=torch.bfloat16)[1:].view(75, 128)),
         ValueError, "out: expected a 16-byte aligned"),
        ((kv, score, ape, kv.view(-1)[:75 * 128].view(75, 128)), ValueError,
         "out: shares memory with kv"),
    ]
    for args, err, match in bad:
        with pytest.raises(err, match=match):
            plan.forward(*args)
    g = torch.randn(75, 128).bfloat16()
    dkv, dsc, dape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    for args, match in [((g, dkv, dkv, dape), "grad_kv: shares memory with grad_score"),
                        ((g, dkv, dsc, ape), "grad_ape: shares memory with ape"),
                        ((g, g.view(-1).repeat(2).view(300, 64)[:, :0], dsc, dape),
                         r"grad_kv: expected shape"),
                        ((dsc.view(-1)[:75 * 128].view(75, 128), dkv, dsc, dape),
                         "grad_score: shares memory with grad_out")]:
        with pytest.raises(ValueError, match=match):
            plan.backward(kv, score, ape, *args)
    assert not calls
    plan.forward(kv, kv, ape, out)  # inputs may share memory
    assert len(calls) == 1


@pytest.mark.parametrize("score_first", [False, True])
def test_the_packed_op_launches_on_the_halves_and_returns_their_gradients(cpu_plan, score_first):
    make, calls = cpu_plan
    plan = make([0, 300], row_stride=512)  # the packed layout's kernels
    kvs = torch.randn(300, 512).bfloat16().requires_grad_(True)
    ape = torch.randn(4, 256, requires_grad=True)
    rows = plan.pool_packed(kvs, ape, score_first=score_first)
    assert rows.shape == (75, 128) and rows.requires_grad
    (fwd,) = calls
    kv_at, score_at = (256, 0) if score_first else (0, 256)
    base, es = kvs.data_ptr(), kvs.element_size()
    assert fwd[0].data_ptr() == base + kv_at * es and fwd[1].data_ptr() == base + score_at * es
    assert fwd[2] is ape and fwd[5] is rows
    dkvs, dape = torch.autograd.grad(rows, (kvs, ape), torch.randn(75, 128).bfloat16())
    bwd, dsum = calls[1:]
    assert bwd[6].data_ptr() == dkvs.data_ptr() + kv_at * es
    assert bwd[7].data_ptr() == dkvs.data_ptr() + score_at * es
    assert dsum[1].data_ptr() == dape.data_ptr() and dkvs.shape == kvs.shape
    with pytest.raises(ValueError, match=r"kvs: expected shape \(300, 512\)"):
        plan.pool_packed(kvs[:, :256], ape)
    with torch.no_grad():
        calls.clear()
        plan.pool_packed(kvs, ape)
        assert len(calls) == 1


def test_the_benchs_plan_impl_makes_one_plan_an_offsets_tensor(cpu_plan):
    from csa_compressor.cli.bench import _planned

    make, calls = cpu_plan
    make([0, 300])  # stands the kernels in
    planned = _planned()
    kv, score, ape, _ = _tensors()
    cu, cu2 = torch.tensor([0, 300], dtype=torch.int32), torch.tensor([0, 100, 300])
    for offsets in (cu, cu, cu2):
        rows = planned(kv, score, ape, offsets, None, 75, 4, 2)
        assert rows.shape == (75, 128)
    assert [c[3].tolist() for c in calls] == [[0, 300], [0, 300], [0, 100, 300]]
    assert calls[0][3] is calls[1][3]  # the first tensor's plan, made once


def test_the_packed_op_refuses_a_second_half_the_kernels_cannot_load(cpu_plan):
    make, calls = cpu_plan
    plan = make([0, 8], coff=1, head_dim=4)  # each half 8 bytes into a row
    kvs = torch.randn(8, 8).bfloat16()
    with pytest.raises(ValueError, match="kvs: the second half starts 8 bytes into each row"):
        plan.pool_packed(kvs, torch.randn(4, 4))
    assert not calls


@pytest.mark.parametrize("with_ape", [True, False])
def test_under_torch_compile_a_run_refuses_an_ape_the_plan_was_not_made_for(cpu_plan, monkeypatch,
                                                                            with_ape):
    # traced runs take the ops' custom ops, which read an absent APE as "no position bias":
    # without the plan's own check, an ape=True plan run with None pools without it
    make, calls = cpu_plan
    plan = make([0, 300], ape=with_ape)
    kv, score, ape, _ = _tensors()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    given = None if with_ape else ape
    match = "ape: expected a" if with_ape else "ape: expected None"
    with pytest.raises((TypeError, ValueError), match=match):
        plan.pool(kv, score, given)
    with pytest.raises((TypeError, ValueError), match=match):
        plan.pool_packed(torch.cat([kv, score], 1), given)
    assert not calls


def test_under_torch_compile_a_run_refuses_sizes_and_dtypes_the_plan_was_not_made_for(
        cpu_plan, monkeypatch):
    make, calls = cpu_plan
    plan = make([0, 300])
    kv, score, ape, _ = _tensors()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match=r"kv: expected shape \(300, 256\)"):
        plan.pool(kv[:-1], score, ape)
    with pytest.raises(TypeError, match="score: expected dtype torch.bfloat16"):
        plan.pool(kv, score.float(), ape)
    with pytest.raises(TypeError, match="ape: expected dtype torch.float32"):
        plan.pool(kv, score, ape.bfloat16())
    with pytest.raises(ValueError, match=r"kvs: expected shape \(300, 512\)"):
        plan.pool_packed(kv, ape)
    assert not calls


def test_torch_compile_traces_the_plans_checks_and_raises_their_errors(cpu_plan):
    # dynamo itself (eager backend): the checks trace without a graph break where the
    # tensors fit, and a misfit raises the plan's error, not the op's
    make, _ = cpu_plan
    plan = make([0, 300])
    kv, score, ape, _ = _tensors()
    torch._dynamo.reset()
    run = torch.compile(lambda k, s, a: plan.pool(k, s, a), backend="eager")
    with pytest.raises(ValueError, match=r"kv: expected shape \(300, 256\), got \(299, 256\)"):
        run(kv[:-1], score, ape)
    with pytest.raises(TypeError, match=r"ape: expected a \(4, 256\) float32 tensor"):
        run(kv, score, None)
    torch._dynamo.reset()
    whole = torch.compile(lambda k, s, a: plan.pool(k, s, a), backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match="kv: the fused kernels need CUDA tensors"):
        whole(kv, score, ape)  # past the plan's checks in one graph, to the op's device check
