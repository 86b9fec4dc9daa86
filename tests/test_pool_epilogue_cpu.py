"""The ``epilogue=`` arguments of the fused ops, checked on the CPU: what is wrong is named
before anything launches, and the kernels' design says which geometries take the epilogue
inside (the rest run the pooling and the epilogue node in turn)."""

import dataclasses
import pytest
import torch
from csa_compressor import pooling
from csa_compressor.kernels import catalog

import csa_compressor as C
from csa_compressor import kernel_api
from csa_compressor import ops
from csa_compressor.fused_epilogue import Finish
from csa_compressor.kernels import plan
from csa_compressor.kernels.tuning import current
from csa_compressor.validation import validate


def problem(T=64, d=128, ratio=4, coff=2):
    kv = torch.randn(T, coff * d, dtype=torch.bfloat16)
    score = torch.randn(T, coff * d, dtype=torch.bfloat16)
    ape = torch.zeros(ratio, coff * d)
    cu = torch.tensor([0, 30, T], dtype=torch.int32)
    cuc = C.compressed_cu_seqlens(cu, ratio)
    return validate(kv, score, ape, cu, cuc, int(cuc[-1]) + 2, ratio=ratio, coff=coff)


def test_epilogue_arguments_are_named_when_wrong():
    p = problem()
    w = torch.ones(128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="epilogue: expected a csa_compressor.Epilogue"):
        Finish("rmsnorm", w).check(p)
    with pytest.raises(TypeError, match="norm_weight: expected a torch.Tensor"):
        Finish(C.Epilogue(), None).check(p)
    with pytest.raises(ValueError, match=r"norm_weight: expected a floating-point \(128,\)"):
        Finish(C.Epilogue(), torch.ones(64)).check(p)
    with pytest.raises(ValueError, match=r"positions: expected \(17,\) integer positions"):
        Finish(C.Epilogue(), w, positions=torch.zeros(16, dtype=torch.int64)).check(p)
    with pytest.raises(ValueError, match="positions: expected"):
        Finish(C.Epilogue(), w, positions=torch.zeros(17)).check(p)
    with pytest.raises(ValueError, match="rope_dim: expected an even int"):
        Finish(C.Epilogue(rope_dim=256), w).check(p)
    with pytest.raises(ValueError, match=r"rope_table\[0\] \(cos\): expected shape"):
        Finish(C.Epilogue(rope_dim=64), w, rope_table=(torch.zeros(8, 16), torch.zeros(8, 16))).check(p)
    for name in ("norm_weight", "positions", "rope_table"):
        kw = dict(norm_weight=None, positions=None, rope_table=None, epilogue_inside=None)
        kw[name] = w
        with pytest.raises(ValueError, match=f"{name}: given without epilogue="):
            ops._finish(None, **kw)


def test_epilogue_inside_is_a_frozen_value_that_names_a_bad_direction():
    """Which directions run as one kernel is an argument (EpilogueInside), carried by the
    op's Finish and through the custom ops' scalar; no process-wide switch."""
    from csa_compressor import fused_epilogue as FE

    v = C.EpilogueInside(short=["bwd", "fwd"], long=("bwd",))
    assert (v.short, v.long) == (("fwd", "bwd"), ("bwd",))
    assert C.EpilogueInside.of(None) == C.EpilogueInside() == FE.DEFAULT_INSIDE
    assert (FE.DEFAULT_INSIDE.short, FE.DEFAULT_INSIDE.long) == (("fwd",), ())
    assert C.EpilogueInside.of(("bwd",)) == C.EpilogueInside(("bwd",), ("bwd",))
    for bits in range(16):
        assert C.EpilogueInside.of_bits(bits).bits() == bits
    for bad in ("bwd", ("back",), 1):
        with pytest.raises(ValueError, match="short: expected a tuple of directions"):
            C.EpilogueInside(short=bad)
    with pytest.raises(TypeError, match="epilogue_inside: expected None"):
        C.EpilogueInside.of(1)
    with pytest.raises(AttributeError, match="set_epilogue_inside was removed"):
        C.set_epilogue_inside
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.short = ()


