"""Every validation rule triggers with a message naming the argument (CPU)."""

import pytest
import torch

from csa_compressor import compressed_cu_seqlens, reference
from csa_compressor.layout import compressed_capacity
from csa_compressor.validation import validate
from packs import make_pack


def good():
    kv, score, ape, cu, cuc, N = make_pack([8, 5], 4, 4, 2)
    return dict(kv=kv, score=score, ape=ape, cu_seqlens=cu, cu_seqlens_comp=cuc, total_comp=N,
                ratio=4, coff=2)


def call(**over):
    a = good()
    a.update(over)
    return validate(a.pop("kv"), a.pop("score"), a.pop("ape"), a.pop("cu_seqlens"),
                    a.pop("cu_seqlens_comp"), a.pop("total_comp"), **a)


CASES = [
    ("kv dtype", lambda a: dict(kv=a["kv"].double(), score=a["score"].double()), TypeError, "kv: expected dtype"),
    ("kv int", lambda a: dict(kv=a["kv"].int()), TypeError, "kv: expected dtype"),
    ("score dtype", lambda a: dict(score=a["score"].half()), TypeError, "score: expected the dtype of kv"),
    ("score shape", lambda a: dict(score=a["score"][:-1]), ValueError, "score: expected the shape"),
    ("kv rank", lambda a: dict(kv=a["kv"][None, None]), ValueError, "kv: expected shape"),
    ("kv 3d not 1", lambda a: dict(kv=a["kv"].view(13, 2, 4)), ValueError, "kv: a 3-D input"),
    ("kv width vs coff", lambda a: dict(kv=a["kv"][:, :7], score=a["score"][:, :7]), ValueError, "multiple of coff"),
    ("ape dtype", lambda a: dict(ape=a["ape"].half()), TypeError, "ape: expected float32"),
    ("ape shape", lambda a: dict(ape=a["ape"][:3]), ValueError, "ape: expected shape"),
    ("cu dtype", lambda a: dict(cu_seqlens=a["cu_seqlens"].float()), TypeError, "cu_seqlens: expected int32"),
    ("cu short", lambda a: dict(cu_seqlens=a["cu_seqlens"][:1], cu_seqlens_comp=a["cu_seqlens_comp"][:1]), ValueError, "cu_seqlens: expected a 1-D tensor of B\\+1 >= 2"),
    ("cuc length", lambda a: dict(cu_seqlens_comp=a["cu_seqlens_comp"][:2]), ValueError, "cu_seqlens_comp: expected the length"),
    ("ratio", lambda a: dict(ratio=0), ValueError, "ratio: expected an int >= 1"),
    ("ratio type", lambda a: dict(ratio=4.0), TypeError, "ratio: expected a Python int"),
    ("coff", lambda a: dict(coff=3), ValueError, "coff: expected 1 or 2"),
    ("total_comp negative", lambda a: dict(total_comp=-1), ValueError, "total_comp: expected an int >= 0"),
    ("total_comp type", lambda a: dict(total_comp=torch.tensor(3)), TypeError, "total_comp: expected a Python int"),
    ("kv not a tensor", lambda a: dict(kv=[1, 2]), TypeError, "kv: expected a torch.Tensor"),
    ("total_comp overflow", lambda a: dict(total_comp=2**31), ValueError, "total_comp: N\\*d"),
    ("device mix", lambda a: dict(ape=a["ape"].to("meta")), ValueError, "expected one device"),
]


@pytest.mark.parametrize("name,mutate,exc,msg", CASES, ids=[c[0] for c in CASES])
def test_rule(name, mutate, exc, msg):
    with pytest.raises(exc, match=msg):
        call(**mutate(good()))


def test_valid_call_passes_and_normalises_offsets():
    a = good()
    p = call(cu_seqlens=a["cu_seqlens"].long(), cu_seqlens_comp=a["cu_seqlens_comp"].long())
    assert p.cu_seqlens.dtype == torch.int32 and p.head_dim == 4 and p.num_seqs == 2


def test_int32_offset_overflow_of_kv():
    kv = torch.empty(2**31 // 8 + 1, 8, dtype=torch.bfloat16, device="meta")
    ape = torch.empty(4, 8, device="meta")
    cu = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="kv: T\\*coff\\*d"):
        validate(kv, kv, ape, cu, cu, 0, ratio=4, coff=2)


def test_kernel_rules_need_cuda():
    with pytest.raises(ValueError, match="kv: the fused kernels need CUDA tensors"):
        call(for_kernel=True)


def test_kernel_buffer_rules():
    from csa_compressor.checks import check_out

    t = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="out: expected contiguous"):
        check_out("out", t.t(), (8, 4), torch.float32, t.device)
    with pytest.raises(ValueError, match="out: expected a 16-byte aligned"):
        check_out("out", t.view(-1)[1:5], (4,), torch.float32, t.device)
    with pytest.raises(ValueError, match="out: expected shape"):
        check_out("out", t, (3, 8), torch.float32, t.device)
    with pytest.raises(TypeError, match="out: expected dtype"):
        check_out("out", t, (4, 8), torch.float16, t.device)


def test_layout_helpers():
    cu = torch.tensor([0, 9, 9, 12, 31], dtype=torch.int32)
    cuc = compressed_cu_seqlens(cu, 4)
    assert cuc.dtype == torch.int32 and cuc.tolist() == [0, 2, 2, 2, 6]
    assert compressed_capacity(31, 4, 19, 4) == min(31 // 4, 4 * (19 // 4))
    with pytest.raises(ValueError, match="ratio"):
        compressed_cu_seqlens(cu, 0)
    with pytest.raises(ValueError, match="max_seqlen"):
        compressed_capacity(31, 4, -1, 4)


def test_reference_rejects_like_the_kernels():
    a = good()
    with pytest.raises(ValueError, match="coff"):
        reference.compress_thd(a["kv"], a["score"], a["ape"], a["cu_seqlens"], a["cu_seqlens_comp"],
                               a["total_comp"], ratio=4, coff=0)


def test_disjoint_buffers_are_told_apart_from_overlapping_ones():
    """check_disjoint: inputs may share memory with one another; an output may not share a
    byte with an input or another output, whether it lies inside one, holds one, or
    touches its last byte; an output right after another, empty tensors and None pass."""
    from csa_compressor.checks import check_disjoint

    buf = torch.empty(64, dtype=torch.float32)
    a, b = buf[:16], buf[16:32]
    check_disjoint((("out", a), ("none", None), ("empty", buf[:0])), (("x", b), ("y", b)))
    check_disjoint((("out", a), ("out2", b)), (("x", buf[40:]),))
    for out, other, others in ((buf[20:24], "x", (("x", b),)),       # inside an input
                               (buf[8:40], "x", (("x", b),)),        # holds an input
                               (buf[31:33], "x", (("x", b),)),       # touches its last byte
                               (buf[:64], "x", (("x", buf[63:]),))):
        with pytest.raises(ValueError, match=f"^out: shares memory with {other} "):
            check_disjoint((("out", out),), others)
    with pytest.raises(ValueError, match="^out: shares memory with out2 "):
        check_disjoint((("out", a), ("out2", buf[15:20])), (("x", buf[40:]),))
