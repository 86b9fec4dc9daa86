"""Offsets whose contents break the layout: caught with an error naming the argument on
every CPU call (no device sync to read them), and on request elsewhere (check_offsets=True
or CSA_COMPRESSOR_CHECK_OFFSETS=1); strict integer
dtypes; cu_seqlens_comp derived when None; switches that reject unknown values."""

import pytest
import torch

from csa_compressor import compressed_cu_seqlens, maybe_compress_thd_fused, reference
from csa_compressor.dispatch import fused_unavailable_reason
from packs import make_pack

T, W, RATIO, COFF = 40, 8, 4, 2


def _inputs():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(T, W, generator=gen)
    return kv, torch.randn(T, W, generator=gen), torch.randn(RATIO, W, generator=gen)


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


GOOD_CU = [0, 13, 13, 38]
GOOD_CUC = compressed_cu_seqlens(_i32(GOOD_CU), RATIO).tolist()  # [0, 3, 3, 9]
BAD = [  # (cu_seqlens, cu_seqlens_comp, total_comp, argument named, words of the message)
    ([0, 20, 10, 38], None, 9, "cu_seqlens", "non-decreasing"),
    ([0, -8, 13, 38], None, 9, "cu_seqlens", "non-decreasing"),
    ([4, 13, 13, 38], None, 9, "cu_seqlens", "cu_seqlens[0] == 0"),
    ([0, 13, 13, 44], None, 11, "cu_seqlens", "past the 40 tokens"),
    (GOOD_CU, compressed_cu_seqlens(_i32(GOOD_CU), 2).tolist(), 20, "cu_seqlens_comp", "another ratio"),
    (GOOD_CUC, GOOD_CU, 40, "cu_seqlens_comp", "swapped"),
    (GOOD_CU, GOOD_CUC, 7, "total_comp", "has 9 rows"),
]


@pytest.mark.parametrize("cu,cuc,N,name,words", BAD)
def test_bad_offsets_are_caught_on_the_cpu_by_default_and_on_request(cu, cuc, N, name, words):
    kv, score, ape = _inputs()
    cu_t = _i32(cu)
    cuc_t = _i32(cuc) if cuc is not None else compressed_cu_seqlens(cu_t, RATIO)
    for check in (False, True):
        with pytest.raises(ValueError, match=name) as exc:
            reference.compress_thd(kv, score, ape, cu_t, cuc_t, N, ratio=RATIO, coff=COFF,
                                   check_offsets=check)
        assert words in str(exc.value)


MODULE_BAD = [  # (cu_seqlens, max_seqlen, total_comp, argument named, words of the message)
    ([0, 60, 37, 100], None, None, "cu_seqlens", "non-decreasing"),
    ([5, 37, 60, 100], None, None, "cu_seqlens", "cu_seqlens[0] == 0"),
    ([0, 37, 60, 140], None, 40, "cu_seqlens", "past the 100 tokens"),
    ([0, 37, 60, 100], 8, None, "total_comp", "understated max_seqlen"),
    ([0, 37, 60, 100], None, 3, "total_comp", "has 24 rows"),
]


@pytest.mark.parametrize("cu,max_seqlen,total_comp,name,words", MODULE_BAD)
def test_the_module_refuses_malformed_offsets_on_the_cpu(cu, max_seqlen, total_comp, name, words):
    from csa_compressor import Compressor

    torch.manual_seed(0)
    m = Compressor(32, 16, 4, rope_dim=8, dtype=torch.float32)
    x = torch.randn(100, 32)
    with pytest.raises(ValueError, match=name) as exc:
        m(x, _i32(cu), max_seqlen=max_seqlen, total_comp=total_comp)
    assert words in str(exc.value)


@pytest.mark.parametrize("cu,cuc,N,name,words", BAD[:3])
def test_the_environment_turns_the_check_on_for_every_call(monkeypatch, cu, cuc, N, name, words):
    kv, score, ape = _inputs()
    cu_t = _i32(cu)
    cuc_t = compressed_cu_seqlens(cu_t, RATIO)
    monkeypatch.setenv("CSA_COMPRESSOR_CHECK_OFFSETS", "1")
    with pytest.raises(ValueError, match=name):
        reference.compress_thd(kv, score, ape, cu_t, cuc_t, N, ratio=RATIO, coff=COFF)
    # The dispatch falls back here (no GPU) but still refuses the offsets.
    with pytest.raises(ValueError, match=name):
        maybe_compress_thd_fused(kv, score, ape, cu_t, cuc_t, N, ratio=RATIO, coff=COFF)


@pytest.mark.parametrize("lens,ratio,coff,extra", [([37, 0, 3, 64, 129, 1], 4, 2, 3),
                                                   ([8, 5], 1, 1, 0), ([300, 0, 127], 128, 1, 1)])
def test_valid_packs_pass_the_check(lens, ratio, coff, extra):
    kv, score, ape, cu, cuc, N = make_pack(lens, 4, ratio, coff, pad_tokens=3, extra_rows=extra)
    a = reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff, check_offsets=True)
    b = reference.compress_thd(kv, score, ape, cu, None, N, ratio=ratio, coff=coff)
    assert torch.equal(a, b)  # cu_seqlens_comp=None: derived from cu_seqlens


