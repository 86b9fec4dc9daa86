"""The ``epilogue=`` arguments of the fused ops, checked on the CPU: what is wrong is named
before anything launches, and the kernels' design says which geometries take the epilogue
inside (the rest run the pooling and the epilogue node in turn)."""

import pytest
import torch

import csa_compressor as C
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
        kw = dict(norm_weight=None, positions=None, rope_table=None)
        kw[name] = w
        with pytest.raises(ValueError, match=f"{name}: given without epilogue="):
            ops._finish(None, **kw)


def test_checked_positions_default_to_the_layouts():
    p = problem()
    f = Finish(C.Epilogue(), torch.ones(128)).check(p)
    assert torch.equal(f.positions, C.epilogue.rope_positions(p.cu_seqlens_comp, p.total_comp, 4))


@pytest.mark.parametrize("ratio,coff,d,taken", [
    (4, 2, 512, True), (4, 2, 128, True), (8, 1, 64, True), (4, 2, 256, True),
    (128, 1, 512, False),  # slot-parallel: a row spans CTAs
    (16, 1, 512, False),  # the forward splits the row over two column groups
    (4, 2, 96, False),  # the rope channels not whole lanes (head_dim - rope_dim) % (d // 32)
])
def test_which_geometries_take_the_epilogue_inside(ratio, coff, d, taken):
    key = plan.EpilogueKey(64 if d >= 64 else 0, True, d & (d - 1) == 0, 1e-6, torch.float32)
    got = plan.epilogue_designable(torch.bfloat16, ratio, coff, d, 9, current().codegen(),
                                   epilogue=key)
    assert got is taken
    spec = plan.spec("fwd", torch.bfloat16, ratio, coff, d, epilogue=key)
    assert "epilogue(rope_dim=" in str(spec) and spec != plan.spec("fwd", torch.bfloat16, ratio, coff, d)
    kernel = plan.kernel_for("fwd", torch.bfloat16, ratio, coff, d, 9, current().codegen(),
                             epilogue=key)
    assert (kernel is not None) is taken


def test_precompile_names_a_wrong_epilogue_before_the_device():
    with pytest.raises(TypeError, match="epilogue: expected a csa_compressor.Epilogue"):
        C.precompile(torch.bfloat16, 4, 2, 128, epilogue="norm")
    with pytest.raises(ValueError, match="head_dim: rotate=True needs a power of two"):
        C.precompile(torch.bfloat16, 4, 2, 96, epilogue=C.Epilogue(rope_dim=0, rotate=True))
    with pytest.raises(TypeError, match="weight_dtype: expected bf16, fp16 or fp32"):
        C.precompile(torch.bfloat16, 4, 2, 128, epilogue=C.Epilogue(), weight_dtype=torch.int8)