def test_checked_positions_default_to_the_layouts():
    p = problem()
    f = Finish(C.Epilogue(), torch.ones(128)).check(p)
    assert torch.equal(f.positions, C.epilogue.rope_positions(p.cu_seqlens_comp, p.total_comp, 4))


@pytest.mark.parametrize("ratio,coff,d,taken", [
    (4, 2, 512, True), (4, 2, 128, True), (8, 1, 64, True), (4, 2, 256, True),
    (128, 1, 512, True), (128, 2, 128, True),  # slot-parallel: a row's last CTA finishes it
    (16, 1, 512, False),  # the forward splits the row over two column groups
    (4, 2, 96, False),  # the rope channels not whole lanes (head_dim - rope_dim) % (d // 32)
])
def test_which_geometries_take_the_epilogue_inside(ratio, coff, d, taken):
    key = plan.EpilogueKey(64 if d >= 64 else 0, True, d & (d - 1) == 0, 1e-6, torch.float32)
    got = catalog.epilogue_designable(torch.bfloat16, ratio, coff, d, 9, current().codegen(),
                                   epilogue=key)
    assert got is taken
    spec = plan.spec("fwd", torch.bfloat16, ratio, coff, d, epilogue=key)
    assert "epilogue(rope_dim=" in str(spec) and spec != plan.spec("fwd", torch.bfloat16, ratio, coff, d)
    kernel = catalog.kernel_for("fwd", torch.bfloat16, ratio, coff, d, 9, current().codegen(),
                             epilogue=key)
    assert (kernel is not None) is taken
    if taken:
        long = current().long_window(ratio * coff)
        assert type(kernel).__name__ == ("LongPoolEpilogueForward" if long else "PoolEpilogueForward")


def test_precompile_names_a_wrong_epilogue_before_the_device():
    with pytest.raises(TypeError, match="epilogue: expected a csa_compressor.Epilogue"):
        kernel_api.precompile(torch.bfloat16, 4, 2, 128, epilogue="norm")
    with pytest.raises(ValueError, match="head_dim: rotate=True needs a power of two"):
        kernel_api.precompile(torch.bfloat16, 4, 2, 96, epilogue=C.Epilogue(rope_dim=0, rotate=True))
    with pytest.raises(TypeError, match="weight_dtype: expected bf16, fp16 or fp32"):
        kernel_api.precompile(torch.bfloat16, 4, 2, 128, epilogue=C.Epilogue(), weight_dtype=torch.int8)


def by_parts_on_cpu(monkeypatch):
    """The node's by-parts directions with the pooling kernels' launches replaced by the
    reference (the kernels' contract), so the node's plumbing runs on the CPU."""
    from csa_compressor import reference
    from csa_compressor.kernels import launch

    @torch.no_grad()
    def launch_forward(p, out, epilogue=None, extra=()):
        """As the kernels write ``out`` (SBHD: sequence 0's view of the whole rows)."""
        assert epilogue is None
        kv, score = (p.full or (p.kv, p.score)) if p.kvs is None else halves3(p)
        if p.batch:
            rows = reference.compress_sbhd(kv, score, p.ape, ratio=p.ratio, coff=p.coff)
            d = rows.shape[-1]
            out = out.as_strided(rows.shape, (p.batch * d, d, 1))
        else:
            rows = reference.compress_thd(kv, score, p.ape, p.cu_seqlens, p.cu_seqlens_comp,
                                          p.total_comp, ratio=p.ratio, coff=p.coff)
        return out.copy_(rows)

    def halves3(p):
        from csa_compressor.validation import halves

        return halves(p.kvs, p.score_first)

    def launch_backward(grad, p, grads):
        kv, score = (p.full or (p.kv, p.score)) if p.kvs is None else halves3(p)

        def pooled(kv, score, ape):
            if p.batch:
                return reference.compress_sbhd(kv, score, ape, ratio=p.ratio, coff=p.coff)
            return reference.compress_thd(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp,
                                          p.total_comp, ratio=p.ratio, coff=p.coff)

        # torch.func: it differentiates inside the node's backward and inside a custom op
        _, vjp = torch.func.vjp(pooled, kv.detach(), score.detach(), p.ape.detach())
        dkv, dscore, dape = vjp(grad)
        grads[0].copy_(dkv)
        grads[1].copy_(dscore)
        return dape

    # the kernels with the epilogue inside never run on CPU tensors (runtime.small_kernels_usable)
    monkeypatch.setattr(launch, "launch_forward", launch_forward)
    monkeypatch.setattr(pooling, "launch_backward_into", launch_backward)


