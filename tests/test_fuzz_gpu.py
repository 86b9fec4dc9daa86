"""Property-based fuzzing of the fused op on the GPU (hypothesis): random ragged packs
(empty and short segments, token padding, capacity padding, a capacity below the true row
count), every dtype, odd head_dims, against the fp32 reference; and random corrupt
offsets, which must stay inside every buffer and terminate. Run it under
compute-sanitizer for the reliability figure:

    compute-sanitizer --tool memcheck python -m pytest -q -m gpu tests/test_fuzz_gpu.py

CSA_FUZZ_EXAMPLES sets the number of cases a property draws (default 200)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from csa_compressor import compress_thd_fused, reference
from csa_compressor.kernel_api import pool_backward, pool_forward
from packs import make_pack
from test_fused_gpu import _grads, assert_forward_contract

pytestmark = pytest.mark.gpu
EXAMPLES = int(os.environ.get("CSA_FUZZ_EXAMPLES", "200"))
# Specialisations drawn from (each compiles once): every kernel family and dtype, odd widths.
SPECS = [(4, 2, 128, torch.bfloat16), (4, 2, 64, torch.float16), (4, 1, 33, torch.float32),
         (2, 2, 65, torch.bfloat16), (1, 1, 64, torch.bfloat16), (3, 2, 96, torch.float32),
         (8, 2, 64, torch.bfloat16), (16, 2, 33, torch.bfloat16), (128, 1, 64, torch.bfloat16),
         (5, 1, 128, torch.float16)]
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(spec=st.sampled_from(SPECS),
       lens=st.lists(st.integers(0, 300), min_size=1, max_size=9),
       pad=st.integers(0, 9), extra=st.integers(-4, 4), seed=st.integers(0, 2**16))
def test_random_packs_keep_the_contract(spec, lens, pad, extra, seed):
    ratio, coff, d, dtype = spec
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=pad, seed=seed)
    N = max(0, N + extra)  # capacity padding rows, or a capacity below the true count
    g = torch.randn(N, d, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    g = g.to(dtype)
    fused = _grads(compress_thd_fused, kv, score, ape, cu, cuc, N, ratio, coff, g)
    ref = _grads(lambda *a, **k: reference.compress_thd(*a, mode="fp32", **k), kv, score, ape,
                 cu, cuc, N, ratio, coff, g)
    assert_forward_contract(fused[0], ref[0])
    assert torch.equal(fused[1], ref[1]) and torch.equal(fused[2], ref[2])
    torch.testing.assert_close(fused[3], ref[3], rtol=0, atol=1e-3)


GUARD = 16


@FUZZ
@given(spec=st.sampled_from(SPECS),
       cu=st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(-50, 400), min_size=2, max_size=12),
       cuc_shift=st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(-20, 60), min_size=12, max_size=12),
       N=st.integers(0, 48))
def test_corrupt_offsets_stay_in_bounds(spec, cu, cuc_shift, N):
    """Offsets are never read on the host, so anything may arrive: the kernels write only
    inside their buffers and return."""
    ratio, coff, d, dtype = spec
    T, W = 300, coff * d
    kv = torch.randn(T, W, device="cuda").to(dtype)
    score, ape = torch.randn_like(kv), torch.randn(ratio, W, device="cuda")
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    cuc_t = torch.tensor(cuc_shift[:len(cu)], dtype=torch.int32, device="cuda")

    def guarded(rows, width, dt):
        buf = torch.full((rows + 2 * GUARD, width), 3.0, dtype=dt, device="cuda")
        return buf, buf[GUARD:GUARD + rows]

    ob, out = guarded(N, d, dtype)
    kb, dkv = guarded(T, W, dtype)
    sb, dsc = guarded(T, W, dtype)
    pool_forward(kv, score, ape, cu_t, cuc_t, out, ratio=ratio, coff=coff)
    pool_backward(kv, score, ape, cu_t, cuc_t, torch.randn(N, d, device="cuda").to(dtype), dkv,
                  dsc, torch.empty_like(ape), ratio=ratio, coff=coff)
    torch.cuda.synchronize()
    for buf in (ob, kb, sb):
        assert (buf[:GUARD] == 3.0).all() and (buf[-GUARD:] == 3.0).all()


@FUZZ
@given(spec=st.sampled_from(SPECS),
       ids=st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(-3, 12), min_size=1, max_size=40),
       seed=st.integers(0, 2**16))
def test_any_group_ids_give_the_reference_rows(spec, ids, seed):
    """Group ids of any value: the grouped op's offsets are built from them on the device
    and are always a valid pack, so the rows are the reference's and nothing is read or
    written out of bounds."""
    from csa_compressor import compress_grouped
    from csa_compressor.grouped import compress_grouped_reference

    ratio, coff, d, dtype = spec
    gen = torch.Generator("cuda").manual_seed(seed)
    G = len(ids)
    kv = torch.randn(G * ratio, coff * d, device="cuda", generator=gen).to(dtype)
    score = torch.randn(G * ratio, coff * d, device="cuda", generator=gen).to(dtype)
    ape = torch.randn(ratio, coff * d, device="cuda", generator=gen)
    group_ids = torch.tensor(ids, dtype=torch.int64, device="cuda")
    got = compress_grouped(kv, score, ape, group_ids, ratio=ratio, coff=coff)
    want = compress_grouped_reference(kv, score, ape, group_ids, ratio=ratio, coff=coff)
    assert_forward_contract(got, want)