def test_offsets_of_bool_or_float_dtype_are_rejected():
    for bad in (torch.tensor([True, False, True]), torch.tensor([0.0, 8.5, 16.0])):
        with pytest.raises(TypeError, match="cu_seqlens"):
            compressed_cu_seqlens(bad, 4)
        kv, score, ape = _inputs()
        with pytest.raises(TypeError, match="cu_seqlens"):
            reference.compress_thd(kv, score, ape, bad, _i32([0, 1, 2]), 2, ratio=RATIO, coff=COFF)


@pytest.mark.parametrize("value", ["disable", "nope", "2", "enabled"])
def test_unknown_switch_values_are_errors(monkeypatch, value):
    kv, score, ape = _inputs()
    cu = _i32(GOOD_CU)
    cuc = compressed_cu_seqlens(cu, RATIO)
    monkeypatch.setenv("CSA_COMPRESSOR_FUSED", value)
    with pytest.raises(ValueError, match="CSA_COMPRESSOR_FUSED"):
        fused_unavailable_reason(kv, score, ape, cu, cuc, 9, ratio=RATIO, coff=COFF)
    monkeypatch.delenv("CSA_COMPRESSOR_FUSED")
    monkeypatch.setenv("CSA_COMPRESSOR_CHECK_OFFSETS", value)
    with pytest.raises(ValueError, match="CSA_COMPRESSOR_CHECK_OFFSETS"):
        reference.compress_thd(kv, score, ape, cu, cuc, 9, ratio=RATIO, coff=COFF)


@pytest.mark.parametrize("value", ["0", "off", "False", "no"])
def test_the_kill_switch_spellings_turn_it_off(monkeypatch, value):
    kv, score, ape = _inputs()
    cu = _i32(GOOD_CU)
    monkeypatch.setenv("CSA_COMPRESSOR_FUSED", value)
    reason = fused_unavailable_reason(kv, score, ape, cu, compressed_cu_seqlens(cu, RATIO), 9,
                                      ratio=RATIO, coff=COFF)
    assert reason.startswith("disabled by the environment")


@pytest.mark.parametrize("value", ["no", 0, None])
def test_enabled_and_check_offsets_take_bools(value):
    kv, score, ape = _inputs()
    cu = _i32(GOOD_CU)
    cuc = compressed_cu_seqlens(cu, RATIO)
    with pytest.raises(TypeError, match="enabled"):
        maybe_compress_thd_fused(kv, score, ape, cu, cuc, 9, ratio=RATIO, coff=COFF, enabled=value)
    with pytest.raises(TypeError, match="check_offsets"):
        reference.compress_thd(kv, score, ape, cu, cuc, 9, ratio=RATIO, coff=COFF, check_offsets=value)


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=6), ratio=st.integers(1, 8),
       extra=st.integers(0, 3), where=st.integers(0, 10), by=st.integers(1, 50),
       seed=st.integers(0, 999))
def test_valid_packs_pass_and_any_broken_offset_is_caught(lens, ratio, extra, where, by, seed):
    kv, score, ape, cu, cuc, N = make_pack(lens, 3, ratio, 2, pad_tokens=2, extra_rows=extra,
                                           seed=seed)
    reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=ratio, coff=2, check_offsets=True)
    # Moving one interior offset below its predecessor, or the last past T, must be caught.
    bad = cu.clone()
    i = 1 + where % (bad.numel() - 1)
    bad[i] = bad[i - 1] - by if i < bad.numel() - 1 or where % 2 else kv.shape[0] + by
    with pytest.raises(ValueError, match="cu_seqlens"):
        reference.compress_thd(kv, score, ape, bad, compressed_cu_seqlens(bad.clamp_min(0), ratio),
                               N, ratio=ratio, coff=2, check_offsets=True)


def test_the_environment_check_is_not_swallowed_on_the_fused_path(monkeypatch, fused_on_cpu):
    """With CSA_COMPRESSOR_CHECK_OFFSETS=1, bad offsets that would take the fused path
    raise (the capability check must not turn them into a fallback reason)."""
    kv, score, ape = _inputs()
    cu = _i32([0, 20, 10, 38])
    cuc = compressed_cu_seqlens(cu, RATIO)
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing"):
        maybe_compress_thd_fused(kv, score, ape, cu, cuc, 9, ratio=RATIO, coff=COFF)  # CPU offsets
    monkeypatch.setenv("CSA_COMPRESSOR_CHECK_OFFSETS", "1")
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing"):
        maybe_compress_thd_fused(kv, score, ape, cu, cuc, 9, ratio=RATIO, coff=COFF)
    good = _i32(GOOD_CU)
    out = maybe_compress_thd_fused(kv, score, ape, good, compressed_cu_seqlens(good, RATIO), 9,
                                   ratio=RATIO, coff=COFF)
    assert out.shape == (9, 4)
