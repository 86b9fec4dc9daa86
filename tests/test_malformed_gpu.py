"""Malformed offsets on the default GPU path of the module and of Megatron's installed
Compressor (no check_offsets, no host read of the offsets): every case gives NaN rows and
NaN gradients, or raises; the same pack well formed gives finite rows."""

import pytest
import torch

from csa_compressor import Compressor, megatron
from megatron_env import build_compressor

pytestmark = pytest.mark.gpu

CASES = ["decreasing", "first", "past_T", "max_seqlen", "total_comp"]


def _pack(ratio):
    """(T, cu list, max_seqlen) of a well-formed three-segment pack."""
    lens = [9 * ratio + 1, 6 * ratio - 1, 10 * ratio]
    cu = [0, lens[0], lens[0] + lens[1], sum(lens)]
    return sum(lens), cu, max(lens)


def _malformed(case, ratio):
    """(cu list, max_seqlen, total_comp) of one malformation of _pack(ratio)."""
    T, cu, max_seqlen = _pack(ratio)
    total = None
    if case == "decreasing":
        cu[1], cu[2] = cu[2], cu[1]
    elif case == "first":
        cu[0] = 5
    elif case == "past_T":
        cu[-1] += 3 * ratio
        total = (T + 3 * ratio) // ratio
    elif case == "max_seqlen":
        max_seqlen = 2 * ratio  # the capacity it implies is below the true row count
    elif case == "total_comp":
        total = 3
    return cu, max_seqlen, total


def _cu(xs):
    return torch.tensor(xs, dtype=torch.int32, device="cuda")


def _nan_or_raise(step):
    """True where ``step()`` raised a clear error; else asserts its output and gradients
    hold NaN."""
    try:
        out, grads = step()
    except (ValueError, RuntimeError):
        return True
    assert out.isnan().any(), "finite output for a malformed pack"
    assert any(g is not None and g.isnan().any() for g in grads), "finite gradients"
    return False


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("numerics,fusion", [("fp32", "inside"), ("fp32", "torch"),
                                             ("megatron", "inside")])
@pytest.mark.parametrize("case", CASES)
def test_the_module_gives_nan_for_malformed_offsets_on_the_gpu(ratio, numerics, fusion, case):
    torch.manual_seed(0)
    m = Compressor(128, 64, ratio, rope_dim=16, dtype=torch.bfloat16, device="cuda",
                   numerics=numerics, epilogue_fusion=fusion)
    T, cu, max_seqlen = _pack(ratio)
    x = torch.randn(T, 128, device="cuda").to(torch.bfloat16)
    good, _ = m(x, _cu(cu), max_seqlen=max_seqlen)
    assert torch.isfinite(good).all()
    bad_cu, bad_max, total = _malformed(case, ratio)

    def step():
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out, _ = m(xi, _cu(bad_cu), max_seqlen=bad_max, total_comp=total)
        out.float().sum().backward()
        return out, [xi.grad] + [p.grad for p in m.parameters()]

    assert not _nan_or_raise(step), "the module's default GPU path raised instead of NaN"