@pytest.mark.parametrize("layout", ["thd", "packed", "packed_score_first", "sbhd"])
def test_the_node_is_the_pooling_then_the_epilogue_node(monkeypatch, layout):
    """The node's forward and every gradient (the pooling's inputs, the APE, the norm
    weight), in the order autograd hands them back, equal the pooling followed by
    apply_epilogue (by parts on the CPU; the kernels' equality is the GPU tests')."""
    from csa_compressor import reference
    from csa_compressor.fused_epilogue import pool_with_epilogue
    from csa_compressor.validation import halves, validate_packed, validate_sbhd

    by_parts_on_cpu(monkeypatch)
    torch.manual_seed(0)
    ratio, coff, d = 4, 2, 64
    ep = C.Epilogue(rope_dim=32, rotate=True)
    w = (1 + 0.1 * torch.randn(d)).requires_grad_(True)
    ape = (0.1 * torch.randn(ratio, coff * d)).requires_grad_(True)
    if layout == "sbhd":
        S, B = 42, 3
        kv = torch.randn(S, B, coff * d).requires_grad_(True)
        score = torch.randn(S, B, coff * d).requires_grad_(True)
        leaves = (kv, score)
        p = validate_sbhd(kv, score, ape, ratio=ratio, coff=coff)
        n = S // ratio
        pos = C.epilogue.sbhd_positions(n, B, ratio)
        pooled = reference.compress_sbhd(kv, score, ape, ratio=ratio, coff=coff)
        want = apply_epilogue_rows(pooled, w, pos, ep)
    else:
        T = 70
        cu = torch.tensor([0, 30, 33, T], dtype=torch.int32)
        cuc = C.compressed_cu_seqlens(cu, ratio)
        n = int(cuc[-1]) + 2
        pos = C.epilogue.rope_positions(cuc, n, ratio)
        if layout == "thd":
            kv = torch.randn(T, coff * d).requires_grad_(True)
            score = torch.randn(T, coff * d).requires_grad_(True)
            leaves = (kv, score)
            p = validate(kv, score, ape, cu, cuc, n, ratio=ratio, coff=coff)
        else:
            kvs = torch.randn(T, 2 * coff * d).requires_grad_(True)
            leaves = (kvs,)
            p = validate_packed(kvs, ape, cu, cuc, n, ratio=ratio, coff=coff,
                                score_first=layout == "packed_score_first")
            kv, score = halves(kvs, p.score_first)
        pooled = reference.compress_thd(kv, score, ape, cu, cuc, n, ratio=ratio, coff=coff)
        want = apply_epilogue_rows(pooled, w, pos, ep)
    g = torch.randn(want.shape)
    want_grads = torch.autograd.grad(want, leaves + (ape, w), g)
    got = pool_with_epilogue(p, Finish(ep, w))
    got_grads = torch.autograd.grad(got, leaves + (ape, w), g)
    assert torch.equal(got, want.detach())
    names = [f"input {i}" for i in range(len(leaves))] + ["ape", "norm_weight"]
    for name, a, b in zip(names, got_grads, want_grads):
        assert torch.equal(a, b), name


def apply_epilogue_rows(pooled, w, pos, ep):
    rows = C.apply_epilogue(pooled.reshape(-1, pooled.shape[-1]), w, pos, ep)
    return rows.view(pooled.shape)


