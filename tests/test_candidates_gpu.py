"""Kernel candidates behind a config flag (kernels/config.py) against the default kernels.

A candidate changes how a kernel schedules its work, never its op order, so everything it
writes must be bitwise what the default writes, on buffers pre-filled with NaN (every
element written) and on packs whose row walks cross many segments inside one CTA. Once a
candidate is measured and made the default, its case here goes with the old code path.
"""

import contextlib

import pytest
import torch

from csa_compressor import pool_backward, pool_forward
from csa_compressor.kernels import compile as cc
from csa_compressor.kernels import config
from packs import CORRUPT_OFFSETS, make_pack

pytestmark = pytest.mark.gpu

SINGLE = [{name: 1} for name in config.CANDIDATES]
ALL_ON = {name: 1 for name in config.CANDIDATES}

_caches: dict = {}  # compiled kernels per override set, so each compiles once a process


@contextlib.contextmanager
def overridden(**values):
    """Compile and run with these config constants. The compile cache is not keyed by
    them, so each override set gets a cache of its own, swapped in and out here."""
    if not values:  # the defaults: the process-wide cache as it is
        yield
        return
    key = tuple(sorted(values.items()))
    default_cache = dict(cc._CACHE)
    saved = {k: getattr(config, k) for k in values}
    cc._CACHE.clear()
    cc._CACHE.update(_caches.get(key, {}))
    try:
        for k, v in values.items():
            setattr(config, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(config, k, v)
        _caches[key] = dict(cc._CACHE)
        cc._CACHE.clear()
        cc._CACHE.update(default_cache)


def _run(kv, score, ape, cu, cuc, N, ratio, coff, g):
    d = kv.shape[1] // coff
    nan = float("nan")
    out = torch.full((N, d), nan, dtype=kv.dtype, device="cuda")
    pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)
    dkv, dsc, dape = torch.full_like(kv, nan), torch.full_like(score, nan), torch.full_like(ape, nan)
    pool_backward(kv, score, ape, cu, cuc, g, dkv, dsc, dape, ratio=ratio, coff=coff)
    torch.cuda.synchronize()
    return out, dkv, dsc, dape


def _many_segments(seed, n=400, longest=60):
    """n segments of 0..longest tokens: row walks cross segments inside a CTA, and the
    segment searches need several rounds (2500: three of the warp search)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, longest + 1, (n,), generator=gen).tolist()


CASES = [  # (lens, head_dim, ratio, coff, dtype, extra rows: capacity padding or, < 0, a cut)
    ([37, 0, 3, 64, 129, 1, 8, 250], 128, 4, 2, torch.bfloat16, 3),
    ("many", 128, 4, 2, torch.bfloat16, 5),
    ("many", 512, 4, 2, torch.bfloat16, 0),
    ("many", 128, 4, 2, torch.bfloat16, -7),
    ("many", 65, 4, 1, torch.bfloat16, 2),
    ("many", 64, 8, 2, torch.float32, 1),
    ("many", 64, 3, 2, torch.float16, 0),
    ("many", 128, 1, 1, torch.bfloat16, 4),
    ([8192, 1000, 3], 512, 4, 2, torch.bfloat16, 0),
    ("many2500", 128, 4, 2, torch.bfloat16, 2),
    ("many", 512, 128, 1, torch.bfloat16, 3),  # ratio 128: the slot-parallel kernels
]


def _check_case(candidate, case):
    lens, d, ratio, coff, dtype, extra = CASES[case]
    if lens == "many":
        lens = _many_segments(case, longest=60 if ratio <= 8 else 400)
    elif lens == "many2500":
        lens = _many_segments(case, n=2500, longest=12)
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=5, extra_rows=max(extra, 0), seed=case)
    N = max(0, N + min(extra, 0))
    g = torch.randn(N, d, device="cuda").to(dtype)
    default = _run(kv, score, ape, cu, cuc, N, ratio, coff, g)
    with overridden(**candidate):
        cand = _run(kv, score, ape, cu, cuc, N, ratio, coff, g)
    for name, a, b in zip(("out", "dkv", "dscore", "dape"), default, cand):
        assert not torch.isnan(b).any(), f"{name}: elements left unwritten"
        assert torch.equal(a, b), f"{name}: differs from the default kernels"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_all_candidates_together_are_bitwise_the_default(case):
    _check_case(ALL_ON, case)


# Each candidate alone on many-segment packs at the production configuration (bf16, ratio
# 4, coff 2, d 128 and 512): 4 compiles a candidate, not one per case.
@pytest.mark.parametrize("candidate", SINGLE, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("case", [1, 2])
def test_each_candidate_is_bitwise_the_default(candidate, case):
    _check_case(candidate, case)


# Offsets a caller got wrong (packs.CORRUPT_OFFSETS): only staying in bounds and
# terminating count. T = 300 tokens, N = 40 rows.
GUARD = 64  # rows of sentinel before and after every buffer the kernels write


def _guarded(rows, width, dtype, fill):
    buf = torch.full((rows + 2 * GUARD, width), fill, dtype=dtype, device="cuda")
    return buf, buf[GUARD:GUARD + rows]


@pytest.mark.parametrize("candidate", [{}, ALL_ON], ids=["default", "all-candidates"])
@pytest.mark.parametrize("ratio,coff", [(4, 2), (1, 1), (3, 2), (128, 1)])
@pytest.mark.parametrize("offsets", range(len(CORRUPT_OFFSETS)))
def test_corrupt_offsets_stay_in_bounds_and_terminate(candidate, ratio, coff, offsets):
    T, N, d, dt = 300, 40, 64, torch.bfloat16
    W = coff * d
    gen = torch.Generator(device="cuda").manual_seed(offsets)
    kv = torch.randn(T, W, device="cuda", generator=gen).to(dt)
    score = torch.randn(T, W, device="cuda", generator=gen).to(dt)
    ape = torch.randn(ratio, W, device="cuda", generator=gen)
    cu = torch.tensor(CORRUPT_OFFSETS[offsets][0], dtype=torch.int32, device="cuda")
    cuc = torch.tensor(CORRUPT_OFFSETS[offsets][1], dtype=torch.int32, device="cuda")
    g = torch.randn(N, d, device="cuda", generator=gen).to(dt)
    sentinel = 3.0
    out_buf, out = _guarded(N, d, dt, sentinel)
    dkv_buf, dkv = _guarded(T, W, dt, sentinel)
    dsc_buf, dsc = _guarded(T, W, dt, sentinel)
    dape = torch.empty_like(ape)
    with overridden(**candidate):
        pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)
        pool_backward(kv, score, ape, cu, cuc, g, dkv, dsc, dape, ratio=ratio, coff=coff)
        torch.cuda.synchronize()  # an illegal address or a hang would surface here
    for name, buf in (("out", out_buf), ("dkv", dkv_buf), ("dscore", dsc_buf)):
        for guard in (buf[:GUARD], buf[-GUARD:]):
            assert (guard == sentinel).all(), f"{name}: a write landed outside the buffer"