@pytest.mark.parametrize("ratio,head_dim", [(4, 128), (128, 64)])
@pytest.mark.parametrize("options", [{}, {"epilogue": True, "projection": True}])
@pytest.mark.parametrize("case", CASES)
def test_megatrons_installed_compressor_gives_nan_or_raises_for_malformed_offsets(
        megatron_csa, ratio, head_dim, options, case):
    """Megatron's own code runs around the pooling under install() (its norm and RoPE read
    the offsets too), so a clear error from it also counts; with the epilogue and the
    projection installed every step is the package's and the rows are NaN."""
    from megatron.core.packed_seq_params import PackedSeqParams

    comp = build_compressor(megatron_csa, hidden=128, head_dim=head_dim, ratio=ratio,
                            rope_dim=32, dtype=torch.bfloat16).cuda()
    T, cu, max_seqlen = _pack(ratio)
    x = torch.randn(T, 1, 128, device="cuda").to(torch.bfloat16)
    bad_cu, bad_max, total = _malformed(case, ratio)
    # Megatron's forward takes its capacity from max_seqlen; a stated one goes to _forward_thd
    fixed = total if case == "total_comp" else None
    megatron.clear_fallback_reasons()

    def run(cu_list, mx, fixed):
        comp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        c = _cu(cu_list)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=c, cu_seqlens_kv=c,
                              max_seqlen_q=mx, max_seqlen_kv=mx)
        out, _ = comp._forward_thd(xi, c, mx, None, fixed) if fixed is not None else comp(xi, psp)
        out.float().sum().backward()
        return out, [xi.grad] + [p.grad for p in comp.parameters()]

    with megatron.installed(**options):
        good, _ = run(cu, max_seqlen, None)
        assert torch.isfinite(good).all()
        raised = _nan_or_raise(lambda: run(bad_cu, bad_max, fixed))
    assert not megatron.fallback_reasons(), megatron.fallback_reasons()
    if options:
        assert not raised, "every step is the package's: NaN, not an error"


def test_rotary_table_positions_outside_it_give_nan_rows_not_a_device_assert():
    """A device-side assert would end the process's CUDA use: positions outside the table
    make their rows NaN through the kernels' epilogue, the others keep their bits, and the
    device works on."""
    from csa_compressor import Epilogue, apply_epilogue

    dev = torch.device("cuda")
    x, w = torch.randn(6, 128, device=dev).bfloat16(), torch.ones(128, device=dev).bfloat16()
    ep = Epilogue(rope_dim=64, rotate=True)
    table = tuple(torch.randn(16, 32, device=dev) for _ in range(2))
    good = torch.tensor([0, 1, 2, 15, 3, 4], device=dev)
    want = apply_epilogue(x, w, good, ep, rope_table=table)
    got = apply_epilogue(x, w, torch.tensor([0, 16, 2, -1, 3, 1 << 40], device=dev), ep,
                         rope_table=table)
    torch.cuda.synchronize()
    assert got[[1, 3, 5]].isnan().all()
    assert torch.equal(got[[0, 2, 4]], want[[0, 2, 4]])


def test_a_reorder_index_out_of_range_on_the_gpu_marks_its_slot_bad():
    """Beam search's reorder with a device index (read nowhere: no sync): an index out of
    range, negative ones included (torch would wrap them onto another slot), sends its
    slot the spare's state and marks it bad; the next eager decode or prefill on it raises,
    other slots keep what the index gave them, and a reset clears it. Captured alike."""
    from csa_compressor import streaming

    st = streaming.StreamState(3, 64, ratio=4, coff=1, dtype=torch.float32, device="cuda",
                               max_next_n=1)
    kv, ape = torch.randn(12, 64, device="cuda"), torch.randn(4, 64, device="cuda")
    streaming.prefill(st, kv, kv, ape, [0, 5, 9, 12], [0, 1, 2])
    st.reorder(torch.tensor([2, -1, 0], device="cuda"))
    assert st.bad[:3].tolist() == [False, True, False]
    assert st.count[0].item() == 3 and st.count[2].item() == 5
    with pytest.raises(ValueError, match="slots: a slot met malformed input"):
        streaming.decode(st, kv[:3].view(3, 1, 64), kv[:3].view(3, 1, 64), ape)
    with pytest.raises(ValueError, match="slots: slot 1 met malformed input"):
        streaming.prefill(st, kv[:4], kv[:4], ape, [0, 4], [1])
    st.reset([1])
    streaming.decode(st, kv[:3].view(3, 1, 64), kv[:3].view(3, 1, 64), ape)
    index = torch.tensor([0, 1, 2], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st.reorder(index)
    index.copy_(torch.tensor([1, 7, 0]))
    before = st.count[:3].tolist()
    graph.replay()
    torch.cuda.synchronize()
    assert st.bad[:3].tolist() == [False, True, False]
    assert st.count[0].item() == before[1] and st.count[2].item() == before[0]
