"""SBHD inputs on the CPU: validate_sbhd's checks (each error names the argument), the
one-segment pack and kernel spec it builds, and the SBHD entries' routing through the
dispatch (the fused launch stood in by the reference, tests/conftest.py)."""

import pytest
import torch

import csa_compressor as C
from csa_compressor import dispatch
from csa_compressor.kernels import plan
from csa_compressor.validation import validate_sbhd


def _sbhd(S=40, B=3, d=64, coff=2, dtype=torch.bfloat16, ratio=4):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(S, B, coff * d, generator=gen).to(dtype)
    return kv, (2 * kv).clone(), torch.randn(ratio, coff * d, generator=gen)


def test_the_problem_is_sequence_zeros_view_of_one_segment():
    kv, score, ape = _sbhd(S=42)
    p = validate_sbhd(kv, score, ape, ratio=4, coff=2)
    assert (p.batch, p.total_comp, p.num_tokens, p.row_stride, p.head_dim) == (3, 10, 42, 384, 64)
    assert p.kv.stride() == (384, 1) and p.kv.data_ptr() == kv.data_ptr()
    assert p.cu_seqlens.tolist() == [0, 42] and p.cu_seqlens_comp.tolist() == [0, 10]
    assert p.full[0] is kv and p.kvs is None
    kvs = torch.cat((kv, score), 2)
    q = validate_sbhd(kvs, None, ape, ratio=4, coff=2, packed=True)
    assert (q.batch, q.row_stride, q.kvs is kvs, q.full) == (3, 768, True, None)
    assert q.score.data_ptr() == kvs.data_ptr() + 128 * kvs.element_size()
    assert validate_sbhd(kv[:3], score[:3], ape, ratio=4, coff=2).total_comp == 0


@pytest.mark.parametrize("bad,match", [
    (lambda kv, s, a: (kv[0], s, a), "kv: expected shape \\(S, B, width\\)"),
    (lambda kv, s, a: (kv, s[:, :2], a), "score: expected the shape of kv"),
    (lambda kv, s, a: (kv[:, :0], s[:, :0], a), "kv: expected B >= 1"),
    (lambda kv, s, a: (kv, s.float(), a), "score: expected the dtype of kv"),
    (lambda kv, s, a: (kv, s, a[:2]), "ape: expected shape"),
    (lambda kv, s, a: (kv[:, :, :127], s[:, :, :127], a), "kv: last dimension must be"),
])
def test_bad_sbhd_inputs_name_the_argument(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        validate_sbhd(*bad(*_sbhd()), ratio=4, coff=2)


def test_the_kernels_need_contiguous_aligned_sequences():
    kv, score, ape = _sbhd()
    with pytest.raises(ValueError, match="kv: expected contiguous"):
        validate_sbhd(kv.transpose(0, 1).contiguous().transpose(0, 1), score, ape, ratio=4,
                      coff=2, for_kernel=True)
    kv, score, ape = _sbhd(d=60)  # 120-byte head rows
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        validate_sbhd(kv, score, ape, ratio=4, coff=2, for_kernel=True)
    with pytest.raises(ValueError, match="kvs: expected contiguous"):
        validate_sbhd(torch.cat((kv, score), 2)[:, ::2], None, ape, ratio=4, coff=2,
                      for_kernel=True, packed=True)


def test_sbhd_specs():
    s = plan.spec("bwd", torch.bfloat16, 4, 2, 512, row_stride=3 * 1024, batch=3)
    assert (s.batch, s.row_stride) == (3, 3072) and "batch=3" in str(s)
    one = plan.spec("fwd", torch.bfloat16, 4, 2, 512, row_stride=1024, batch=1)
    assert one == plan.spec("fwd", torch.bfloat16, 4, 2, 512)  # one sequence: the THD kernel
    sums = [f for f in plan.family(s) if f.direction.startswith("dape")]
    assert sums and all(f.batch == 0 and f.row_stride == 0 for f in sums)
    assert plan.family(s)[-1].direction == "bwd_large" and plan.family(s)[-1].batch == 3
    assert s != plan.spec("bwd", torch.bfloat16, 4, 2, 512, row_stride=3 * 1024)


def test_sbhd_entries_route_through_the_dispatch(fused_on_cpu):
    kv, score, ape = _sbhd(S=41)
    out, reason = dispatch.fused_sbhd_or_reason(kv, score, ape, ratio=4, coff=2)
    assert reason is None and fused_on_cpu == [30]
    want = C.reference.compress_sbhd(kv, score, ape, ratio=4, coff=2)
    assert out.shape == (10, 3, 64) and torch.equal(out, want)
    out, reason = dispatch.fused_sbhd_or_reason(torch.cat((kv, score), 2), None, ape, ratio=4,
                                                coff=2, packed=True)
    assert reason is None and torch.equal(out, want)
    out, reason = dispatch.fused_sbhd_or_reason(kv, score, ape, ratio=4, coff=2, enabled=False)
    assert out is None and "enabled=False" in reason


def test_the_module_sbhd_path_takes_one_sbhd_launch(fused_on_cpu):
    torch.manual_seed(0)
    m = C.Compressor(96, 64, 4, dtype=torch.float32)
    r = C.Compressor(96, 64, 4, dtype=torch.float32, pooling="reference")
    r.load_state_dict(m.state_dict())
    x = torch.randn(23, 2, 96)
    got, want = m(x), r(x)
    assert fused_on_cpu == [10] and got.shape == (5, 2, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert m(x[:3]) is None


def test_rows_the_kernels_cannot_read_in_place_take_the_thd_op(fused_on_cpu):
    """d*element size not a multiple of 16 bytes (head_dim 60 in bf16): one transposed copy
    into the THD layout, the THD op on it (a THD launch of every sequence's rows), the
    same rows as the reference; the module's SBHD path and Megatron's go the same way."""
    kv, score, ape = _sbhd(S=41, d=60)
    for args, kw in (((kv, score, ape), {}), ((torch.cat((kv, score), 2), None, ape), {"packed": True})):
        fused_on_cpu.clear()
        out, reason = dispatch.fused_sbhd_or_reason(*args, ratio=4, coff=2, **kw)
        assert reason is None and fused_on_cpu == [30]
        assert torch.equal(out, C.reference.compress_sbhd(kv, score, ape, ratio=4, coff=2))
    out, reason = dispatch.fused_sbhd_or_reason(kv, score[:, :2], ape, ratio=4, coff=2)
    assert out is None and "score" in reason