@pytest.mark.parametrize("packed", [False, True])
def test_under_torch_compile_the_custom_ops_give_the_eager_bits(monkeypatch, packed):
    """fullgraph torch.compile: the node's directions as custom ops (their fakes give the
    shapes) return what the eager node returns, every gradient included (by parts on the
    CPU, as above)."""
    from csa_compressor import validation

    by_parts_on_cpu(monkeypatch)
    for name in ("validate", "validate_packed", "validate_sbhd"):
        fn = getattr(validation, name)
        for mod in (ops, pooling):
            monkeypatch.setattr(mod, name, lambda *a, _f=fn, for_kernel=False, **k: _f(*a, **k))
    torch.manual_seed(1)
    ratio, coff, d, T = 4, 2, 64, 70
    cu = torch.tensor([0, 30, 33, T], dtype=torch.int32)
    cuc = C.compressed_cu_seqlens(cu, ratio)
    n = int(cuc[-1]) + 2
    pos = C.epilogue.rope_positions(cuc, n, ratio)
    ep = C.Epilogue(rope_dim=32, rotate=True)
    w = 1 + 0.1 * torch.randn(d)
    ape = 0.1 * torch.randn(ratio, coff * d)
    if packed:
        def fn(kvs, ape, w):
            return C.compress_thd_fused_packed(kvs, ape, cu, cuc, n, ratio=ratio, coff=coff,
                                               epilogue=ep, norm_weight=w, positions=pos)
        tensors = (torch.randn(T, 2 * coff * d), ape, w)
    else:
        def fn(kv, score, ape, w):
            return C.compress_thd_fused(kv, score, ape, cu, cuc, n, ratio=ratio, coff=coff,
                                        epilogue=ep, norm_weight=w, positions=pos)
        tensors = (torch.randn(T, coff * d), torch.randn(T, coff * d), ape, w)
    g = torch.randn(n, d)

    def run(f):
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        out = f(*leaves)
        return [out.detach()] + list(torch.autograd.grad(out, leaves, g))

    from csa_compressor import fused_epilogue

    bodies, op_problem = [], fused_epilogue._op_problem  # called by the custom ops' bodies only
    monkeypatch.setattr(fused_epilogue, "_op_problem", lambda *a: bodies.append(1) or op_problem(*a))
    want = run(fn)
    assert bodies == []
    torch._dynamo.reset()
    got = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    assert len(bodies) == 2  # the forward's op and the backward's
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i


def test_the_backward_with_the_epilogue_takes_the_plain_backwards_schedule(monkeypatch):
    """The APE gradient sums the row CTAs' partials, so the kernel with the epilogue inside
    runs the plain backward's row CTAs even where its own registers fit fewer CTAs an SM
    (d=128: 88 registers, 2 CTAs, against the plain kernel's 80 and 3): the sum then runs
    in the pooling op's order, bit for bit."""
    import cutlass

    from csa_compressor.kernels import launch
    from csa_compressor.kernels.compile import Compiled
    from csa_compressor.kernels.pool_bwd import PoolBackward
    from csa_compressor.kernels.pool_epilogue import PoolEpilogueBackward

    key = plan.EpilogueKey(64, True, True, 1e-6, torch.float32)

    def compiled_for(spec, device):
        args = (cutlass.BFloat16, spec.ratio, spec.coff, spec.head_dim)
        if spec.epilogue is None:
            k, regs = PoolBackward(*args), 80
        else:
            k, regs = PoolEpilogueBackward(*args, epilogue=spec.epilogue), 88
        return Compiled(k, None, regs, k.grid_ctas_per_sm(regs))

    monkeypatch.setattr(launch, "compiled_for", compiled_for)
    monkeypatch.setattr(launch, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    rows, tokens = 3000, 12003
    fused = launch.backward_plan(dev, torch.bfloat16, 4, 2, 128, rows, tokens, epilogue=key)
    alone = launch.backward_plan(dev, torch.bfloat16, 4, 2, 128, rows, tokens)
    assert isinstance(fused[0].kernel, PoolEpilogueBackward)
    assert (fused[0].ctas_per_sm, alone[0].ctas_per_sm) == (2, 3)
    own = launch.backward_schedule(rows, tokens, fused[0].kernel, dev, fused[0].ctas_per_sm)
    assert own != alone[1]  # its own registers would have sized another grid
    assert fused[1:] == alone[1:]
