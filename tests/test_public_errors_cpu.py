"""Every public function and constructor names the argument it refuses (CPU)."""

import pytest
import torch

from csa_compressor import Compressor
from csa_compressor.kernel_api import backward_workspace_shape, precompile

NO_GPU = not torch.cuda.is_available()


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(ratio=0), ValueError, "ratio"), (dict(head_dim=0), ValueError, "head_dim"),
    (dict(coff=3), ValueError, "coff"), (dict(dtype=torch.float64), TypeError, "dtype"),
    (dict(ratio=4.0), TypeError, "ratio"), (dict(directions="fwd"), ValueError, "directions"),
    (dict(device="cpu"), ValueError, "device"), (dict(packed="yes"), TypeError, "packed"),
    (dict(numerics="bf16"), ValueError, "numerics"),
])
def test_precompile_names_the_argument(kwargs, error, name):
    args = dict(dtype=torch.bfloat16, ratio=4, coff=2, head_dim=128)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        precompile(**args)


@pytest.mark.skipif(not NO_GPU, reason="the no-GPU answer")
def test_kernel_entries_without_a_gpu_say_so():
    with pytest.raises(RuntimeError, match="device: no CUDA GPU"):
        precompile(torch.bfloat16, 4, 2, 128)
    with pytest.raises(RuntimeError, match="device: .*no CUDA GPU"):
        backward_workspace_shape(100, 400, 4, 2, 128, torch.bfloat16, "cuda")


@pytest.mark.parametrize("args,error,name", [
    ((-1, 400, 4, 2, 128, torch.bfloat16, "cuda"), ValueError, "total_comp"),
    ((100, 400, 0, 2, 128, torch.bfloat16, "cuda"), ValueError, "ratio"),
    ((100, 400, 4, 2, 128, torch.float64, "cuda"), TypeError, "dtype"),
    ((100, 400, 4, 2, 128, torch.bfloat16, "cpu"), ValueError, "device"),
    ((100, 400, 4, 2, 128, torch.bfloat16, "cuda", "bf16"), ValueError, "numerics"),
])
def test_backward_workspace_shape_names_the_argument(args, error, name):
    with pytest.raises(error, match=name):
        backward_workspace_shape(*args)


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(ratio=4.0), TypeError, "ratio"), (dict(ratio="4"), TypeError, "ratio"),
    (dict(ratio=0), ValueError, "ratio"), (dict(hidden_size=-1), ValueError, "hidden_size"),
    (dict(head_dim=-8), ValueError, "head_dim"), (dict(coff=3), ValueError, "coff"),
    (dict(dtype=torch.float64), TypeError, "dtype"), (dict(norm_eps=-1), ValueError, "norm_eps"),
    (dict(norm_eps=float("nan")), ValueError, "norm_eps"), (dict(rope_theta=0), ValueError, "rope_theta"),
    (dict(rope_dim=33), ValueError, "rope_dim"), (dict(rope_dim=64), ValueError, "rope_dim"),
    (dict(rotate="yes"), TypeError, "rotate"), (dict(pooling="fast"), ValueError, "pooling"),
])
def test_compressor_names_the_argument(kwargs, error, name):
    args = dict(hidden_size=64, head_dim=32, ratio=4)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        Compressor(**args)


def test_compressor_defaults_fit_a_small_head_dim():
    m = Compressor(64, 32, 4, dtype=torch.float32)
    assert m.rope_dim == 32 and m.coff == 2
    x = torch.randn(40, 64)
    out, cuc = m(x, torch.tensor([0, 17, 40], dtype=torch.int32))
    assert out.shape == (4 + 5, 32) and torch.isfinite(out).all()
    assert Compressor(64, 7, 3, dtype=torch.float32).rope_dim == 6


def test_compressor_sbhd_shorter_than_ratio_returns_none():
    m = Compressor(64, 32, 4, dtype=torch.float32)
    assert m(torch.randn(3, 2, 64)) is None
    assert m(torch.randn(8, 2, 64)).shape == (2, 2, 32)


def test_the_pooling_ops_name_a_bad_numerics():
    """Every fused entry refuses a numerics other than "fp32" and "eager" before anything
    else (these CPU tensors would be refused next)."""
    import csa_compressor as C
    from csa_compressor import dispatch

    kv = torch.zeros(8, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    ape = torch.zeros(4, 16)
    calls = [
        lambda: C.compress_thd_fused(kv, kv, ape, cu, None, 2, ratio=4, coff=1, numerics="bf16"),
        lambda: C.compress_thd_fused_packed(torch.zeros(8, 32), ape, cu, None, 2, ratio=4, coff=1,
                                            numerics="bf16"),
        lambda: C.compress_sbhd_fused(kv[:, None], kv[:, None], ape, ratio=4, coff=1,
                                      numerics="bf16"),
        lambda: C.compress_sbhd_fused_packed(torch.zeros(8, 1, 32), ape, ratio=4, coff=1,
                                             numerics="bf16"),
        lambda: dispatch.fused_or_reason(kv, kv, ape, cu, None, 2, ratio=4, coff=1,
                                         numerics="bf16"),
        lambda: dispatch.fused_sbhd_or_reason(kv[:, None], kv[:, None], ape, ratio=4, coff=1,
                                              numerics="bf16"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="numerics: expected one of"):
            call()


def _module_call(**over):
    import csa_compressor as C

    m = C.Compressor(32, 16, 4, rope_dim=8, dtype=torch.float32)
    kw = dict(x=torch.randn(100, 32), cu_seqlens=torch.tensor([0, 100], dtype=torch.int32))
    kw.update(over)
    return lambda: m(kw.pop("x"), **kw)


@pytest.mark.parametrize("over,exc,words", [
    (dict(x=torch.randn(100, 31)), ValueError, "x: expected hidden size 32"),
    (dict(x=torch.randn(100, 32, dtype=torch.bfloat16)), TypeError, "x: expected the module's dtype"),
    (dict(x=torch.empty(100, 32, device="meta")), ValueError, "x: expected a CPU or CUDA tensor"),
    (dict(x=[[0.0] * 32]), TypeError, "x: expected a torch.Tensor"),
    (dict(total_comp=-1), ValueError, "total_comp: expected an int >= 0"),
    (dict(max_seqlen=-3), ValueError, "max_seqlen: expected an int >= 0"),
    (dict(cu_seqlens=[0, 100]), TypeError, "cu_seqlens: expected a torch.Tensor, got list"),
])
def test_the_module_names_the_argument(over, exc, words):
    with pytest.raises(exc, match=words):
        _module_call(**over)()


def test_a_list_as_cu_seqlens_is_one_error_on_every_path():
    import csa_compressor as C

    kv, ape = torch.randn(100, 16), torch.randn(4, 16)
    for call in (lambda: C.compressed_cu_seqlens([0, 100], 4),
                 lambda: C.reference.compress_thd(kv, kv, ape, [0, 100], None, 25, ratio=4, coff=1),
                 _module_call(cu_seqlens=[0, 100])):
        with pytest.raises(TypeError, match="cu_seqlens: expected a torch.Tensor, got list"):
            call()
